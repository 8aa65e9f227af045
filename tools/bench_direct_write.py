"""What writing shard files costs the host's cores: around the page cache against through it.

Writes ``--gib`` GiB as 64 MiB files (the default shard size), each one `LocalStorage.write_file`
of 1 MiB pieces and a `sync`, as the segment writer does, first with direct writes on, then
off (``HSSTORE_DIRECT_WRITES=0``), then on and off again; each pass's files are removed
after it. Per 56 KiB token (four bf16 states of 7168): the writing thread's CPU time, the CPU
time of the whole machine (the kernel's writeback and reclaim included; other work counts
too, so run it on a quiet machine) and the wall time. Each pass is reported for its first
and its last quarter of files: a pass that writes more than the page cache can hold ends in
the cache's steady state, where every new page is one reclaimed.

    python tools/bench_direct_write.py                # 8 GiB a pass, under two minutes
    python tools/bench_direct_write.py --gib 32       # past the memory of a 24 GiB machine

The last line is machine-readable: each way's machine-wide CPU per token over all its passes
and quarters, and their ratio (buffered over direct):
    direct_sys_us_per_token=... buffered_sys_us_per_token=... buffered_vs_direct=...
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script from anywhere

import numpy as np  # noqa: E402

from hsstore.storage.local_store import LocalStorage  # noqa: E402

FILE_BYTES = 64 << 20
PIECE_BYTES = 1 << 20
TOKEN_BYTES = 4 * 7168 * 2


def machine_cpu_s() -> float:
    """CPU seconds the whole machine has spent busy (every core, kernel threads included)."""
    with open("/proc/stat") as stat:
        fields = [int(v) for v in stat.readline().split()[1:]]
    return (sum(fields) - fields[3] - fields[4]) / os.sysconf("SC_CLK_TCK")


def one_pass(folder: str, files: int, direct: bool, pieces: list[memoryview]) -> list[tuple]:
    """Write ``files`` files; for each, (thread CPU s, machine CPU s, wall s)."""
    store = LocalStorage(folder, direct_writes=direct)
    costs = []
    for k in range(files):
        t0, m0, w0 = time.thread_time(), machine_cpu_s(), time.perf_counter()
        store.write_file(f"shard{k}", pieces)
        store.sync([f"shard{k}"])
        costs.append((time.thread_time() - t0, machine_cpu_s() - m0, time.perf_counter() - w0))
    store.close()
    return costs


def per_token_us(costs: list[tuple], which: int) -> float:
    return statistics.fmean(c[which] for c in costs) / (FILE_BYTES / TOKEN_BYTES) * 1e6


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gib", type=float, default=8.0, help="GiB written per pass")
    ap.add_argument("--dir", default=None, help="where to write (default: the system's temp)")
    args = ap.parse_args()
    files = max(4, int(args.gib * (1 << 30) // FILE_BYTES))
    data = np.random.default_rng(0).integers(0, 256, FILE_BYTES, dtype=np.uint8)
    pieces = [memoryview(data[i : i + PIECE_BYTES]) for i in range(0, FILE_BYTES, PIECE_BYTES)]
    machine = {True: [], False: []}
    for direct in (True, False, True, False):
        folder = tempfile.mkdtemp(prefix="hsstore-bench-direct-", dir=args.dir)
        try:
            costs = one_pass(folder, files, direct, pieces)
        finally:
            shutil.rmtree(folder, ignore_errors=True)
        machine[direct] += costs
        way = "direct  " if direct else "buffered"
        q = max(1, files // 4)
        for name, part in (("first quarter", costs[:q]), ("last quarter", costs[-q:])):
            print(
                f"{way} {name}: thread {per_token_us(part, 0):.1f} us/token, "
                f"machine {per_token_us(part, 1):.1f}, wall {per_token_us(part, 2):.1f}",
                flush=True,
            )
    direct_us, buffered_us = per_token_us(machine[True], 1), per_token_us(machine[False], 1)
    print(
        f"direct_sys_us_per_token={direct_us:.1f} buffered_sys_us_per_token={buffered_us:.1f} "
        f"buffered_vs_direct={buffered_us / direct_us:.1f}"
    )


if __name__ == "__main__":
    main()
