"""Cold per-sample reads: a random read of a data set that is not in the page cache.

The two data sets of the peer race (`tools/bench_peers.py`): synthetic LLM-like `[T, 4, 2048]`
bf16 (large samples) and MiniLM-L6 activations `[T, 7, 384]` bf16 (small samples), each written
by hsstore compressed (the default codec) and uncompressed. Every sample is read once, in one
shuffled order, from one thread, into a reused buffer:

* one eviction: the data set's files evicted from the page cache (`posix_fadvise(DONTNEED)`),
  then the pass (a read may find pages an earlier read's readahead brought in);
* each read: the files evicted before every read, untimed (a data set much larger than
  memory, read at random).

Each pass runs with each setting of the local storage's `read_hints`: "in order" (the default:
a compressed read asks for its chunks in order, a few ahead of its decoding), "all at once"
(all the chunks of a read in one hint before the first is decoded; compressed data only, an
uncompressed read has no chunks to pace) and "none" (plain reads, with the kernel's own
readahead around them), the cases in turn, their order rotated from one repeat
to the next, best of ``--repeats``.

    python tools/bench_cold.py            # ~0.6 GB of data, a few minutes
    python tools/bench_cold.py --quick    # well under a minute

Last line (ratios within this run; small = MiniLM, large = synthetic):

    cold_each_hint_vs_nohint_small=.. cold_each_hint_vs_nohint_large=..
    cold_each_zstd_vs_none_small=.. cold_each_zstd_vs_none_large=..
    cold_each_inorder_vs_allatonce_small=.. cold_each_inorder_vs_allatonce_large=..
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
from hsstore.codec.codecs import DEFAULT_CODEC  # noqa: E402
from hsstore.storage.local_store import LocalStorage  # noqa: E402
from hsstore.storage.read_ahead import ReadHints  # noqa: E402
from tools.bench_peers import data_arguments, parse_data_arguments, real, synthetic  # noqa: E402
from tools.peer_formats import Sample, evict  # noqa: E402


def write(root: Path, samples: list[Sample], codec: str) -> None:
    _, layers, hidden = samples[0][1].shape
    ds = hsstore.create(root, layers=[LayerSpec(k + 1) for k in range(layers)],
                        hidden_size=hidden, dtype=torch.bfloat16, codec=codec)  # fmt: skip
    with ds.writer() as w:
        for i, (ids, states) in enumerate(samples):
            w.add(f"s{i}", ids, torch.ones_like(ids), states)


# The cases of a pass: how a read hands its bytes to the storage.
IN_ORDER, ALL_AT_ONCE, NO_HINTS = "hints", "hints all at once", "no hints"
READ_HINTS = {IN_ORDER: ReadHints.IN_ORDER, ALL_AT_ONCE: ReadHints.ALL_AT_ONCE,
              NO_HINTS: ReadHints.NONE}  # fmt: skip


def cold_passes(root: Path, case: str, seed: int) -> tuple[float, float]:
    """GB/s of states of one shuffled pass after one eviction, and of one with an eviction
    before every read."""
    storage = LocalStorage(root, read_hints=READ_HINTS[case])
    return _cold_passes(storage, root, seed)


def _cold_passes(storage: LocalStorage, root: Path, seed: int) -> tuple[float, float]:
    ds = hsstore.open(storage)
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
        cases = [IN_ORDER, ALL_AT_ONCE, NO_HINTS] if codec != "none" else [IN_ORDER, NO_HINTS]
        for r in range(repeats):
            # Rotated: the first pass over a data set may find the host's cache of the VM disk
            # colder than the passes after it.
            for case in cases[r % len(cases) :] + cases[: r % len(cases)]:
                one, each = cold_passes(root, case, seed=r)
                for key, value in ((f"{codec} {case} one", one), (f"{codec} {case} each", each)):
                    best[key] = max(best.get(key, 0.0), value)
        for case in cases:
            print(f"{codec + ', ' + case:32s} {best[f'{codec} {case} one']:12.2f} "
                  f"{best[f'{codec} {case} each']:10.2f}", flush=True)  # fmt: skip
        shutil.rmtree(root)
    in_order = best[f"{DEFAULT_CODEC} {IN_ORDER} each"]
    return {
        "hint_vs_nohint": in_order / best[f"{DEFAULT_CODEC} {NO_HINTS} each"],
        "zstd_vs_none": in_order / best[f"none {IN_ORDER} each"],
        "inorder_vs_allatonce": in_order / best[f"{DEFAULT_CODEC} {ALL_AT_ONCE} each"],
    }


def main(argv: list[str] | None = None) -> dict[str, float]:
    args = parse_data_arguments(data_arguments(__doc__, repeats=3), argv)
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
        "cold_each_inorder_vs_allatonce_small": small["inorder_vs_allatonce"],
        "cold_each_inorder_vs_allatonce_large": large["inorder_vs_allatonce"],
    }
    print()
    print(" ".join(f"{k}={v:.2f}" for k, v in final.items()))
    return final


if __name__ == "__main__":
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    main()
