"""Where the loader's small-sample time goes: the same reads into batch buffers or one buffer.

Figure F of ``tools/bench_peers.py`` divides the loader's rate (one decode thread, 8192-token
batches) by sequential ``read_hidden_into`` calls into one reused sample buffer. This harness
splits the gap on the same uncompressed MiniLM data (``[T, 7, 384]`` bf16, ~0.7 MB a sample),
one thread, every case interleaved round after round in one process:

* ``raw, one buffer`` / ``raw, batch ring``: only ``preadv`` + XXH3 of each sample's bytes
  (its rows in the state files, read whole), into one reused buffer or into the loader's plan
  positions in a ring of ``--ring`` batch buffers (``--huge``: the loader's own, in 2 MiB pages
  where the kernel has them, `host_memory`): the cost of writing into memory that is not in
  cache;
* ``raw without XXH3, one buffer`` / ``batch ring``: the same reads, unhashed: the kernel's
  copy alone, into a buffer that stays in cache or into memory that does not (what a loader's
  decode thread pays when the checksums are taken elsewhere); ``+ XXH3 on a thread`` / ``in a
  process``: with as many bytes hashed sample by sample, one batch behind the reads, as the
  loader's checker does, by a thread of this process or by a child process (the thread
  shares the interpreter's lock with the reads, the process only the memory traffic);
* ``read_hidden_into, one buffer`` (the benchmark's ``seq``) / ``..., batch ring``: the core's
  per-sample read, checks and checksum included;
* ``read_hidden_many_into, batch ring``: the loader's path (out checked once per batch);
* ``loader``: the Loader itself, as ``bench_peers.loader_gb_s`` runs it (closed every epoch);
* ``loader, verify_reads=False``: the same without the sample checksums (its checker thread):
  what verifying costs the loader although the checker has a core of its own.

    python tools/bench_batch_buffers.py [--samples 300] [--rounds 8] [--ring 3] [--huge]
                                        [--data DATASET]

Prints the median GB/s of each case and its ratio to ``read_hidden_into, one buffer``.
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import shutil
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script from anywhere

import numpy as np  # noqa: E402
import torch  # noqa: E402
import xxhash  # noqa: E402

import hsstore  # noqa: E402
from hsstore import LayerSpec  # noqa: E402
from hsstore.dataset import batch_reads  # noqa: E402
from hsstore.loader import Loader  # noqa: E402
from hsstore.loader.collate import host_memory  # noqa: E402
from hsstore.spec import paths  # noqa: E402

MAX_TOKENS = 8192


def _hash_batches(conn, nbytes: int) -> None:
    """Serve `BesideHasher`: for each list of piece sizes received, hash that many pieces of a
    buffer of ``nbytes`` one after another (XXH3, as the loader's checker takes each sample)."""
    buf = np.ones(nbytes, np.uint8)
    while (sizes := conn.recv()) is not None:
        at = 0
        for n in sizes:
            xxhash.xxh3_64(buf[at : at + n]).intdigest()
            at += n
        conn.send(True)


class BesideHasher:
    """The loader checker's hashing, one batch behind the reads, on memory of its own: on a
    thread of this process (sharing the interpreter's lock with the reads) or in a child
    process (sharing only the machine's memory traffic)."""

    def __init__(self, nbytes: int, process: bool):
        self._conn, theirs = multiprocessing.Pipe()
        worker = multiprocessing.get_context("fork").Process if process else threading.Thread
        self._worker = worker(target=_hash_batches, args=(theirs, nbytes), daemon=True)
        self._worker.start()
        self._busy = False

    def batch(self, sizes: list[int]) -> None:
        """Hash a batch of pieces once the previous batch is hashed."""
        self.wait()
        self._conn.send(sizes)
        self._busy = True

    def wait(self) -> None:
        if self._busy:
            self._conn.recv()
            self._busy = False

    def close(self) -> None:
        self.wait()
        self._conn.send(None)
        self._worker.join()


def main(argv: list[str] | None = None) -> dict[str, float]:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--samples", type=int, default=300)
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--ring", type=int, default=3, help="batch buffers (the loader has 3)")
    ap.add_argument("--huge", action="store_true", help="ring in 2 MiB pages")
    ap.add_argument("--workdir", type=Path, default=None)
    ap.add_argument("--data", type=Path, default=None, help="an uncompressed dataset to reuse")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    if args.data is not None:
        return run(hsstore.open(args.data), args)
    work = Path(tempfile.mkdtemp(prefix="hsstore-buffers-", dir=args.workdir))
    try:
        from tools.real_states import minilm_states

        samples = minilm_states(args.samples, layers=tuple(range(7)))
        ds = hsstore.create(work / "ds", layers=[LayerSpec(k + 1) for k in range(7)],
                            hidden_size=384, dtype=torch.bfloat16, codec="none")  # fmt: skip
        with ds.writer(encode_threads=1) as w:
            for i, (ids, states) in enumerate(samples):
                w.add(f"s{i}", ids, torch.ones_like(ids), states)
        return run(hsstore.open(work / "ds"), args)
    finally:
        shutil.rmtree(work, ignore_errors=True)


def run(ds: hsstore.Dataset, args: argparse.Namespace) -> dict[str, float]:
    row = len(ds.layers) * ds.hidden_size  # values per token
    lens = [ds.num_tokens_of(i) for i in range(len(ds))]
    nbytes = sum(lens) * row * 2
    one = torch.empty(max(lens) * row, dtype=torch.bfloat16)
    ring = [
        host_memory(MAX_TOKENS * row, torch.bfloat16, pin=False, zeroed=True)
        if args.huge
        else torch.zeros(MAX_TOKENS * row, dtype=torch.bfloat16)
        for _ in range(args.ring)
    ]
    loader = Loader(ds.path, max_tokens=MAX_TOKENS, seed=0, num_threads=1, prefetch=2)
    unverified = Loader(ds.path, max_tokens=MAX_TOKENS, seed=0, num_threads=1, prefetch=2,
                        verify_reads=False)  # fmt: skip
    # Each sample's bytes in the state files: uncompressed, all layers in one chunk, a sample's
    # rows sit back to back but for a 4-byte crc32c after each chunk, so read them whole from
    # the first row (the junk crc bytes cost a few bytes more than the sample).
    seg = ds.segment_reader(0)
    layout = ds.manifest.layout
    rpc, cps, rb = layout.rows_per_chunk, layout.chunks_per_shard, row * 2
    fds: dict[int, int] = {}
    where = []
    for i in range(len(ds)):
        if int(ds.index.column("segment")[i].as_py()) != 0:
            raise SystemExit("expects a single-segment dataset")
        first = int(ds.index.column("row_offset")[i].as_py())
        shard, c = divmod(first // rpc, cps)
        if shard not in fds:
            fds[shard] = os.open(seg.where(paths.shard_relpath(shard)), os.O_RDONLY)
        offset = seg.shard_index(shard).chunk(c, 0)[0] + (first - first // rpc * rpc) * rb
        where.append((fds[shard], offset, lens[i] * rb))
    ring_bytes = [r.view(torch.uint8).numpy() for r in ring]
    one_bytes = one.view(torch.uint8).numpy()
    epoch = [0]

    def plan_positions() -> list[list[tuple[int, int]]]:
        """(sample, first row) of every batch of the next epoch's plan, in storage order."""
        plan = loader.plan(epoch[0])
        epoch[0] += 1
        out = []
        for j in range(len(plan)):
            s, t = plan.batch(j)
            starts = np.cumsum(t) - t
            order = np.argsort(s, kind="stable")
            out.append(list(zip(s[order].tolist(), starts[order].tolist())))
        return out

    def raw_one(hash_: bool = True) -> None:
        for fd, offset, n in where:
            dst = memoryview(one_bytes[:n])
            os.preadv(fd, [dst], offset)
            if hash_:
                xxhash.xxh3_64(dst).intdigest()

    def raw_ring(hash_: bool = True, beside: BesideHasher | None = None) -> None:
        for j, batch in enumerate(plan_positions()):
            buf = ring_bytes[j % len(ring)]
            for i, first in batch:
                fd, offset, n = where[i]
                dst = memoryview(buf[first * rb : first * rb + n])
                os.preadv(fd, [dst], offset)
                if hash_:
                    xxhash.xxh3_64(dst).intdigest()
            if beside is not None:
                beside.batch([where[i][2] for i, _ in batch])
        if beside is not None:
            beside.wait()

    def seq_one() -> None:
        for i, t in enumerate(lens):
            ds.read_hidden_into(i, one[: t * row].view(t, len(ds.layers), ds.hidden_size))

    def seq_ring() -> None:
        for j, batch in enumerate(plan_positions()):
            buf = ring[j % len(ring)]
            for i, first in batch:
                t = lens[i]
                ds.read_hidden_into(
                    i, buf[first * row : (first + t) * row].view(t, len(ds.layers), -1)
                )

    def many_ring() -> None:
        for j, batch in enumerate(plan_positions()):
            rows = ring[j % len(ring)].view(MAX_TOKENS, len(ds.layers), -1)
            batch_reads.read_hidden_many_into(ds, rows, batch)

    def loader_epoch(which: Loader = loader) -> None:
        which.set_epoch(epoch[0])
        epoch[0] += 1
        for _ in which:
            pass

    cases = {
        "raw, one buffer": raw_one,
        "raw, batch ring": raw_ring,
        "raw without XXH3, one buffer": lambda: raw_one(hash_=False),
        "raw without XXH3, batch ring": lambda: raw_ring(hash_=False),
        "  + XXH3 on a thread": lambda: raw_ring(hash_=False, beside=on_thread),
        "  + XXH3 in a process": lambda: raw_ring(hash_=False, beside=in_process),
        "read_hidden_into, one buffer": seq_one,
        "read_hidden_into, batch ring": seq_ring,
        "read_hidden_many_into, batch ring": many_ring,
        "loader": loader_epoch,
        "loader, verify_reads=False": lambda: loader_epoch(unverified),
    }
    # The hashers hash the bytes of one batch at most, of memory of their own.
    on_thread = BesideHasher(MAX_TOKENS * rb, process=False)
    in_process = BesideHasher(MAX_TOKENS * rb, process=True)
    times: dict[str, list[float]] = {k: [] for k in cases}
    for fn in cases.values():  # warm: page cache, ring, imports
        fn()
        loader.close()
        unverified.close()
    for r in range(args.rounds):
        for name in list(cases) if r % 2 == 0 else list(cases)[::-1]:
            t0 = time.perf_counter()
            cases[name]()
            times[name].append(time.perf_counter() - t0)
            loader.close()  # every loader epoch starts from an idle pipeline
            unverified.close()
    on_thread.close()
    in_process.close()
    rates = {k: nbytes / statistics.median(v) / 1e9 for k, v in times.items()}
    base = rates["read_hidden_into, one buffer"]
    print(f"{len(ds)} samples, {sum(lens)} tokens, {nbytes / 1e6:.0f} MB; ring of {args.ring} "
          f"x {MAX_TOKENS * rb / 1e6:.0f} MB{' (2 MiB pages)' if args.huge else ''}")  # fmt: skip
    for name, rate in rates.items():
        print(f"{name:36s} {rate:6.2f} GB/s  {rate / base:5.2f}x")
    for fd in fds.values():
        os.close(fd)
    return rates


if __name__ == "__main__":
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    main()
