"""Benchmark the streaming loader against the raw-read ceiling and a speculators-v1-style loader.

One run builds (or reuses, with --data) three copies of the same synthetic samples: hsstore
uncompressed, hsstore compressed (the default codec) and one ``torch.save`` ``.pt`` file per sample in
the speculators v1 layout. Every case runs in its own subprocess so its peak RSS (itself plus
DataLoader workers) is its own. Cases, all shuffled, ``max_tokens`` packed batches:

* ceiling: ``readinto`` of the uncompressed dataset's state files into a reused batch-sized
  buffer;
* direct: the core's ``read_hidden_into`` in storage order, one thread, no loader (the decode
  bound the loader's single-thread figure is measured against);
* hsstore loader, uncompressed and compressed, with 1 decode thread and with all cores (and
  uncompressed without the whole-sample checksum, ``+noverify``);
* v1: ``torch.load(mmap=True)`` per sample, aux layers concatenated, speculators' packing
  collate (cat + pad), ``DataLoader`` with one worker per core, same batches;
* codec: the codec alone on one core, as `tools/bench_codec.py` times it: every chunk of the
  compressed copy, held in memory, decoded (crc checked) into one reused buffer; the compressed
  loader with one decode thread is measured against it (``loader_vs_codec``);
* codec-files: the codec alone again, but getting its bytes as any reader of the files must,
  two ways, the faster one kept: each shard file memory-mapped (its pages dropped after the
  shard, so that the process does not keep the dataset resident), or each chunk read with
  ``preadv`` into one reused cache-sized buffer; chunks decoded without crc (a loader checks
  the whole sample instead) one after another into a batch-sized buffer. Reading the page
  cache and writing batches far larger than the caches are what every reader pays on top of
  the codec alone: this is the bound of a loader, which is measured against it too;
* codec-held: the codec alone again, its chunks held in memory as for ``codec`` but decoded
  without crc into a batch-sized buffer as for codec-files: the rate no loader on one decode
  thread passes, whatever it does about reads and checks (``held_vs_codec``);
* codec-checked: codec-files with ``preadv``, plus XXH3 over every decoded chunk as the
  whole-sample checksum takes it: the bound of a loader on one decode thread that reads the
  files as hsstore does and verifies what it delivers (``checked_vs_codec``);
* codec-pipelined: codec-checked's reads, decoding and XXH3 each on a thread of its own, the
  decoding thread doing nothing else: what a loader with one decode thread could reach with
  reads and checks moved to other cores (``pipelined_vs_codec``);
* timed: the compressed loader with one decode thread again, every call of the codec inside
  it timed (`time_codec_calls`): ``codec_share`` is the share of the loader's epoch spent in
  the codec's own calls and ``codec_in_loader_vs_codec`` their rate against the codec alone.
  Since ``loader_vs_codec = codec_share x codec_in_loader_vs_codec``, these two say how much
  of the epoch the decode thread may spend on anything else (reads, checksums, batches) for a
  given ``loader_vs_codec``;
* cold: the ceiling and the loaders again after evicting the files from the page cache with
  ``posix_fadvise(DONTNEED)`` (only our files; other processes' caches are left alone).

Each case first runs one untimed epoch (page cache, buffers, imports); warm figures are the
best of ``--repeat`` further epochs, cold ones a single epoch after the eviction. GB/s counts raw
hidden-state bytes delivered (tokens x layers x hidden x itemsize). The last line is::

    loader_vs_ceiling=.. loader_vs_v1=.. compressed_gb_s_per_core=.. codec_gb_s=..
    loader_vs_codec=.. codec_files_vs_codec=.. held_vs_codec=.. checked_vs_codec=..
    pipelined_vs_codec=.. codec_share=.. codec_in_loader_vs_codec=.. peak_rss_mb=..

(loader = uncompressed, all cores, warm; ceiling with as many threads; codec_gb_s = the codec's
own single-core decode rate, loader_vs_codec = the compressed loader on one decode thread
against it, codec_files_vs_codec = the codec reading the files (the better of its two ways)
against the codec alone, held_vs_codec and checked_vs_codec = codec-held and codec-checked
against the codec alone; peak RSS = the largest of the hsstore loader cases).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script from anywhere

from hsstore.codec.codecs import DEFAULT_CODEC as COMPRESSED  # noqa: E402
from tools.codec_bounds import (  # noqa: E402
    codec_files_runner,
    codec_held_runner,
    codec_pipelined_runner,
    codec_runner,
    time_codec_calls,
)
from tools.process_memory import PssSampler, status_kb  # noqa: E402

LAYERS = 4


def _sample_lengths(tokens: int, seed: int) -> list[int]:
    rng = np.random.default_rng(seed)
    out, total = [], 0
    while total < tokens:
        n = int(rng.integers(128, 2048))
        out.append(n)
        total += n
    return out


def _activation_like(n: int, hidden: int, g: torch.Generator, scales: torch.Tensor) -> torch.Tensor:
    """[n, L, H] bf16 with per-channel scales (a few large outlier channels), like residuals."""
    x = torch.randn(n, LAYERS, hidden, generator=g) * scales
    return x.to(torch.bfloat16)


def build(root: Path, tokens: int, hidden: int, seed: int) -> None:
    """Write the three copies (skipped if already there)."""
    import hsstore
    from hsstore import LayerSpec

    lengths = _sample_lengths(tokens, seed)
    specs = [LayerSpec(depth=d) for d in (2, 8, 14, 16)]
    model = {
        "name": "bench",
        "revision": None,
        "num_hidden_layers": 16,
        "hidden_size": hidden,
        "vocab_size": 32000,
    }
    g = torch.Generator().manual_seed(seed)
    scales = torch.ones(LAYERS, hidden)
    scales[:, torch.randperm(hidden, generator=g)[:8]] = 30.0
    scales *= torch.linspace(0.5, 2.0, LAYERS)[:, None]
    if (root / "done").exists():
        return
    dss = {
        codec: hsstore.create(root / f"hs_{codec}", layers=specs, hidden_size=hidden, dtype=torch.bfloat16, model=model, codec=codec)
        for codec in ("none", COMPRESSED)
    }  # fmt: skip
    v1 = root / "v1"
    v1.mkdir(parents=True, exist_ok=True)
    writers = {c: ds.writer() for c, ds in dss.items()}
    for i, n in enumerate(lengths):
        ids = torch.randint(0, 32000, (n,), generator=g)
        mask = (torch.rand(n, generator=g) > 0.3).long()
        hid = _activation_like(n, hidden, g, scales)
        for w in writers.values():
            w.add(f"s{i:06d}", ids, mask, hid)
        torch.save(
            {"input_ids": ids, "loss_mask": mask, "hidden_states": [hid[:, k].clone() for k in range(LAYERS)]},
            v1 / f"data_{i}.pt",
        )  # fmt: skip
    for w in writers.values():
        w.commit()
        w.close()
    (root / "done").write_text("ok")


# --- cases (each runs in a subprocess) ------------------------------------------------------


def _files(path: Path, pattern: str) -> list[Path]:
    return sorted(p for p in path.rglob(pattern) if p.is_file())


def _evict(files: list[Path]) -> None:
    for p in files:
        fd = os.open(p, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def _ceiling_pass(files: list[Path], threads: int, buffer_bytes: int) -> int:
    """Read every byte of ``files`` with ``threads`` threads into batch-sized reused buffers.

    The destination is as large as one loader batch (the loader must also land its bytes in
    batch-sized memory the consumer reads), filled front to back and wrapped around.
    """
    parts = [files[k::threads] for k in range(threads)]
    totals = [0] * threads
    step = 8 << 20

    def work(k: int) -> None:
        buf = np.ones(buffer_bytes, dtype=np.uint8)  # touched once, before timing matters
        view = memoryview(buf)
        pos = 0
        for p in parts[k]:
            with open(p, "rb", buffering=0) as f:
                while True:
                    if pos + step > buffer_bytes:
                        pos = 0
                    n = f.readinto(view[pos : pos + step])
                    if not n:
                        break
                    pos += n
                    totals[k] += n

    ts = [threading.Thread(target=work, args=(k,)) for k in range(threads)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    return sum(totals)


def _direct_runner(path: Path, max_tokens: int):
    """The core's decode alone: ``read_hidden_into`` in storage order, one thread, no loader."""
    import hsstore

    ds = hsstore.open(path, read_threads=1)  # one thread: a sample's chunks are not split
    lengths = ds.index.column("num_tokens").to_numpy()
    row = len(ds.layers) * ds.hidden_size
    buf = torch.zeros(int(lengths.max()) * row, dtype=ds.dtype)

    def run(epoch: int) -> int:
        for i, n in enumerate(lengths.tolist()):
            ds.read_hidden_into(i, buf[: n * row].view(n, len(ds.layers), ds.hidden_size))
        return int(lengths.sum())

    return run


def _loader_runner(path: Path, threads: int, max_tokens: int, verify: bool = True):
    """One Loader for the whole case, as a training run keeps one across epochs."""
    from hsstore.loader import Loader

    loader = Loader(
        path,
        max_tokens=max_tokens,
        shuffle=True,
        seed=0,
        num_threads=threads,
        prefetch=2,
        verify_reads=verify,
    )

    def run(epoch: int) -> int:
        loader.set_epoch(epoch)
        tokens = 0
        for batch in loader:
            tokens += int(batch["lengths"].sum())
        # The loader decodes on into the next epoch; stop it so that every timed epoch starts
        # with an idle pipeline (a head start of prefetched batches would inflate it).
        loader.close()
        return tokens

    return run


def _v1_runner(root: Path, workers: int, max_tokens: int):
    """speculators v1: torch.load per sample + standardize + cat/pad collate + workers."""
    from torch.utils.data import DataLoader, Dataset

    from hsstore.loader import PlannedBatchSampler

    class V1Files(Dataset):
        def __init__(self, folder: Path, n: int):
            self.files = [folder / f"data_{i}.pt" for i in range(n)]

        def __len__(self) -> int:
            return len(self.files)

        def __getitem__(self, i: int) -> dict:
            data = torch.load(self.files[i], mmap=True, weights_only=True, map_location="cpu")
            n = data["input_ids"].shape[0]
            return {
                "hidden_states": torch.cat(data["hidden_states"][:-1], dim=-1),
                "input_ids": data["input_ids"],
                "verifier_last_hidden_states": data["hidden_states"][-1],
                "loss_mask": data["loss_mask"],
                "lengths": torch.tensor([n], dtype=torch.long),
                "position_ids": torch.arange(n, dtype=torch.long),
            }

    def collate(batch: list[dict]) -> dict:
        out = {}
        for key in batch[0]:
            cat = torch.cat([b[key] for b in batch], dim=0)
            if key != "lengths":
                pad = [0, 0] * cat.dim()
                pad[-1] = max_tokens - cat.shape[0]
                cat = torch.nn.functional.pad(cat[:max_tokens], pad).unsqueeze(0)
            out[key] = cat
        return out

    # The same batches as the hsstore loader (its plan over the same samples).
    sampler = PlannedBatchSampler(root / "hs_none", max_tokens=max_tokens, shuffle=True, seed=0)
    files = V1Files(root / "v1", len(sampler.source))
    dl = DataLoader(
        files, batch_sampler=sampler, collate_fn=collate, num_workers=workers, prefetch_factor=2
    )

    def run(epoch: int) -> int:
        sampler.set_epoch(epoch)
        tokens = 0
        for batch in dl:
            tokens += int(batch["lengths"].sum())
        return tokens

    return run


def run_case(args: argparse.Namespace) -> None:
    root = Path(args.data)
    kind, threads, temp = args.case.split(":")
    threads = int(threads)
    if kind == "ceiling":
        files = _files(root / "hs_none", "states/c/*/0/0")
        evict_files = files
    elif kind == "v1":
        files = _files(root / "v1", "*.pt")
        evict_files = files
    elif kind.startswith("codec"):
        evict_files = []
    else:
        evict_files = _files(root / kind.removeprefix("direct-").partition("+")[0], "*")

    batch_bytes = args.max_tokens * LAYERS * args.hidden * 2
    if kind == "ceiling":
        run = lambda epoch: _ceiling_pass(files, threads, batch_bytes)  # noqa: E731
    elif kind.startswith("direct-"):
        run = _direct_runner(root / kind.removeprefix("direct-"), args.max_tokens)
    elif kind == "v1":
        run = _v1_runner(root, threads, args.max_tokens)
    elif kind == "codec":
        run = codec_runner(root / f"hs_{COMPRESSED}")
    elif kind == "codec-held":
        run = codec_held_runner(root / f"hs_{COMPRESSED}", batch_bytes)
    elif kind == "codec-pipelined":
        run = codec_pipelined_runner(root / f"hs_{COMPRESSED}", batch_bytes)
    elif kind.startswith("codec-"):
        how = kind.removeprefix("codec-")
        run = codec_files_runner(root / f"hs_{COMPRESSED}", batch_bytes, how)
    else:
        name, _, flag = kind.partition("+")
        run = _loader_runner(root / name, threads, args.max_tokens, verify=flag != "noverify")
    in_codec = time_codec_calls() if kind.endswith("+timed") else [0.0]

    def once(epoch: int) -> tuple[float, int, float]:
        in_codec[0] = 0.0
        t0 = time.perf_counter()
        n = run(epoch)
        return time.perf_counter() - t0, n, in_codec[0]

    sampler = PssSampler()
    sampler.start()
    once(0)  # warm the page cache and this process (buffers, workers' imports)
    if temp == "cold":
        _evict(evict_files)
        results = [once(1)]
    else:
        results = [once(1 + k) for k in range(args.repeat)]
    secs, amount, codec_secs = min(results)
    peak_pss_kb = sampler.stop()
    # VmHWM is per address space and starts afresh at exec (ru_maxrss would inherit the
    # parent's high-water mark across fork+exec).
    self_hwm_kb = status_kb("VmHWM")
    nbytes = (
        amount
        if kind == "ceiling" or kind.startswith("codec")
        else amount * LAYERS * args.hidden * 2
    )
    print(json.dumps({
        "case": args.case, "seconds": secs, "gb_s": nbytes / secs / 1e9,
        "codec_seconds": codec_secs,
        "tokens_s": (nbytes / (LAYERS * args.hidden * 2)) / secs,
        "peak_rss_mb": self_hwm_kb / 1024, "peak_pss_all_mb": peak_pss_kb / 1024,
    }))  # fmt: skip


def main() -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--data", help="folder with (or for) the benchmark copies; default: a temp dir")
    p.add_argument("--tokens", type=int, default=65536, help="tokens per copy")
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--max-tokens", type=int, default=8192)
    p.add_argument("--repeat", type=int, default=2, help="timed epochs per case and round")
    p.add_argument("--rounds", type=int, default=2, help="interleaved rounds over all cases")
    p.add_argument("--threads", type=int, default=os.cpu_count() or 1, help="'all cores'")
    p.add_argument("--case", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.case:
        run_case(args)
        return
    tmp = None
    if args.data is None:
        tmp = tempfile.TemporaryDirectory(prefix="hsstore-bench-")
        args.data = tmp.name
    root = Path(args.data)
    t0 = time.perf_counter()
    build(root, args.tokens, args.hidden, seed=0)
    raw_gb = sum(p.stat().st_size for p in _files(root / "hs_none", "states/c/*/0/0")) / 1e9
    comp_gb = (
        sum(p.stat().st_size for p in _files(root / f"hs_{COMPRESSED}", "states/c/*/0/0")) / 1e9
    )
    print(f"data: {args.tokens} tokens x {LAYERS} layers x {args.hidden} bf16 = {raw_gb:.2f} GB raw, "
          f"{comp_gb:.2f} GB compressed ({raw_gb / comp_gb:.2f}x); built/checked in {time.perf_counter() - t0:.0f}s")  # fmt: skip
    n = args.threads
    cases = [
        "ceiling:1:warm", f"ceiling:{n}:warm",
        "hs_none:1:warm", f"hs_none:{n}:warm", f"hs_none+noverify:{n}:warm",
        f"hs_{COMPRESSED}:1:warm", f"hs_{COMPRESSED}:{n}:warm", f"hs_{COMPRESSED}+timed:1:warm",
        f"v1:{n}:warm", "direct-hs_none:1:warm", f"direct-hs_{COMPRESSED}:1:warm", "codec:1:warm",
        "codec-mapped:1:warm", "codec-pread:1:warm", "codec-held:1:warm", "codec-checked:1:warm", "codec-pipelined:1:warm", f"ceiling:{n}:cold", f"hs_none:{n}:cold", f"hs_{COMPRESSED}:{n}:cold", f"v1:{n}:cold",
    ]  # fmt: skip
    res: dict[str, dict] = {}
    for _ in range(args.rounds):  # whole rounds, interleaved: load drifts hit every case alike
        for case in cases:
            cmd = [sys.executable, __file__, "--case", case, "--data", str(root), "--hidden", str(args.hidden),
                   "--max-tokens", str(args.max_tokens), "--repeat", str(args.repeat)]  # fmt: skip
            out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
            r = json.loads(out.strip().splitlines()[-1])
            old = res.get(case)
            if old is not None:
                r["peak_rss_mb"] = max(r["peak_rss_mb"], old["peak_rss_mb"])
                r["peak_pss_all_mb"] = max(r["peak_pss_all_mb"], old["peak_pss_all_mb"])
                if old["gb_s"] > r["gb_s"]:
                    r = {
                        **old,
                        "peak_rss_mb": r["peak_rss_mb"],
                        "peak_pss_all_mb": r["peak_pss_all_mb"],
                    }
            res[case] = r
    print(f"best of {args.rounds} interleaved rounds x {args.repeat} epochs; rss = the process's "
          "VmHWM, pss = peak summed PSS of the process and its DataLoader workers")  # fmt: skip
    for case, r in res.items():
        print(f"{case:28s} {r['gb_s']:6.2f} GB/s {r['tokens_s'] / 1e3:8.1f} ktok/s  "
              f"rss {r['peak_rss_mb']:6.0f} MB  pss {r['peak_pss_all_mb']:6.0f} MB")  # fmt: skip
    g = {c: r["gb_s"] for c, r in res.items()}
    comp1 = g[f"hs_{COMPRESSED}:1:warm"]
    print(f"scaling 1->{n} threads: uncompressed {g[f'hs_none:{n}:warm'] / g['hs_none:1:warm']:.2f}x, "
          f"compressed {g[f'hs_{COMPRESSED}:{n}:warm'] / comp1:.2f}x")  # fmt: skip
    print(f"cold cache (page cache of our files evicted with posix_fadvise DONTNEED): loader/ceiling "
          f"{g[f'hs_none:{n}:cold'] / g[f'ceiling:{n}:cold']:.2f}, loader/v1 {g[f'hs_none:{n}:cold'] / g[f'v1:{n}:cold']:.2f}, "
          f"compressed/v1 {g[f'hs_{COMPRESSED}:{n}:cold'] / g[f'v1:{n}:cold']:.2f}")  # fmt: skip
    print(f"compressed loader (1 thread) vs the core's own sequential decode (1 thread): "
          f"{comp1 / g[f'direct-hs_{COMPRESSED}:1:warm']:.2f}")  # fmt: skip
    codec = g["codec:1:warm"]
    files = max(g["codec-mapped:1:warm"], g["codec-pread:1:warm"])
    print(f"the codec reading the files (mapped {g['codec-mapped:1:warm']:.2f} GB/s, preadv "
          f"{g['codec-pread:1:warm']:.2f} GB/s) vs the codec alone (1 core, {codec:.2f} GB/s): "
          f"{files / codec:.2f}")  # fmt: skip
    held, checked = g["codec-held:1:warm"], g["codec-checked:1:warm"]
    print(f"the codec from memory into batch-sized memory ({held:.2f} GB/s, no checks) vs the codec "
          f"alone: {held / codec:.2f}")  # fmt: skip
    print(f"the codec reading the files with preadv and checksumming what it decodes "
          f"({checked:.2f} GB/s) vs the codec alone: {checked / codec:.2f}")  # fmt: skip
    print(f"compressed loader (1 thread) vs the codec alone: {comp1 / codec:.2f}; vs the codec "
          f"reading the files: {comp1 / files:.2f}; vs the codec into batch memory: "
          f"{comp1 / held:.2f}; vs the codec reading and checksumming: {comp1 / checked:.2f}")  # fmt: skip
    pipelined = g["codec-pipelined:1:warm"]
    print(f"the same with reads, decoding and XXH3 on three threads ({pipelined:.2f} GB/s) vs the "
          f"codec alone: {pipelined / codec:.2f}")  # fmt: skip
    timed = res[f"hs_{COMPRESSED}+timed:1:warm"]
    share = timed["codec_seconds"] / timed["seconds"]
    in_loader = timed["gb_s"] / share
    print(f"compressed loader (1 thread), its codec calls timed: {share:.2f} of the epoch in the "
          f"codec, decoding at {in_loader:.2f} GB/s there ({in_loader / codec:.2f} of the codec "
          f"alone)")  # fmt: skip
    print(f"uncompressed loader without whole-sample checksums (verify_reads=False) vs ceiling: "
          f"{g[f'hs_none+noverify:{n}:warm'] / g[f'ceiling:{n}:warm']:.2f}")  # fmt: skip
    peak = max(r["peak_rss_mb"] for c, r in res.items() if c.startswith("hs_"))
    print(
        f"loader_vs_ceiling={g[f'hs_none:{n}:warm'] / g[f'ceiling:{n}:warm']:.2f} "
        f"loader_vs_v1={g[f'hs_none:{n}:warm'] / g[f'v1:{n}:warm']:.2f} "
        f"compressed_gb_s_per_core={comp1:.2f} codec_gb_s={codec:.2f} "
        f"loader_vs_codec={comp1 / codec:.2f} codec_files_vs_codec={files / codec:.2f} "
        f"held_vs_codec={held / codec:.2f} checked_vs_codec={checked / codec:.2f} "
        f"pipelined_vs_codec={pipelined / codec:.2f} codec_share={share:.2f} "
        f"codec_in_loader_vs_codec={in_loader / codec:.2f} "
        f"peak_rss_mb={peak:.0f}"
    )
    if tmp is not None:
        tmp.cleanup()


if __name__ == "__main__":
    main()
