"""Convert benchmark: speculators v1 -> hsstore throughput against plain ``torch.load``.

Both are measured in one run on the same v1 files (LLM-like synthetic states, warm page cache):

- baseline: ``torch.load(path, weights_only=True)`` of every ``data_{i}.pt`` (mmap off, so every
  byte is read), one thread, which is what a v1 trainer's data loader pays per sample;
- convert: ``hsstore convert`` of the same directory into a new dataset (read, validate,
  encode, checksum, write, commit), with its default worker count.

Two more rows split convert into its stages, so a slow result says where the time goes: the
read + validate stage alone, and the store's writer alone on samples already in memory
(``convert_vs_store_write`` near 1.0 means convert adds little on top of the store's write path).

Throughput is hidden-state bytes per second. Each figure is the best of ``--repeats`` runs.

    python tools/bench_convert.py            # ~400 MB of v1 files
    python tools/bench_convert.py --quick    # smaller, for a smoke test

The last line is machine-readable: ``convert_vs_torchload=0.85 convert_vs_torchload_cold=0.60``
(default codec; warm page cache, then with the v1 files evicted from it before each run, which
is what converting a dataset larger than memory looks like).
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script from anywhere

import torch  # noqa: E402

import hsstore  # noqa: E402
from hsstore.interop.convert import convert_to_hsstore  # noqa: E402
from hsstore.interop.formats import open_foreign  # noqa: E402
from hsstore.interop.formats.pipeline import default_workers, ordered_map, torch_threads  # noqa: E402
from tools.convert_fixtures import write_v1_dir  # noqa: E402
from tools.timing import best_of  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--samples", type=int, default=48)
    ap.add_argument("--tokens", type=int, default=1024, help="mean tokens per sample")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--workers", type=int, default=None)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--quick", action="store_true", help="24 samples of ~512 tokens")
    ap.add_argument(
        "--work", type=Path, default=None, help="scratch directory (default: a temp dir)"
    )
    args = ap.parse_args()
    if args.quick:
        args.samples, args.tokens = 24, 512

    work = Path(tempfile.mkdtemp(prefix="bench_convert_", dir=args.work))
    try:
        g = torch.Generator().manual_seed(0)
        lengths = torch.randint(
            args.tokens // 2, args.tokens * 3 // 2 + 1, (args.samples,), generator=g
        ).tolist()
        src = work / "v1"
        layer_ids = list(range(args.layers))
        write_v1_dir(
            src, lengths, layer_ids=layer_ids, hidden_size=args.hidden, dtype=torch.bfloat16
        )
        files = sorted(src.glob("data_*.pt"))
        nbytes = sum(lengths) * args.layers * args.hidden * 2
        for f in files:  # warm the page cache for both contenders
            f.read_bytes()

        def torchload() -> None:
            for f in files:
                obj = torch.load(f, weights_only=True)
                assert len(obj["hidden_states"]) == args.layers

        runs = iter(range(10**6))

        def convert(codec: str | None) -> None:
            dst = work / f"ds{next(runs)}"
            convert_to_hsstore(src, dst, codec=codec, workers=args.workers, progress=False)
            shutil.rmtree(dst)

        reader = open_foreign(src)
        workers = args.workers or default_workers()

        def read_only() -> None:  # convert's read + validate stage alone
            with torch_threads(1):
                for _, item in ordered_map(reader.read, range(len(reader)), workers):
                    assert not isinstance(item, BaseException), item

        write_times: list[float] = []

        def write_only() -> None:  # the store's writer alone, on samples already in memory
            with torch_threads(1):
                items = [reader.read(i) for i in range(len(reader))]
                dst = work / f"ds{next(runs)}"
                ds = hsstore.create(
                    dst, layers=reader.layers, hidden_size=args.hidden, dtype=torch.bfloat16
                )
                t0 = time.perf_counter()
                with ds.writer() as w:
                    for it in items:
                        w.add(it.sample_id, it.input_ids, it.loss_mask, it.hidden)
                write_times.append(time.perf_counter() - t0)
                del items
                shutil.rmtree(dst)

        def evict() -> None:
            """Drop the v1 files from the page cache (fsync first: only clean pages go)."""
            for f in files:
                fd = os.open(f, os.O_RDONLY)
                try:
                    os.fsync(fd)
                    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
                finally:
                    os.close(fd)

        def cold(fn):
            def run() -> None:
                evict()
                fn()

            return run

        # Cold first (evicting disturbs nothing that follows), then warm.
        t_load_cold = best_of(cold(torchload), args.repeats)
        t_conv_cold = best_of(cold(lambda: convert(None)), args.repeats)
        for f in files:
            f.read_bytes()
        t_load = best_of(torchload, args.repeats)
        t_read = best_of(read_only, args.repeats)
        for _ in range(args.repeats):
            write_only()
        t_write = min(write_times)
        t_conv = best_of(lambda: convert(None), args.repeats)
        t_none = best_of(lambda: convert("none"), args.repeats)
        gb = nbytes / 1e9
        print(
            f"{args.samples} samples, {sum(lengths)} tokens, [T, {args.layers}, {args.hidden}] "
            f"bf16, {gb:.2f} GB of states, {workers} workers"
        )
        print(f"{'contender':<40}{'seconds':>10}{'GB/s':>10}{'vs torch.load':>15}")
        for name, t in (
            ("torch.load (baseline)", t_load),
            ("convert: read + validate stage only", t_read),
            ("store writer alone, default codec", t_write),
            ("convert, default codec", t_conv),
            ("convert, codec none", t_none),
            ("torch.load, cold page cache", t_load_cold),
            ("convert, default codec, cold page cache", t_conv_cold),
        ):
            print(f"{name:<40}{t:>10.3f}{gb / t:>10.2f}{t_load / t:>15.2f}")
        print(f"convert_vs_store_write={t_write / t_conv:.2f}")
        print(
            f"convert_vs_torchload={t_load / t_conv:.2f} "
            f"convert_vs_torchload_cold={t_load_cold / t_conv_cold:.2f}"
        )
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
