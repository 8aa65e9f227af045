"""A script that leaves its loader open and exits must exit cleanly.

Daemon threads caught inside a torch call while the interpreter finalizes abort the process;
the loader therefore stops its threads from an ``atexit`` hook. The child process checks, from
a hook that runs after the loader's own, that no loader thread is left running.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import pytest
import torch

import hsstore
from hsstore import LayerSpec
from tools.synthetic import random_sample

ROOT = Path(__file__).resolve().parents[1]

CHILD = textwrap.dedent(
    """
    import atexit, sys, threading

    def report():  # atexit runs hooks last-registered first: this one runs after hsstore's
        alive = sorted(t.name for t in threading.enumerate() if t.name.startswith("hsstore-plan"))
        print("alive:" + ",".join(alive), flush=True)

    atexit.register(report)

    import hsstore
    from hsstore.loader import Loader

    loader = Loader(hsstore.open(sys.argv[1]), max_tokens=256, num_threads=int(sys.argv[3]),
                    prefetch=2)
    for k, batch in enumerate(loader):
        if k == int(sys.argv[2]):
            break  # leave the loader open, mid-epoch, and exit
    print("broke out", flush=True)
    """
)


def small_dataset(path: Path, samples: int) -> Path:
    ds = hsstore.create(path, layers=[LayerSpec(1), LayerSpec(2)], hidden_size=64,
                        dtype=torch.bfloat16)  # fmt: skip
    with ds.writer() as w:
        for i in range(samples):
            w.add(f"s{i}", *random_sample(30 + i, 2, 64, seed=i))
    return path


@pytest.mark.parametrize("threads", [1, 2])
def test_exit_with_an_open_loader_stops_its_threads(tmp_path, threads):
    path = small_dataset(tmp_path / "ds", 40)
    for stop_after in (0, 3):
        proc = subprocess.run(
            [sys.executable, "-c", CHILD, str(path), str(stop_after), str(threads)],
            cwd=ROOT, capture_output=True, text=True, timeout=120,
        )  # fmt: skip
        assert proc.returncode == 0, proc.stderr
        lines = proc.stdout.split()
        assert lines == ["broke", "out", "alive:"], (lines, proc.stderr)
        assert "Exception ignored" not in proc.stderr, proc.stderr


# A script holding a loader in a module global, that also imports the loader's module by
# name: at exit that module's globals are torn down first, so a __del__ that reaches for them
# prints "Exception ignored ... 'NoneType' object has no attribute 'suppress'".
MODULE_GLOBAL_CHILD = textwrap.dedent(
    """
    import sys
    import hsstore.loader.train_loader as train_loader
    from hsstore.loader import Loader

    loader = Loader(sys.argv[1], max_tokens=256, num_threads=int(sys.argv[2]), prefetch=2)
    for epoch in range(2):
        loader.set_epoch(epoch)
        batches = sum(1 for _ in loader)
        loader.close()
    print("batches", batches, train_loader.Loader is Loader, flush=True)
    """
)


@pytest.mark.parametrize("threads", [1, 2])
def test_exit_with_a_loader_in_a_module_global_prints_nothing(tmp_path, threads):
    path = small_dataset(tmp_path / "ds", 12)
    proc = subprocess.run(
        [sys.executable, "-c", MODULE_GLOBAL_CHILD, str(path), str(threads)],
        cwd=ROOT, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split()[0] == "batches" and int(proc.stdout.split()[1]) > 1, proc.stdout
    assert proc.stderr == "", proc.stderr


def test_close_waits_for_a_producer_inside_a_slow_storage_call(tmp_path, monkeypatch):
    """A producer still inside a storage call when ``close`` returns would be a daemon thread
    in a compiled call at exit: ``close`` returns only once it has left it, even when that
    takes longer than its first wait."""
    from hsstore.loader import Loader, fetch
    from hsstore.storage.locations import open_storage
    from tests.faults import Fault, FaultyStorage

    path = small_dataset(tmp_path / "ds", 40)
    reached, armed = threading.Event(), threading.Event()

    def plan(call):  # slow down the producer's own storage calls once armed
        if armed.is_set() and threading.current_thread().name == "hsstore-plan":
            return Fault("pause", seconds=1.0, reached=reached)
        return None

    earlier = set(threading.enumerate())  # other tests' loaders may still be collected
    # one decode thread: the producer reads the batch's chunks itself
    loader = Loader(hsstore.open(FaultyStorage(open_storage(str(path)), plan)), max_tokens=64,
                    num_threads=1, prefetch=1)  # fmt: skip
    batches = iter(loader)
    next(batches)
    armed.set()
    next(batches)  # frees a buffer: the producer goes on to plan and read the next batch
    assert reached.wait(10), "the producer made no storage call"
    monkeypatch.setattr(fetch, "FIRST_JOIN_S", 0.05)
    loader.close()
    alive = [t.name for t in set(threading.enumerate()) - earlier if t.name == "hsstore-plan"]
    assert alive == []
