"""Store benchmark: compression ratio, write speed and per-sample read speed, in one run.

Every figure is compared with baselines measured in the same run on the same samples:
(a) the raw-bytes read ceiling (one raw file per sample, readinto a reused buffer),
(b) `torch.load` of one speculators-v1-style `.pt` per sample (mmap=False, weights_only=True),
(c) safetensors, one file per sample.
Reads are warm-cache, single-threaded, per sample, in storage order (hsstore with
``read_threads=1``; one more row reads compressed samples on its default read threads).

    python tools/bench_store.py                 # ~1 GB of scratch, a couple of minutes
    python tools/bench_store.py --quick         # smaller, for a smoke test

The last line is machine-readable:
    ratio=1.44 write_mb_s_per_core=650 read_vs_ceiling=0.55 read_vs_torchload=2.3
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
from safetensors.torch import load_file, save_file  # noqa: E402

import hsstore  # noqa: E402
from hsstore import LayerSpec  # noqa: E402
from hsstore.codec.codecs import DEFAULT_CODEC  # noqa: E402
from hsstore.cores import default_read_threads  # noqa: E402
from tools.synthetic import llm_like_states  # noqa: E402
from tools.timing import best_of  # noqa: E402


def _dir_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def measure_ratio(
    samples: list[tuple[torch.Tensor, torch.Tensor]], work: Path, codec: str = DEFAULT_CODEC
) -> float:
    """Raw bytes / stored state bytes for a list of (input_ids, states [T, L, H])."""
    hidden = samples[0][1].shape[-1]
    ds = hsstore.create(work / f"ratio-{codec}", layers=[LayerSpec(k + 1) for k in range(samples[0][1].shape[1])],
                        hidden_size=hidden, dtype=torch.bfloat16, codec=codec)  # fmt: skip
    with ds.writer() as w:
        for i, (ids, states) in enumerate(samples):
            w.add(f"s{i}", ids, torch.ones_like(ids), states)
    ds = hsstore.open(work / f"ratio-{codec}")
    raw = sum(s.nbytes for _, s in samples)
    stored = sum(
        f.size
        for seg in ds.manifest.segments
        for rel, f in seg.files.items()
        if rel.startswith("states/c/")
    )
    return raw / stored


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--samples", type=int, default=48)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--min-tokens", type=int, default=256)
    ap.add_argument("--max-tokens", type=int, default=2048)
    ap.add_argument(
        "--minilm-samples", type=int, default=120, help="real-activation samples for the ratio"
    )
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--workdir", type=Path, default=None)
    ap.add_argument("--quick", action="store_true")
    args = ap.parse_args()
    if args.quick:
        args.samples, args.max_tokens, args.minilm_samples, args.repeats = 16, 1024, 30, 2

    work = Path(tempfile.mkdtemp(prefix="hsstore-bench-", dir=args.workdir))
    try:
        run(args, work)
    finally:
        shutil.rmtree(work, ignore_errors=True)


def run(args: argparse.Namespace, work: Path) -> None:
    torch.set_num_threads(1)
    g = torch.Generator().manual_seed(0)
    lengths = torch.randint(
        args.min_tokens, args.max_tokens + 1, (args.samples,), generator=g
    ).tolist()
    samples = []
    for i, t in enumerate(lengths):
        ids = torch.randint(0, 128000, (t,), generator=g)
        samples.append((ids, llm_like_states(t, args.layers, args.hidden, seed=i)))
    raw_bytes = sum(s.nbytes for _, s in samples)
    print(f"data: {args.samples} samples, {sum(lengths)} tokens, [T, {args.layers}, {args.hidden}] bf16, "
          f"{raw_bytes / 1e6:.0f} MB raw")  # fmt: skip

    rows: list[tuple[str, float, str]] = []

    # -- write ---------------------------------------------------------------------------------
    def write(codec: str) -> tuple[Path, float, float]:
        """(path, best wall seconds, CPU seconds of that run: all threads, user + sys)."""
        path = work / f"hs-{codec}"
        best = (float("inf"), float("inf"))
        for _ in range(args.repeats):
            shutil.rmtree(path, ignore_errors=True)
            t0, c0 = time.perf_counter(), time.process_time()
            ds = hsstore.create(path, layers=[LayerSpec(k + 1) for k in range(args.layers)],
                                hidden_size=args.hidden, dtype=torch.bfloat16, codec=codec)  # fmt: skip
            with ds.writer(encode_threads=1) as w:
                for i, (ids, states) in enumerate(samples):
                    w.add(f"s{i}", ids, torch.ones_like(ids), states)
            best = min(best, (time.perf_counter() - t0, time.process_time() - c0))
        return path, best[0], best[1]

    # Per core = bytes per CPU-second: the writer overlaps filling with encoding on a second
    # thread, so wall time alone would flatter it.
    hs_z, t_write_z, cpu_write_z = write(DEFAULT_CODEC)
    hs_raw, t_write_raw, cpu_write_raw = write("none")
    write_mb_s = raw_bytes / cpu_write_z / 1e6
    rows.append(
        (
            f"write hsstore {DEFAULT_CODEC}, wall (1 encode thread)",
            raw_bytes / t_write_z / 1e9,
            "GB/s",
        )
    )
    rows.append(
        (f"write hsstore {DEFAULT_CODEC}, per CPU-second", raw_bytes / cpu_write_z / 1e9, "GB/s")
    )
    rows.append(("write hsstore uncompressed, wall", raw_bytes / t_write_raw / 1e9, "GB/s"))
    rows.append(
        ("write hsstore uncompressed, per CPU-second", raw_bytes / cpu_write_raw / 1e9, "GB/s")
    )
    stored = _dir_bytes(hs_z / "segments")
    ratio_synth = raw_bytes / stored
    rows.append(("ratio synthetic LLM-like (whole dataset on disk)", ratio_synth, "x"))

    # -- baselines on disk ---------------------------------------------------------------------
    raw_dir, pt_dir, st_dir = work / "raw", work / "pt", work / "st"
    for d in (raw_dir, pt_dir, st_dir):
        d.mkdir()
    t0 = time.perf_counter()
    for i, (ids, states) in enumerate(samples):
        (raw_dir / f"{i}.bin").write_bytes(states.view(torch.uint8).numpy().tobytes())
        torch.save({"input_ids": ids, "loss_mask": torch.ones_like(ids),
                    "hidden_states": [states[:, k].clone() for k in range(args.layers)]},
                   pt_dir / f"data_{i}.pt")  # fmt: skip
        save_file({"hidden_states": states, "input_ids": ids}, str(st_dir / f"hs_{i}.safetensors"))
    del t0

    # -- reads (warm cache: one untimed pass first) --------------------------------------------
    max_t = max(lengths)
    buf = torch.empty(max_t * args.layers * args.hidden, dtype=torch.bfloat16)

    def read_raw() -> None:
        mv = buf.view(torch.uint8).numpy()
        for i, t in enumerate(lengths):
            with open(raw_dir / f"{i}.bin", "rb", buffering=0) as f:
                f.readinto(memoryview(mv)[: t * args.layers * args.hidden * 2])

    def read_torchload() -> None:
        for i in range(len(lengths)):
            d = torch.load(pt_dir / f"data_{i}.pt", weights_only=True)
            torch.stack(d["hidden_states"], dim=1)

    def read_torchload_mmap() -> None:
        for i in range(len(lengths)):
            d = torch.load(pt_dir / f"data_{i}.pt", mmap=True, weights_only=True)
            torch.stack(d["hidden_states"], dim=1)

    def read_safetensors() -> None:
        # safetensors maps the file lazily: copy the tensor out so every byte is really read.
        for i, t in enumerate(lengths):
            states = load_file(str(st_dir / f"hs_{i}.safetensors"))["hidden_states"]
            buf[: t * args.layers * args.hidden].copy_(states.view(-1))

    def read_hs(path: Path, verify: bool, read_threads: int | None = 1):
        ds = hsstore.open(path, verify_reads=verify, read_threads=read_threads)

        def go() -> None:
            for i, t in enumerate(lengths):
                ds.read_hidden_into(
                    i, buf[: t * args.layers * args.hidden].view(t, args.layers, args.hidden)
                )
                ds.read_tokens(i)

        return go

    readers = {
        "raw readinto (ceiling)": read_raw,
        "torch.load per .pt": read_torchload,
        "torch.load mmap per .pt": read_torchload_mmap,
        "safetensors per file": read_safetensors,
        "hsstore uncompressed, verified": read_hs(hs_raw, True),
        "hsstore uncompressed, unverified": read_hs(hs_raw, False),
        f"hsstore {DEFAULT_CODEC}, verified": read_hs(hs_z, True),
        f"hsstore {DEFAULT_CODEC}, verified, {default_read_threads()} read threads": read_hs(
            hs_z, True, None
        ),
    }
    speeds = {}
    for name, fn in readers.items():
        fn()
        speeds[name] = raw_bytes / best_of(fn, args.repeats) / 1e9
        rows.append((f"read {name}", speeds[name], "GB/s"))

    # -- realistic activations -----------------------------------------------------------------
    from tools.real_states import minilm_states

    real = minilm_states(args.minilm_samples)
    ratio_real = measure_ratio(real, work)
    rows.append(
        (
            f"ratio MiniLM-L6 activations ({sum(x[0].shape[0] for x in real)} tokens, states only)",
            ratio_real,
            "x",
        )
    )

    width = max(len(r[0]) for r in rows)
    print(f"{'measure'.ljust(width)}  value")
    for name, value, unit in rows:
        print(f"{name.ljust(width)}  {value:8.2f} {unit}")
    ceiling = speeds["raw readinto (ceiling)"]
    hs = speeds["hsstore uncompressed, verified"]
    print(
        f"ratio={ratio_real:.2f} write_mb_s_per_core={write_mb_s:.0f} "
        f"read_vs_ceiling={hs / ceiling:.2f} read_vs_torchload={hs / speeds['torch.load per .pt']:.2f}"
    )


if __name__ == "__main__":
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    main()
