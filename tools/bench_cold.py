"""Cold per-sample reads: a random read of a data set that is not in the page cache.

The two data sets of the peer race (`tools/bench_peers.py`): synthetic LLM-like `[T, 4, 2048]`
bf16 (large samples) and MiniLM-L6 activations `[T, 7, 384]` bf16 (small samples), each written
by hsstore compressed (the default codec) and uncompressed. Every sample is read once, in one
shuffled order, from one thread, into a reused buffer:

* one eviction: the data set's files evicted from the page cache (`posix_fadvise(DONTNEED)`),
  then the pass (a read may find pages an earlier read's readahead brought in);
* each read: the files evicted before every read, untimed (a data set much larger than
  memory, read at random).

Each pass runs with read hints (`Storage.will_read`, the default) and without them
(`reads_ahead` turned off on the open dataset's storage: page faults on the shard maps read the
device's readahead window around them), alternating, best of ``--repeats``.

    python tools/bench_cold.py            # ~0.6 GB of data, a few minutes
    python tools/bench_cold.py --quick    # well under a minute

Last line (ratios within this run; small = MiniLM, large = synthetic):

    cold_each_hint_vs_nohint_small=.. cold_each_hint_vs_nohint_large=..
    cold_each_zstd_vs_none_small=.. cold_each_zstd_vs_none_large=..
"""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script from anywhere

import torch  # noqa: E402

import hsstore  # noqa: E402
from hsstore import LayerSpec  # noqa: E402
from hsstore.codecs import DEFAULT_CODEC  # noqa: E402
from tools.bench_peers import (  # noqa: E402
    Sample,
    data_arguments,
    evict,
    parse_data_arguments,
    real,
    synthetic,
)


def write(root: Path, samples: list[Sample], codec: str) -> None:
    _, layers, hidden = samples[0][1].shape
    ds = hsstore.create(root, layers=[LayerSpec(k + 1) for k in range(layers)],
                        hidden_size=hidden, dtype=torch.bfloat16, codec=codec)  # fmt: skip
    with ds.writer() as w:
        for i, (ids, states) in enumerate(samples):
            w.add(f"s{i}", ids, torch.ones_like(ids), states)


def cold_passes(root: Path, hints: bool, seed: int) -> tuple[float, float]:
    """GB/s of states of one shuffled pass after one eviction, and of one with an eviction
    before every read."""
    ds = hsstore.open(root)
    if not hints:
        ds.storage.reads_ahead = False
    lengths = [ds.num_tokens_of(i) for i in range(len(ds))]
    row = len(ds.layers) * ds.hidden_size
    buf = torch.empty(max(lengths) * row, dtype=torch.bfloat16)
    views = [buf[: t * row].view(t, len(ds.layers), ds.hidden_size) for t in lengths]
    order = torch.randperm(len(ds), generator=torch.Generator().manual_seed(seed)).tolist()
    state_bytes = sum(lengths) * row * 2
    ds.read_hidden_into(order[0], views[order[0]])  # loads the indexes before the clock runs
    ds.close()  # releases the maps: a mapped page cannot be evicted
    evict(root)
    t0 = time.perf_counter()
    for i in order:
        ds.read_hidden_into(i, views[i])
    one_eviction = state_bytes / (time.perf_counter() - t0) / 1e9
    seconds = 0.0
    for i in order:
        ds.close()  # a page still mapped (around the last read's faults) would stay cached
        evict(root)
        t0 = time.perf_counter()
        ds.read_hidden_into(i, views[i])
        seconds += time.perf_counter() - t0
    ds.close()
    return one_eviction, state_bytes / seconds / 1e9


def measure(name: str, samples: list[Sample], work: Path, repeats: int) -> dict[str, float]:
    best: dict[str, float] = {}
    print(f"\n{name}: {len(samples)} samples, {sum(s.nbytes for _, s in samples) / 1e6:.0f} MB "
          f"of states")  # fmt: skip
    print(f"{'case':32s} {'one eviction':>12s} {'each read':>10s}  (GB/s)")
    for codec in (DEFAULT_CODEC, "none"):
        root = work / f"{name}-{codec}"
        write(root, samples, codec)
        os.sync()
        for r in range(repeats):
            for hints in (True, False) if r % 2 == 0 else (False, True):
                one, each = cold_passes(root, hints, seed=r)
                for key, value in ((f"{codec} {hints} one", one), (f"{codec} {hints} each", each)):
                    best[key] = max(best.get(key, 0.0), value)
        for hints in (True, False):
            label = f"{codec}, {'hints' if hints else 'no hints'}"
            print(f"{label:32s} {best[f'{codec} {hints} one']:12.2f} "
                  f"{best[f'{codec} {hints} each']:10.2f}", flush=True)  # fmt: skip
        shutil.rmtree(root)
    return {
        "hint_vs_nohint": best[f"{DEFAULT_CODEC} True each"] / best[f"{DEFAULT_CODEC} False each"],
        "zstd_vs_none": best[f"{DEFAULT_CODEC} True each"] / best["none True each"],
    }


def main(argv: list[str] | None = None) -> dict[str, float]:
    args = parse_data_arguments(data_arguments(__doc__, repeats=2), argv)
    torch.set_num_threads(1)
    work = Path(tempfile.mkdtemp(prefix="hsstore-cold-", dir=args.workdir))
    try:
        large = measure("synthetic", synthetic(args), work, args.repeats)
        small = measure("minilm", real(args), work, args.repeats)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    final = {
        "cold_each_hint_vs_nohint_small": small["hint_vs_nohint"],
        "cold_each_hint_vs_nohint_large": large["hint_vs_nohint"],
        "cold_each_zstd_vs_none_small": small["zstd_vs_none"],
        "cold_each_zstd_vs_none_large": large["zstd_vs_none"],
    }
    print()
    print(" ".join(f"{k}={v:.2f}" for k, v in final.items()))
    return final


if __name__ == "__main__":
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    main()
