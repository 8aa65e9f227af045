"""Benchmark the loader reading s3:// against the same server's ceiling and against local disk.

Starts its own S3 server (SeaweedFS `weed mini` on loopback, tools/seaweed.py), writes the same
synthetic samples (uncompressed, so the figures measure transport, not decode) to a local
folder and to ``s3://``, then measures, all in this run:

* ceiling: obstore fetching the same shard bytes with many ranged GETs in flight (1 MiB
  ranges, ``--threads`` at once);
* remote: the Loader (shuffled, packed batches, ``--threads`` decode threads) from ``s3://``;
* local: the same Loader from the local copy (page cache warm: the best case for local);
* cached: a second epoch from ``s3://`` with the local cache directory on (the first epoch
  filled it), against local.

Each figure is the best of ``--repeat`` epochs after one untimed warm-up. GB/s counts raw
hidden-state bytes delivered. Last line::

    remote_loader_vs_get_ceiling=X remote_loader_vs_local=Y cached_epoch_vs_local=Z
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import hsstore  # noqa: E402
from hsstore import LayerSpec  # noqa: E402
from hsstore.loader import Loader  # noqa: E402
from hsstore.spec import paths  # noqa: E402
from hsstore.storage.object_store import ObjectStorage  # noqa: E402
from hsstore.tuning import tune_process  # noqa: E402
from tools.seaweed import SeaweedServer  # noqa: E402
from tools.timing import best_of  # noqa: E402

LAYERS = 4


def build(locations: list[str], mb: int, hidden: int) -> int:
    """The same samples at every location; returns the raw state bytes."""
    g = torch.Generator().manual_seed(0)
    token_bytes = LAYERS * hidden * 2
    lengths, total = [], 0
    while total < mb * (1 << 20):
        n = int(torch.randint(128, 2048, (1,), generator=g))
        lengths.append(n)
        total += n * token_bytes
    for loc in locations:
        ds = hsstore.create(loc, layers=[LayerSpec(d) for d in range(1, LAYERS + 1)],
                            hidden_size=hidden, dtype=torch.bfloat16, codec="none",
                            shard_bytes=16 << 20)  # fmt: skip
        gen = torch.Generator().manual_seed(1)
        with ds.writer() as w:
            for i, n in enumerate(lengths):
                hid = torch.randn(n, LAYERS, hidden, generator=gen).to(torch.bfloat16)
                w.add(
                    f"s{i}",
                    torch.zeros(n, dtype=torch.int64),
                    torch.ones(n, dtype=torch.int64),
                    hid,
                )
    return total


def epochs(ds: hsstore.Dataset, threads: int, repeat: int, max_tokens: int) -> float:
    """Best seconds of one epoch (after an untimed first one). One Loader serves every epoch,
    as in training, so its batch buffers are allocated once (by the untimed epoch); it is
    closed after each epoch, so nothing decoded ahead carries over into the next timing."""
    keys = ("hidden_states", "verifier_last_hidden_states")
    loader = Loader(ds, max_tokens=max_tokens, seed=0, num_threads=threads, prefetch=4)
    epoch = [0]

    def one() -> int:
        loader.set_epoch(epoch[0])
        epoch[0] += 1
        got = sum(v.numel() * v.element_size() for b in loader for k, v in b.items() if k in keys)
        loader.close()
        return got

    one()
    try:
        return best_of(one, repeat)
    finally:
        loader.close()


def ceiling(url: str, threads: int) -> float:
    """Seconds for obstore to fetch every shard byte with ``threads`` ranged GETs in flight."""
    import obstore
    from obstore.store import from_url

    store = from_url(url, client_options={"allow_http": True})
    ds = hsstore.open(url)
    ranges = []
    for seg in ds.manifest.segments:
        for rel, info in seg.files.items():
            if rel.startswith(paths.STATES + "/c/"):
                key = paths.segment_file(seg.id, rel)
                ranges += [
                    (key, o, min(1 << 20, info.size - o)) for o in range(0, info.size, 1 << 20)
                ]

    def fetch(r: tuple[str, int, int]) -> int:
        return len(obstore.get_range(store, r[0], start=r[1], length=r[2]))

    with ThreadPoolExecutor(threads) as pool:
        t0 = time.perf_counter()
        sum(pool.map(fetch, ranges))
        return time.perf_counter() - t0


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--mb", type=int, default=96, help="raw MiB of states")
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--threads", type=int, default=16, help="loader threads / GETs in flight")
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--max-tokens", type=int, default=2048, help="tokens per packed batch")
    args = p.parse_args()
    tune_process()  # every read here, Loader or not, as hsstore's own programs read
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp, SeaweedServer(Path(tmp) / "s3") as server:
        os.environ.update(server.env())
        url, local = "s3://hsstore/bench/ds", str(Path(tmp) / "local")
        raw = build([local, url], args.mb, args.hidden)
        gb = raw / 1e9
        ceiling(url, args.threads)
        t_ceiling = min(ceiling(url, args.threads) for _ in range(args.repeat))
        mt = args.max_tokens
        t_remote = epochs(hsstore.open(url), args.threads, args.repeat, mt)
        t_local = epochs(hsstore.open(local), args.threads, args.repeat, mt)
        cache = ObjectStorage(url, cache_dir=str(Path(tmp) / "cache"), cache_bytes=4 << 30)
        # the untimed first epoch fills the cache
        t_cached = epochs(hsstore.open(cache), args.threads, args.repeat, mt)
        print(f"raw state data: {gb:.3f} GB, {args.threads} threads")
        for name, t in (("ceiling (obstore ranged GETs)", t_ceiling), ("loader s3://", t_remote),
                        ("loader local", t_local), ("loader s3:// cached", t_cached)):  # fmt: skip
            print(f"{name:32s} {gb / t:7.3f} GB/s")
        print(
            f"remote_loader_vs_get_ceiling={t_ceiling / t_remote:.2f} "
            f"remote_loader_vs_local={t_local / t_remote:.2f} "
            f"cached_epoch_vs_local={t_local / t_cached:.2f}"
        )


if __name__ == "__main__":
    main()
