"""History benchmark: what a long history of small commits costs.

One writer commits ``--commits`` times, one small segment each (the pattern of many writers
committing often). Then: how long the first and the last commits took, how long `open` and
`verify` take on the result, how much of the disk the manifests use, and how much reader memory
each reading thread keeps after a full pass (which must not grow with the number of segments).

    python tools/bench_history.py                    # 1,000 commits, a few minutes
    python tools/bench_history.py --commits 10000    # the figure to report
    python tools/bench_history.py --commits 100      # smoke test

The last line is machine-readable:
    commit_ms_first=12.1 commit_ms_last=13.0 open_s=2.1 verify_s=20.3 manifest_mb=9.1
    rss_mb_per_thread=1.2
(commit_ms_*: median over the first / last 5% of commits, at least 20; manifest_mb is
followed by its share of the data on the line before.)
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script from anywhere

import torch  # noqa: E402

import hsstore  # noqa: E402
from hsstore import LayerSpec  # noqa: E402
from hsstore.commits import commit  # noqa: E402
from tools.synthetic import llm_like_states  # noqa: E402


def _rss_mb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 1e6


def _dir_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def write_history(path: Path, commits: int, tokens: int, layers: int, hidden: int) -> list[float]:
    """Seconds of each commit (``Writer.commit``: segment files, fsyncs and the manifest)."""
    ds = hsstore.create(path, layers=[LayerSpec(k + 1) for k in range(layers)],
                        hidden_size=hidden, dtype=torch.bfloat16)  # fmt: skip
    states = llm_like_states(tokens, layers, hidden, seed=0)
    ids = torch.arange(tokens) % 1000
    mask = torch.ones(tokens, dtype=torch.long)
    times = []
    with ds.writer(encode_threads=1) as w:
        for i in range(commits):
            w.add(f"s{i}", ids, mask, states)
            t0 = time.perf_counter()
            w.commit()
            times.append(time.perf_counter() - t0)
            if (i + 1) % max(1, commits // 10) == 0:
                print(f"  {i + 1} commits, last {times[-1] * 1e3:.1f} ms", flush=True)
    return times


def reader_rss_per_thread(path: Path, threads: int) -> tuple[float, float]:
    """RSS (MB) each reading thread adds over a full pass, per thread: after half the
    segments and after all of them (flat means the two agree)."""
    ds = hsstore.open(path)
    n = len(ds)
    for i in range(min(n, 8)):  # warm the shared caches (columns, allocator) once
        ds.read(i)
    base = _rss_mb()

    def part(lo: int, hi: int) -> None:
        def run(k: int) -> None:
            for i in range(lo + k, hi, threads):
                ds.read(i)

        pool = [threading.Thread(target=run, args=(k,)) for k in range(threads)]
        for t in pool:
            t.start()
        for t in pool:
            t.join()

    part(0, n // 2)
    half = (_rss_mb() - base) / threads
    part(n // 2, n)
    full = (_rss_mb() - base) / threads
    return half, full


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--commits", type=int, default=1000)
    ap.add_argument("--tokens", type=int, default=256, help="tokens per commit (one sample)")
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--hidden", type=int, default=128)
    ap.add_argument("--threads", type=int, default=4, help="reading threads for the RSS figure")
    ap.add_argument("--dir", type=Path, default=None, help="scratch directory (default: temp)")
    ap.add_argument("--keep", action="store_true", help="keep the dataset")
    args = ap.parse_args()

    work = Path(tempfile.mkdtemp(prefix="bench-history-", dir=args.dir))
    path = work / "ds"
    try:
        print(f"writing {args.commits} commits of {args.tokens} tokens x {args.layers} layers "
              f"x {args.hidden} under {path}", flush=True)  # fmt: skip
        times = write_history(path, args.commits, args.tokens, args.layers, args.hidden)
        k = max(20, len(times) // 20)
        first_ms = statistics.median(times[:k]) * 1e3
        last_ms = statistics.median(times[-k:]) * 1e3
        every = commit.CHECKPOINT_EVERY
        checkpoint_ms = [t * 1e3 for i, t in enumerate(times) if (i + 2) % every == 0]
        print(f"commit ms: max {max(times) * 1e3:.1f}; the last checkpointing commit "
              f"{checkpoint_ms[-1] if checkpoint_ms else 0:.1f}", flush=True)  # fmt: skip

        t0 = time.perf_counter()
        ds = hsstore.open(path)
        open_s = time.perf_counter() - t0
        assert len(ds) == args.commits
        del ds

        t0 = time.perf_counter()
        report = hsstore.verify(path)
        verify_s = time.perf_counter() - t0
        assert report.ok, report.problems[:3]

        manifest_bytes = _dir_bytes(path / "manifests")
        data_bytes = _dir_bytes(path / "segments")
        half, full = reader_rss_per_thread(path, args.threads)
        print(f"manifests {manifest_bytes / data_bytes:.2%} of data ({data_bytes / 1e6:.1f} MB); "
              f"reader RSS per thread after half / all segments: {half:.1f} / {full:.1f} MB",
              flush=True)  # fmt: skip
        print(
            f"commit_ms_first={first_ms:.1f} commit_ms_last={last_ms:.1f} open_s={open_s:.2f} "
            f"verify_s={verify_s:.2f} manifest_mb={manifest_bytes / 1e6:.2f} "
            f"rss_mb_per_thread={full:.2f}"
        )
    finally:
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
