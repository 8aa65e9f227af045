"""Peer race: the same samples written and read by hsstore and by the formats it competes with.

Contenders (each stores the states and the token ids of every sample):
  hsstore default codec (split-zstd, sample-aligned chunks), uncompressed, and format 2's
  default (blosc-zstd, unaligned ~1 MiB chunks: the baseline of the change, same run); Lance (pylance, one row per
  token, zstd, written in batches so pages compress); MosaicML streaming MDS with zstd (read
  through `StreamingDataset`, which keeps a decompressed copy of every shard on local disk:
  reported as its own row with that disk cost); safetensors and `torch.save`, one file per
  sample; zarr-python, one array with blosc zstd-1 shuffle and ~1 MiB chunks.
Data sets: synthetic LLM-like `[T, 4, 2048]` bf16 (`tools/synthetic.py`) and real MiniLM-L6
activations `[T, 7, 384]` bf16 (`tools/real_states.py`).

    python tools/bench_peers.py            # ~0.6 GB of data, several minutes
    python tools/bench_peers.py --quick    # a minute or two
    python tools/bench_peers.py --peers none --quick   # hsstore only (no peer packages)

Writes are best-of --repeats in CPU seconds of all threads, each into a fresh directory; reads
are best-of --repeats, per sample into a reused buffer, called from one thread: sequential =
storage order, random = one shuffled pass, warm = after an untimed pass, cold = the contender's
files evicted from the page cache with posix_fadvise(DONTNEED) first (no system-wide drop),
then one shuffled pass ("cold rand": a read may find pages an earlier read's readahead brought
in) or every read of a shuffled pass after its own eviction ("cold each", untimed eviction: a
data set far larger than memory, read at random; E is taken on it). hsstore decodes a large
sample's chunks on its default `read_threads` (up to 4 cores; the "1 read thread" row decodes
on the caller alone) and Lance schedules reads on its own threads; the others use the caller's.
Every figure on the last line is a ratio measured in this run, the worse of the two data sets,
except G (GB/s):

    ratio_vs_best_peer=A write_vs_best_compressed_peer=B rand_vs_seq_small=C
    rand_vs_best_compressed_peer=D cold_rand_zstd_vs_none=E loader_small_vs_seq=F
    decode_gb_s_per_core=G

C and F are taken on the real data set (the small samples); G is the hsstore loader's rate
with one decode thread on compressed data (GB/s of decoded states). The two sides of C (seq and
rand) are timed in turn, as are those of F (the uncompressed loader's epochs and sequential
per-sample reads of the same dataset between them), so a slow spell hits both sides.
"""

from __future__ import annotations

import argparse
import gc
import math
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script from anywhere

import torch  # noqa: E402

import hsstore  # noqa: E402
from hsstore.codec.codecs import DEFAULT_CODEC  # noqa: E402
from tools.peer_formats import (  # noqa: E402
    COMPRESSED_PEERS,
    PEERS,
    Contender,
    Hsstore,
    LanceRows,
    MosaicMDS,
    SafetensorsFiles,
    Sample,
    TorchSaveFiles,
    ZarrPython,
    dir_bytes,
    evict,
)
from tools.synthetic import llm_like_states  # noqa: E402
from tools.timing import best_of  # noqa: E402


@dataclass
class Result:
    name: str
    ratio: float = math.nan  # raw bytes / bytes on disk after writing
    write_gb_s_cpu: float = math.nan
    seq: float = math.nan
    rand: float = math.nan
    cold_rand: float = math.nan
    cold_each: float = math.nan
    extra: dict[str, float] = field(default_factory=dict)


def measure(c: Contender, raw_bytes: int, repeats: int, seed: int) -> Result:
    res = Result(c.name)
    # Writes, like reads, are best of `repeats` (each into a fresh directory): the CPU time of
    # one write of the same data by the same writer varies by a third from one time to the next.
    cpu = math.inf
    for k in range(repeats):
        if k:
            shutil.rmtree(c.root)
        # Untimed: a full pass of Python's cycle collector over every object of the process
        # (~0.13 s with torch and transformers loaded) would otherwise land in whichever write
        # happens to trigger it.
        gc.collect()
        c0 = time.process_time()  # all threads: some writers encode in parallel
        c.write()
        cpu = min(cpu, time.process_time() - c0)
    res.write_gb_s_cpu = raw_bytes / cpu / 1e9
    res.ratio = raw_bytes / dir_bytes(c.root)
    c.open()
    if isinstance(c, MosaicMDS):
        res.extra["disk with local copy / raw"] = dir_bytes(c.root) / raw_bytes
    os.sync()
    state_bytes = sum(s.nbytes for _, s in c.samples)
    buf = torch.empty(max(c.lengths) * c.layers * c.hidden, dtype=torch.bfloat16)
    views = [buf[: t * c.layers * c.hidden].view(t, c.layers, c.hidden) for t in c.lengths]
    order = torch.randperm(len(views), generator=torch.Generator().manual_seed(seed)).tolist()

    def pass_over(indices: list[int]) -> Callable[[], None]:
        def go() -> None:
            for i in indices:
                c.read_into(i, views[i])

        return go

    check = order[0]
    c.read_into(check, views[check])
    if not torch.equal(views[check].view(torch.uint16), c.samples[check][1].view(torch.uint16)):
        raise AssertionError(f"{c.name} returned different bits for sample {check}")
    c.drop_maps()
    evict(c.read_dir())
    res.cold_rand = state_bytes / best_of(pass_over(order), 1) / 1e9
    seconds = 0.0
    for i in order:  # every read cold: evicted before each, untimed
        c.drop_maps()
        evict(c.read_dir())
        t0 = time.perf_counter()
        c.read_into(i, views[i])
        seconds += time.perf_counter() - t0
    res.cold_each = state_bytes / seconds / 1e9
    in_order = pass_over(list(range(len(views))))
    shuffled = pass_over(order)
    in_order()  # warm
    seq_s = rand_s = math.inf
    for _ in range(repeats):  # interleaved: a slow spell of a shared machine hits both alike
        seq_s = min(seq_s, best_of(in_order, 1))
        rand_s = min(rand_s, best_of(shuffled, 1))
    res.seq, res.rand = state_bytes / seq_s / 1e9, state_bytes / rand_s / 1e9
    return res


def loader_gb_s(path: Path, repeats: int) -> tuple[float, float]:
    """Decoded GB/s of the hsstore loader with one decode thread (warm, shuffled), and of
    sequential per-sample reads of the same dataset timed between its epochs (F's baseline,
    taken beside the loader so that a slow spell of a shared machine hits both)."""
    from hsstore.loader import Loader

    ds = hsstore.open(path)
    row_bytes = len(ds.layers) * ds.hidden_size * 2
    lengths = [ds.num_tokens_of(i) for i in range(len(ds))]
    shape = (len(ds.layers), ds.hidden_size)
    buf = torch.empty(max(lengths) * shape[0] * shape[1], dtype=torch.bfloat16)
    views = [buf[: t * shape[0] * shape[1]].view(t, *shape) for t in lengths]

    def sequential() -> None:
        for i, view in enumerate(views):
            ds.read_hidden_into(i, view)

    loader = Loader(path, max_tokens=8192, shuffle=True, seed=0, num_threads=1, prefetch=2)
    best = seq_best = math.inf
    for epoch in range(repeats + 1):  # the first epoch warms the cache and the ring
        loader.set_epoch(epoch)
        t0, tokens = time.perf_counter(), 0
        for batch in loader:
            tokens += int(batch["lengths"].sum())
        if epoch:
            best = min(best, time.perf_counter() - t0)
        loader.close()  # every timed epoch starts from an idle pipeline
        seq_best = min(seq_best, best_of(sequential, 1))
    return tokens * row_bytes / best / 1e9, sum(lengths) * row_bytes / seq_best / 1e9


def synthetic(args: argparse.Namespace) -> list[Sample]:
    g = torch.Generator().manual_seed(0)
    out: list[Sample] = []
    total = 0
    while total < args.synthetic_mb * 1e6:
        t = int(torch.randint(256, 2049, (1,), generator=g))
        ids = torch.randint(0, 128000, (t,), generator=g)
        out.append((ids, llm_like_states(t, 4, 2048, seed=len(out))))
        total += out[-1][1].nbytes
    return out


def real(args: argparse.Namespace) -> list[Sample]:
    from tools.real_states import minilm_states

    return minilm_states(args.real_samples, layers=tuple(range(7)))


def race(name: str, samples: list[Sample], peers: list[str], args, work: Path):
    raw_bytes = sum(s.nbytes + i.nbytes for i, s in samples)
    shape = tuple(samples[0][1].shape[1:])
    print(f"\n{name}: {len(samples)} samples, {sum(s.shape[0] for _, s in samples)} tokens, "
          f"[T, {shape[0]}, {shape[1]}] bf16, {raw_bytes / 1e6:.0f} MB raw", flush=True)  # fmt: skip
    factories: dict[str, Callable[[Path], Contender]] = {
        "hsstore": lambda p: Hsstore(p, samples, DEFAULT_CODEC),
        "hsstore-none": lambda p: Hsstore(p, samples, "none"),
        "hsstore-1": lambda p: Hsstore(p, samples, DEFAULT_CODEC, read_threads=1),
        "hsstore-blosc": lambda p: Hsstore(p, samples, "blosc-zstd", format_2=True),
        "lance": lambda p: LanceRows(p, samples),
        "mds": lambda p: MosaicMDS(p, samples),
        "safetensors": lambda p: SafetensorsFiles(p, samples),
        "torchsave": lambda p: TorchSaveFiles(p, samples),
        "zarr": lambda p: ZarrPython(p, samples),
    }
    # Untimed: the first write of a process pays for imports and first-touch allocations.
    Hsstore(work / f"{name}-warmup", samples[:1], DEFAULT_CODEC).write()
    shutil.rmtree(work / f"{name}-warmup")
    results: dict[str, Result] = {}
    # hsstore-blosc: format 2's default (blosc-zstd, unaligned ~1 MiB chunks), the baseline of
    # the codec and layout change, measured in the same run.
    for key in ["hsstore", "hsstore-none", "hsstore-1", "hsstore-blosc", *peers]:
        results[key] = measure(factories[key](work / f"{name}-{key}"), raw_bytes, args.repeats, 1)
        if key != "hsstore" and key != "hsstore-none":
            shutil.rmtree(work / f"{name}-{key}")
    for key in ("hsstore", "hsstore-none"):
        loader, seq = loader_gb_s(work / f"{name}-{key}", args.repeats)
        results[key].extra["loader 1 thread"] = loader
        results[key].extra["seq beside it"] = seq
    print(f"{'contender':40s} {'ratio':>6s} {'write/CPU-s':>11s} {'seq':>6s} {'rand':>6s} "
          f"{'cold rand':>9s} {'cold each':>9s}  (GB/s)")  # fmt: skip
    for r in results.values():
        extra = "  ".join(f"{k} {v:.2f}" for k, v in r.extra.items())
        print(f"{r.name:40s} {r.ratio:6.3f} {r.write_gb_s_cpu:11.2f} {r.seq:6.2f} {r.rand:6.2f} "
              f"{r.cold_rand:9.2f} {r.cold_each:9.2f}  {extra}", flush=True)  # fmt: skip
    return results


def figures(res: dict[str, Result], small: bool) -> dict[str, float]:
    hs, none = res["hsstore"], res["hsstore-none"]
    peers = [r for k, r in res.items() if not k.startswith("hsstore")]
    compressed = [res[k] for k in COMPRESSED_PEERS if k in res] + (
        [res["mds"]] if "mds" in res else []
    )
    readers = [res[k] for k in COMPRESSED_PEERS if k in res]
    best = max((r.ratio for r in peers), default=math.nan)
    return {
        "ratio_vs_best_peer": hs.ratio / best,
        "write_vs_best_compressed_peer": hs.write_gb_s_cpu
        / max((r.write_gb_s_cpu for r in compressed), default=math.nan),
        "rand_vs_seq_small": hs.rand / hs.seq if small else math.nan,
        "rand_vs_best_compressed_peer": hs.rand / max((r.rand for r in readers), default=math.nan),
        "cold_rand_zstd_vs_none": hs.cold_each / none.cold_each,
        "loader_small_vs_seq": none.extra["loader 1 thread"] / none.extra["seq beside it"]
        if small
        else math.nan,
        "decode_gb_s_per_core": hs.extra["loader 1 thread"],
    }


def data_arguments(doc: str, repeats: int) -> argparse.ArgumentParser:
    """The options of the race's two data sets, shared with the benchmarks that reuse them."""
    ap = argparse.ArgumentParser(
        description=doc, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--synthetic-mb", type=float, default=384, help="synthetic states, MB")
    ap.add_argument("--real-samples", type=int, default=300, help="MiniLM samples (<=256 tokens)")
    ap.add_argument("--repeats", type=int, default=repeats)
    ap.add_argument("--workdir", type=Path, default=None)
    ap.add_argument("--quick", action="store_true", help="small data, one repeat")
    return ap


def parse_data_arguments(ap: argparse.ArgumentParser, argv: list[str] | None) -> argparse.Namespace:
    args = ap.parse_args(argv)
    if args.quick:
        args.synthetic_mb, args.real_samples, args.repeats = 64, 60, 1
    return args


def main(argv: list[str] | None = None) -> dict[str, float]:
    ap = data_arguments(__doc__, repeats=3)
    ap.add_argument("--peers", default=",".join(PEERS), help=f"comma list of {PEERS}, or none")
    args = parse_data_arguments(ap, argv)
    peers = [] if args.peers == "none" else [p for p in args.peers.split(",") if p]
    unknown = sorted(set(peers) - set(PEERS))
    if unknown:
        ap.error(f"unknown peers {unknown}; choose from {PEERS}")
    torch.set_num_threads(1)
    work = Path(tempfile.mkdtemp(prefix="hsstore-peers-", dir=args.workdir))
    try:
        per_set = [
            figures(race("synthetic", synthetic(args), peers, args, work), small=False),
            figures(race("minilm", real(args), peers, args, work), small=True),
        ]
    finally:
        shutil.rmtree(work, ignore_errors=True)
    # The worse data set for each figure (C and F exist for the small samples only).
    final = {k: min((f[k] for f in per_set if not math.isnan(f[k])), default=math.nan)
             for k in per_set[0]}  # fmt: skip
    print()
    print(" ".join(f"{k}={v:.2f}" for k, v in final.items()))
    return final


if __name__ == "__main__":
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    main()
