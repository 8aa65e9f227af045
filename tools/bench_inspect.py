"""Time `hsstore inspect` (default sampling) on a synthetic dataset of a given size.

    python tools/bench_inspect.py OUT_DIR [--gb 1.0] [--hidden 4096] [--full]

Writes an EAGLE-3-shaped dataset (4 stored layers, bf16, LLM-like states) once, then times the
audit in-process and the whole CLI (imports included) in a subprocess.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script from anywhere

import numpy as np  # noqa: E402
import torch  # noqa: E402

import hsstore  # noqa: E402
from hsstore import LayerSpec  # noqa: E402
from hsstore.audit import AuditOptions, audit  # noqa: E402
from tools.synthetic import random_sample  # noqa: E402

LAYERS = [LayerSpec(2), LayerSpec(16), LayerSpec(29), LayerSpec(32)]


def build(path: Path, gb: float, hidden: int) -> None:
    row_bytes = len(LAYERS) * hidden * 2
    total = int(gb * 1e9 / row_bytes)
    rng = np.random.default_rng(0)
    model = {
        "name": "synthetic",
        "num_hidden_layers": 32,
        "hidden_size": hidden,
        "vocab_size": 32000,
    }
    ds = hsstore.create(path, layers=LAYERS, hidden_size=hidden, dtype=torch.bfloat16, model=model)
    done, i = 0, 0
    with ds.writer() as w:
        while done < total:
            t = int(min(rng.integers(256, 2049), total - done))
            w.add(f"s{i}", *random_sample(t, len(LAYERS), hidden, seed=i))
            done, i = done + t, i + 1


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("out", type=Path)
    ap.add_argument("--gb", type=float, default=1.0)
    ap.add_argument("--hidden", type=int, default=4096)
    ap.add_argument("--full", action="store_true")
    args = ap.parse_args()
    if not args.out.exists():
        t0 = time.perf_counter()
        build(args.out, args.gb, args.hidden)
        print(f"wrote {args.out} in {time.perf_counter() - t0:.1f} s")
    ds = hsstore.open(args.out)
    print(
        f"{len(ds)} samples, {ds.num_tokens} tokens, {ds.manifest.num_layers} layers x {ds.hidden_size}"
    )
    t0 = time.perf_counter()
    res = audit(args.out, AuditOptions(full=args.full, progress=False))
    t_audit = time.perf_counter() - t0
    print(f"audit(): {t_audit:.2f} s, read {res.sampling['samples_read']} samples / "
          f"{res.sampling['tokens_read']} tokens, verdict {res.verdict.value}")  # fmt: skip
    for c in res.checks:
        print(f"  {c.verdict.value:<4} {c.name}: {c.reason}")
    cmd = [
        sys.executable,
        "-c",
        "from hsstore.cli import main; main()",
        "inspect",
        str(args.out),
        "--json",
    ]
    if args.full:
        cmd.append("--full")
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True)
    print(
        f"CLI wall time (imports included): {time.perf_counter() - t0:.2f} s, exit {proc.returncode}"
    )


if __name__ == "__main__":
    main()
