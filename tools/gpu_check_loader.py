"""GPU check of the loader's device path: pinned copy bandwidth, delivered throughput, overlap.

Run on a machine with CUDA (about a minute at the defaults on a 16-core host)::

    python tools/gpu_check_loader.py [--tokens 65536] [--hidden 4096]

It builds a temporary uncompressed dataset and measures, in one run:

1. ``pinned_h2d_gb_s``: a plain pinned host -> device copy of one batch-sized buffer (the
   ceiling for any loader that lands batches on this GPU); ``pageable_h2d_gb_s`` for reference;
2. ``loader_cpu_gb_s`` / ``loader_device_gb_s``: raw hidden-state bytes the loader delivers
   per second to the CPU and to the GPU (``device="cuda"``), after one warm-up epoch;
3. ``overlap``: a compute kernel (matmuls) per batch, timed alone (t_c), the loader alone
   (t_l) and both together (t_b); overlap = (t_c + t_l - t_b) / min(t_c, t_l): 1 = the copy
   and decode hide entirely behind compute, 0 = they run one after the other;
4. ``values_equal``: every batch of one epoch, read on the GPU while compute runs on the
   default stream, equals the dataset's bytes (catches a missing stream/event sync or a host
   buffer recycled before its copy finished);
5. ``fp8_equal`` / ``fp8_vs_lossless_device``: the same states stored ``fp8-token`` and
   ``fp8-token-layer`` (uncompressed too): every GPU batch (fp8 and scales copied, dequantized
   on the GPU) equals the CPU loader's batch (dequantized on the host) bit for bit, and the
   GPU path's rate in bf16 bytes delivered against the lossless dataset's.

Without CUDA it says so and exits 0 (the CPU fallback is covered by the tests).
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

import torch

LAYERS = 4


def build(path: Path, tokens: int, hidden: int, tier: str | None = None) -> None:
    import hsstore
    from hsstore import LayerSpec

    ds = hsstore.create(
        path,
        layers=[LayerSpec(depth=d) for d in (2, 8, 14, 16)],
        hidden_size=hidden,
        dtype=torch.bfloat16,
        model={"name": "gpu-check", "revision": None, "num_hidden_layers": 16, "hidden_size": hidden, "vocab_size": 32000},
        codec="none",
        tier=tier,
    )  # fmt: skip
    g = torch.Generator().manual_seed(0)
    total, k = 0, 0
    with ds.writer() as w:
        while total < tokens:
            n = int(torch.randint(256, 3000, (1,), generator=g))
            w.add(
                f"s{k:05d}",
                torch.randint(0, 32000, (n,), generator=g),
                torch.ones(n, dtype=torch.int64),
                torch.randn(n, LAYERS, hidden, generator=g).to(torch.bfloat16),
            )
            total, k = total + n, k + 1


def copy_bandwidth(nbytes: int, pinned: bool, reps: int = 20) -> float:
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=pinned)
    host.fill_(1)
    dev = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    dev.copy_(host, non_blocking=pinned)
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        dev.copy_(host, non_blocking=pinned)
    end.record()
    end.synchronize()
    return nbytes * reps / (start.elapsed_time(end) / 1e3) / 1e9


def run_epoch(loader, epoch: int, work=None) -> tuple[float, int, int]:
    """(seconds, tokens, batches) of one epoch, synchronised at both ends."""
    loader.set_epoch(epoch)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    tokens = batches = 0
    for batch in loader:
        if work is not None:
            work(batch)
        tokens += int(batch["lengths"].sum())  # a per-step sync, as a loss.item() would be
        batches += 1
    torch.cuda.synchronize()
    elapsed = time.perf_counter() - t0
    loader.close()  # no decoding ahead into the next timed epoch: each starts cold
    return elapsed, tokens, batches


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8)


def check_fp8(root: Path, args, opts: dict, lossless_gb_s: float) -> tuple[bool, float]:
    """(every GPU batch equals the CPU one, for both fp8 tiers; the fp8-token GPU rate over
    ``lossless_gb_s``), on the same states as the lossless dataset."""
    from hsstore.loader import Loader

    equal, ratio = True, 0.0
    for tier in ("fp8-token", "fp8-token-layer"):
        path = root / tier
        if not path.exists():
            build(path, args.tokens, args.hidden, tier)
        cpu_loader = Loader(path, **opts)
        dev_loader = Loader(path, device="cuda", **opts)
        for host, dev in zip(cpu_loader, dev_loader, strict=True):
            for key, value in host.items():
                got = dev[key].cpu()
                equal &= got.dtype == value.dtype and torch.equal(bits(got), bits(value))
        cpu_loader.close()  # its threads would decode on into the timed epochs below
        dev_loader.close()
        if tier == "fp8-token":
            run_epoch(dev_loader, 1)  # warm-up, as for the lossless rate
            t, tok, _ = run_epoch(dev_loader, 2)
            ratio = tok * LAYERS * args.hidden * 2 / t / 1e9 / lossless_gb_s
    return equal, ratio


def main() -> int:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--tokens", type=int, default=65536)
    p.add_argument("--hidden", type=int, default=4096)
    p.add_argument("--max-tokens", type=int, default=8192)
    p.add_argument("--threads", type=int, default=min(16, os.cpu_count() or 1))
    p.add_argument("--data", help="reuse/build the dataset here instead of a temp dir")
    args = p.parse_args()
    if not torch.cuda.is_available():
        print("no CUDA device: nothing to check here (CPU fallback is covered by tests)")
        return 0
    import hsstore
    from hsstore.loader import Loader

    tmp = None
    if args.data is None:
        tmp = tempfile.TemporaryDirectory(prefix="hsstore-gpu-check-")
        args.data = tmp.name
    path = Path(args.data) / "ds"
    t0 = time.perf_counter()
    if not path.exists():
        build(path, args.tokens, args.hidden)
    ds = hsstore.open(path)
    row_bytes = LAYERS * args.hidden * 2
    print(f"device: {torch.cuda.get_device_name()}; data {ds.num_tokens} tokens, "
          f"{ds.num_tokens * row_bytes / 1e9:.2f} GB raw, built in {time.perf_counter() - t0:.0f}s")  # fmt: skip

    batch_bytes = args.max_tokens * row_bytes
    pinned = copy_bandwidth(batch_bytes, pinned=True)
    pageable = copy_bandwidth(batch_bytes, pinned=False, reps=5)

    opts = dict(
        max_tokens=args.max_tokens, shuffle=True, seed=0, num_threads=args.threads, prefetch=3
    )
    cpu_loader = Loader(path, **opts)
    dev_loader = Loader(path, device="cuda", **opts)
    run_epoch(cpu_loader, 0)
    run_epoch(dev_loader, 0)
    t_cpu, tok, nb = run_epoch(cpu_loader, 1)
    t_l, tok_d, _ = run_epoch(dev_loader, 1)
    cpu_gb_s = tok * row_bytes / t_cpu / 1e9
    dev_gb_s = tok_d * row_bytes / t_l / 1e9

    # A compute kernel that takes about as long per batch as the loader does.
    h = args.hidden
    a = torch.randn(h, h, device="cuda", dtype=torch.bfloat16) / h**0.5
    x = torch.randn(args.max_tokens, h, device="cuda", dtype=torch.bfloat16)
    x = torch.tanh(x @ a)  # warm-up (cuBLAS handles, kernels)
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(10):
        x = torch.tanh(x @ a)
    torch.cuda.synchronize()
    per_mm = (time.perf_counter() - t) / 10
    reps = max(1, round((t_l / nb) / per_mm))

    def compute(batch=None) -> None:
        y = batch["hidden_states"][0, :, :h] if batch is not None else x
        for _ in range(reps):
            y = torch.tanh(y @ a)

    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(nb):
        compute()
        torch.cuda.current_stream().synchronize()  # like the per-step sync in run_epoch
    t_c = time.perf_counter() - t
    t_b, _, _ = run_epoch(dev_loader, 2, work=compute)
    overlap = (t_c + t_l - t_b) / min(t_c, t_l)

    # Correctness under concurrency: every batch equals the dataset's bytes.
    equal = True
    dev_loader.set_epoch(3)
    for batch in dev_loader:
        compute(batch)  # keep the default stream busy while the next copy is in flight
        hidden = batch["per_layer_hidden_states"][0].cpu()
        ids = batch["input_ids"][0].cpu()
        start = 0
        for i, n in zip(batch["sample_index"].tolist(), batch["lengths"].tolist()):
            s = ds[i]
            equal &= torch.equal(hidden[start : start + n], s.hidden[:n])
            equal &= torch.equal(ids[start : start + n], s.input_ids[:n])
            start += n
    print(f"batches/epoch {nb}; compute reps/batch {reps}; t_compute {t_c:.2f}s "
          f"t_loader {t_l:.2f}s t_both {t_b:.2f}s")  # fmt: skip
    fp8_equal, fp8_ratio = check_fp8(Path(args.data), args, opts, dev_gb_s)
    print(
        f"pinned_h2d_gb_s={pinned:.1f} pageable_h2d_gb_s={pageable:.1f} "
        f"loader_cpu_gb_s={cpu_gb_s:.2f} loader_device_gb_s={dev_gb_s:.2f} "
        f"device_vs_pinned={dev_gb_s / pinned:.2f} overlap={overlap:.2f} values_equal={equal} "
        f"fp8_equal={fp8_equal} fp8_vs_lossless_device={fp8_ratio:.2f}"
    )
    if tmp is not None:
        tmp.cleanup()
    return 0 if equal and fp8_equal else 1


if __name__ == "__main__":
    sys.exit(main())
