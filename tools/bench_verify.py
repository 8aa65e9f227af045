"""Verify benchmark: what `hsstore.verify` costs as a dataset of small samples grows.

Two datasets of small samples (8 to 24 tokens, 2 layers of hidden size 64, bf16, the default
codec), each written in ``--commits`` commits of one segment: ``--small`` and ``--large``
samples. Each is verified in a process of its own, whose peak memory (VmHWM: the peak resident
set since it started, interpreter and imports included) is read from ``/proc`` when verify
returns (`tools.process_memory`). Memory that depends on the largest segment, not on the
number of samples, gives a ratio near 1; a rate set by bytes, not per-sample overhead, gives
many samples per second.

    python tools/bench_verify.py                   # 20,000 and 400,000 samples, several minutes
    python tools/bench_verify.py --quick           # 2,000 and 40,000, for a smoke test
    python tools/bench_verify.py --work DIR        # keep the datasets in DIR for the next run

The last line is machine-readable (samples/s of the large dataset; the ratio is large over
small whatever the sizes):
    verify_samples_per_s=52000 peak_mem_ratio_400k_vs_20k=1.02
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script from anywhere

LAYERS, HIDDEN = 2, 64


def build(path: Path, samples: int, commits: int) -> None:
    """``samples`` small samples in ``commits`` commits (one segment each); kept when ``path``
    already holds them."""
    import torch

    import hsstore
    from hsstore import LayerSpec
    from tools.synthetic import llm_like_states

    if path.exists():
        try:
            if len(hsstore.open(path)) == samples:
                return
        except hsstore.HsstoreError:
            pass
        shutil.rmtree(path)
    ds = hsstore.create(path, layers=[LayerSpec(k + 1) for k in range(LAYERS)],
                        hidden_size=HIDDEN, dtype=torch.bfloat16)  # fmt: skip
    states = [llm_like_states(8 + k % 17, LAYERS, HIDDEN, seed=k) for k in range(64)]
    per_commit = -(-samples // commits)
    t0 = time.perf_counter()
    with ds.writer() as w:
        for i in range(samples):
            hidden = states[i % len(states)]
            tokens = hidden.shape[0]
            w.add(
                f"s{i}", torch.arange(tokens) % 1000, torch.ones(tokens, dtype=torch.long), hidden
            )
            if (i + 1) % per_commit == 0 or i + 1 == samples:
                w.commit()
    print(f"  wrote {samples:,} samples in {time.perf_counter() - t0:.1f} s", flush=True)


def verify_here(path: str) -> None:
    """The child's side: verify ``path``, print seconds, samples and peak memory as JSON."""
    import hsstore
    from tools.process_memory import status_kb

    t0 = time.perf_counter()
    report = hsstore.verify(path)
    seconds = time.perf_counter() - t0
    print(json.dumps({"ok": report.ok, "samples": report.samples_checked, "seconds": seconds,
                      "peak_kb": status_kb("VmHWM")}))  # fmt: skip


def verify_in_child(path: Path) -> dict:
    out = subprocess.run([sys.executable, __file__, "--child", str(path)], check=True,
                         capture_output=True, text=True).stdout  # fmt: skip
    got = json.loads(out.strip().splitlines()[-1])
    if not got["ok"]:
        raise SystemExit(f"{path}: verify found problems in a freshly written dataset")
    return got


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--small", type=int, default=20_000)
    parser.add_argument("--large", type=int, default=400_000)
    parser.add_argument("--commits", type=int, default=20)
    parser.add_argument("--quick", action="store_true", help="2,000 and 40,000 samples")
    parser.add_argument(
        "--work", type=Path, default=None, help="keep the datasets here, for the next run"
    )
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        verify_here(args.child)
        return
    if args.quick:
        args.small, args.large = 2_000, 40_000
    work = args.work or Path(tempfile.mkdtemp(prefix="hsstore-bench-verify-"))
    work.mkdir(parents=True, exist_ok=True)
    try:
        results = {}
        for n in (args.small, args.large):
            path = work / f"samples-{n}-commits-{args.commits}"
            build(path, n, args.commits)
            got = verify_in_child(path)
            results[n] = got
            print(f"  {n:>9,} samples: verify {got['seconds']:.2f} s "
                  f"({got['samples'] / got['seconds']:,.0f} samples/s), "
                  f"peak {got['peak_kb'] / 1e6:.3f} GB", flush=True)  # fmt: skip
    finally:
        if args.work is None:
            shutil.rmtree(work, ignore_errors=True)
    small, large = results[args.small], results[args.large]
    print(f"peak memory {args.large:,} vs {args.small:,} samples")
    print(
        f"verify_samples_per_s={large['samples'] / large['seconds']:.0f} "
        f"peak_mem_ratio_400k_vs_20k={large['peak_kb'] / small['peak_kb']:.2f}"
    )


if __name__ == "__main__":
    main()
