"""What a benchmark phase costs its processes: CPU seconds, peak private and shared memory.

The extraction benchmarks (tools/bench_sglang.py, tools/bench_vllm.py) measure a process and
the engine processes below it. Each phase runs in a fresh spawned process, one engine per
process: what an inference engine leaves behind when it shuts down (memory, threads, child
processes) would otherwise count in the next phase's figures, and a spawned process starts
clean of the parent's threads and imports, which a forked one would inherit.
"""

from __future__ import annotations

import contextlib
import json
import multiprocessing as mp
import os
import queue as queues
import threading
import time
from typing import Any

from tools.process_memory import status_kb


def process_tree() -> list[Any]:
    """This process and every process below it (the engine's), as ``psutil`` processes."""
    import psutil

    me = psutil.Process()
    return [me, *me.children(recursive=True)]


def cpu_s(procs: list[Any]) -> float:
    """CPU seconds used so far by ``procs`` (this process and the engine's)."""
    total = 0.0
    for p in procs:
        with contextlib.suppress(OSError):
            t = p.cpu_times()
            total += t.user + t.system
    return total


class PeakMemory:
    """Peak private memory (RssAnon) of ``procs``, sampled every 5 ms, and of the shared memory
    a capture directory holds (each page once, however many processes map it)."""

    def __init__(self, procs: list[Any], capture_dir: str | None):
        self.procs, self.capture_dir = procs, capture_dir
        self.anon = self.shared = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _sample(self) -> None:
        anon = 0
        for p in self.procs:
            with contextlib.suppress(OSError):  # a process that has exited holds nothing
                anon += status_kb("RssAnon", str(p.pid)) * 1024
        shared = 0
        if self.capture_dir:
            for entry in os.scandir(self.capture_dir):
                with contextlib.suppress(OSError):  # a slot renamed while scanning
                    shared += entry.stat().st_blocks * 512
        self.anon, self.shared = max(self.anon, anon), max(self.shared, shared)

    def _run(self):
        while not self._stop.is_set():
            self._sample()
            time.sleep(0.005)

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()
        self._sample()


def _send_result(queue: Any, fn: Any, args: tuple) -> None:
    queue.put(fn(*args))


def phase(name: str, fn: Any, *fn_args: Any) -> dict[str, Any]:
    """``fn(*fn_args)`` in a fresh process, its result printed as it comes (a long run shows
    where it is)."""
    result = in_process(fn, *fn_args)
    print(json.dumps({name: result}), flush=True)
    return result


def in_process(fn, *args) -> dict[str, Any]:
    """``fn(*args)`` in a fresh process (not a daemon: an engine may start children of its
    own)."""
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    proc = ctx.Process(target=_send_result, args=(queue, fn, args))
    proc.start()
    try:
        while True:
            try:
                return queue.get(timeout=5)
            except queues.Empty:
                if not proc.is_alive():
                    raise RuntimeError(f"{fn.__name__} died (exit code {proc.exitcode})") from None
    finally:
        proc.join()
