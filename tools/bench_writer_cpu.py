"""CPU cost of the writer path per token, split by stage.

Writes samples shaped like the extraction benchmark's (hidden 7168, 4 layers, bf16, 512-token
samples, the default codec) through `Dataset.writer()` on a local folder and reports the
process CPU time (every thread) per token, and how much of it each stage took: the checks of
`Writer.add`, the sample checksum, filling the shard buffer (the copy, and where compiled the
checksum and the rows' magnitudes with it), the statistics, encoding (byte planes, zstd,
crc32c), file writes and syncs, commits; the rest (bookkeeping) is ``other``.

Stages are timed with per-thread CPU clocks around the library's own functions, so the split
holds with the encode threads busy; the total is the process's CPU time. CPU time, not wall
time: on a CPU engine every CPU-second of storing is one the forward waits for.

    python tools/bench_writer_cpu.py                 # ~1.5 GB written, under a minute
    python tools/bench_writer_cpu.py --samples 8     # smaller
    HSSTORE_DIRECT_WRITES=0 python tools/bench_writer_cpu.py   # shards through the page cache

The last line is machine-readable (``--json``: one JSON object instead): microseconds of CPU per
token in all and by stage, then ``encode_share`` (of the total; zstd's own entropy coding is most
of encoding), ``gc_included`` (Python's cycle collections, counted in the stages too), the
wall time per token, and the wall time of the run's last commit (the one that closes the
segment: its files made durable, then the version published):
    cpu_us_per_token=... check=... checksum=... fill=... stats=... encode=... write=... commit=...
    other=... encode_share=... gc_included=... wall_us_per_token=... last_commit_ms=...
"""

from __future__ import annotations

import argparse
import functools
import gc
import json
import shutil
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script from anywhere

import torch  # noqa: E402

import hsstore  # noqa: E402
from hsstore import LayerSpec  # noqa: E402
from hsstore.codec.codecs import ChunkCodec  # noqa: E402
from hsstore.dataset import writer as dataset_writer  # noqa: E402
from hsstore.segment import writer as segment_writer  # noqa: E402
from hsstore.segment.stats import StatsAccumulator  # noqa: E402
from hsstore.storage.local_store import LocalStorage  # noqa: E402
from hsstore.tuning import tune_process  # noqa: E402
from tools.synthetic import random_sample  # noqa: E402

WARM_UP_SAMPLES = 6
STAGES = ("check", "checksum", "fill", "stats", "encode", "write", "commit")


class StageClock:
    """Per-thread CPU seconds spent inside wrapped functions, summed over threads by stage.
    A stage entered from inside another is charged to the outer one only."""

    def __init__(self) -> None:
        self.seconds = dict.fromkeys(STAGES, 0.0)
        self.gc_seconds = 0.0
        self._lock = threading.Lock()
        self._local = threading.local()

    def gc_callback(self, phase: str, info: dict[str, Any]) -> None:
        """Python's cycle collections, timed apart (they also count in the stage they
        interrupt)."""
        if phase == "start":
            self._local.gc_start = time.thread_time()
        elif hasattr(self._local, "gc_start"):
            with self._lock:
                self.gc_seconds += time.thread_time() - self._local.gc_start

    def wrap(self, stage: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(fn)
        def timed(*args: Any, **kwargs: Any) -> Any:
            if getattr(self._local, "inside", False):
                return fn(*args, **kwargs)
            self._local.inside = True
            t0 = time.thread_time()
            try:
                return fn(*args, **kwargs)
            finally:
                spent = time.thread_time() - t0
                self._local.inside = False
                with self._lock:
                    self.seconds[stage] += spent

        return timed


def instrument(clock: StageClock) -> None:
    """Wrap the functions of each stage where the writer path calls them."""
    for module, name, stage in (
        (dataset_writer, "check_sample", "check"),
        (dataset_writer, "check_names", "check"),
        (dataset_writer, "check_scales", "check"),
        (segment_writer, "sample_checksum", "checksum"),
    ):
        setattr(module, name, clock.wrap(stage, getattr(module, name)))
    for cls, name, stage in (
        (segment_writer.SegmentWriter, "_append_rows", "fill"),
        (StatsAccumulator, "update_block", "stats"),
        (ChunkCodec, "encode", "encode"),
        (ChunkCodec, "encode_planes", "encode"),
        (LocalStorage, "write_file", "write"),
        (LocalStorage, "sync", "write"),
        (dataset_writer.Writer, "commit", "commit"),
    ):
        if hasattr(cls, name):  # (code before a function was there: compared with it)
            setattr(cls, name, clock.wrap(stage, getattr(cls, name)))


def run(samples: int, tokens: int, hidden: int, layers: int, commit_every: int) -> dict[str, Any]:
    tune_process()  # as the command line's extraction runs
    clock = StageClock()
    instrument(clock)
    distinct = [random_sample(tokens, layers, hidden, seed=k) for k in range(4)]
    work = Path(tempfile.mkdtemp(prefix="hsstore-writer-cpu-"))
    try:
        ds = hsstore.create(work / "ds", layers=[LayerSpec(k + 1) for k in range(layers)],
                            hidden_size=hidden, dtype=torch.bfloat16)  # fmt: skip
        with ds.writer() as w:
            # Warm-up: an extraction keeps one writer, whose two shard buffers, thread pools
            # and imports are warm after its first shards.
            for i in range(WARM_UP_SAMPLES):
                ids, mask, states = distinct[i % len(distinct)]
                w.add(f"warm{i}", ids, mask, states)
            w.commit()
            clock.seconds = dict.fromkeys(STAGES, 0.0)
            gc.callbacks.append(clock.gc_callback)
            cpu0, wall0 = time.process_time(), time.perf_counter()
            for i in range(samples):
                ids, mask, states = distinct[i % len(distinct)]
                w.add(f"s{i}", ids, mask, states)
                if (i + 1) % commit_every == 0:
                    w.commit()
            last = time.perf_counter()
            w.commit()
            end = time.perf_counter()
            cpu, wall, last = time.process_time() - cpu0, end - wall0, end - last
            gc.callbacks.remove(clock.gc_callback)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    n = samples * tokens
    staged = {k: 1e6 * v / n for k, v in clock.seconds.items()}
    result = {"cpu_us_per_token": 1e6 * cpu / n, **staged}
    result["other"] = result["cpu_us_per_token"] - sum(staged.values())
    result["encode_share"] = result["encode"] / result["cpu_us_per_token"]
    result["gc_included"] = 1e6 * clock.gc_seconds / n
    result["wall_us_per_token"] = 1e6 * wall / n
    result["last_commit_ms"] = 1e3 * last
    return result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--samples", type=int, default=48)
    ap.add_argument("--tokens", type=int, default=512)
    ap.add_argument("--hidden", type=int, default=7168)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--commit-every", type=int, default=512)  # as `hsstore extract`
    ap.add_argument("--json", action="store_true", help="one JSON object instead of lines")
    args = ap.parse_args()
    result = run(args.samples, args.tokens, args.hidden, args.layers, args.commit_every)
    if args.json:
        print(json.dumps(result))
        return
    total = result["cpu_us_per_token"]
    for key in (*STAGES, "other"):  # the process's CPU time, split
        print(f"{key:>9}: {result[key]:7.2f} us/token  {100 * result[key] / total:5.1f}%")
    print(" ".join(f"{k}={v:.2f}" for k, v in result.items()))


if __name__ == "__main__":
    main()
