"""Commit benchmark: many writer processes committing small samples to one dataset at once.

For each N of ``--writers`` (default 1, 4, 16, 64), N processes open the same dataset and a
writer each, wait at a start barrier, then each makes ``--commits`` commits of one small
sample (`Writer.add` + `Writer.commit`, the public API). Every process's storage is the real
backend wrapped to count its calls (tests/faults.py's wrapper, no fault injected), so the
figures say where racing writers spend their calls: manifest versions read back, creates
lost to another writer, the hint, leases, the segments of other writers read for the
duplicate-id check. After each run the dataset is opened and must hold every sample once.

    python tools/bench_commits.py                       # local folder, then S3 (SeaweedFS)
    python tools/bench_commits.py --commits 20          # longer runs
    python tools/bench_commits.py --backends local --writers 1 64
    python tools/bench_commits.py --json                # one JSON document instead
    python tools/bench_commits.py --create-race 8       # first: 8 racing creates of one object

commits/s is every commit of the run over the time from the barrier to the last commit; p99
over every commit's latency (add + commit). Each N's line also gives the CPU per commit of the
writers and of the S3 server (on the same machine), and the floor their sum puts under the
mean latency on this machine's cores. The line before the last holds the S3 figures (``s3_``
prefix); the last line, the local folder's:

    commits_per_s_1=80 commits_per_s_64=95 scaling=1.19 p99_ms_64=900 calls_per_commit_64=30
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import shutil
import sys
import tempfile
import threading
import time
import uuid
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from multiprocessing import forkserver
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script from anywhere

import torch  # noqa: E402

import hsstore  # noqa: E402
from hsstore import LayerSpec  # noqa: E402
from hsstore.spec import paths  # noqa: E402
from hsstore.storage.locations import open_storage  # noqa: E402
from hsstore.tuning import space_collections  # noqa: E402
from tests.faults import FaultyStorage  # noqa: E402

TOKENS, LAYERS, HIDDEN = 16, 2, 64
CORES = len(os.sched_getaffinity(0))


def kind_of(verb: str, key: str) -> str:
    """What a storage call is for, by its key: the classes the report counts."""
    if key.startswith(f"{paths.MANIFESTS}/"):
        name = key.rsplit("/", 1)[-1]
        if paths.manifest_version(name) is not None:
            return "version_create" if verb == "put_if_absent" else "version_read"
        if key == paths.LATEST_HINT:
            return "hint"
        if paths.checkpoint_version(name) is not None:
            return "checkpoint"
        return "manifests_other"
    if key == paths.MANIFESTS:
        return "list_manifests"
    if key.endswith("/.writing"):
        return "lease"
    if key.endswith("/.committed"):
        return "mark"
    if key.startswith(f"{paths.SEGMENTS}/"):
        return "segment_write" if verb in ("write_file", "put", "sync") else "segment_read"
    if key == paths.SEGMENTS:
        return "list_segments"
    return "other"


class CountingStorage(FaultyStorage):
    """The real storage, every call counted by kind (and lost creates of versions)."""

    def __init__(self, inner: Any):
        super().__init__(inner)
        self.counts: Counter[str] = Counter()
        self.lost_create_s: list[float] = []  # how long each lost create took to answer

    def _run(self, verb: str, key: str, do: Any) -> Any:
        kind = kind_of(verb, key)
        self.counts[kind] += 1  # before the call: one that raises (a read of an absent
        start = time.monotonic()  # version, a waiting writer's poll) counts too
        result = super()._run(verb, key, do)
        if kind == "version_create" and result is False:
            self.counts["version_create_lost"] += 1
            self.lost_create_s.append(time.monotonic() - start)
        return result


def sample(seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(TOKENS, LAYERS, HIDDEN, generator=g).to(torch.bfloat16)
    return torch.arange(TOKENS) % 1000, torch.ones(TOKENS, dtype=torch.long), hidden


def writer_process(
    location: str, w: int, commits: int, barrier: Any, results: Any, env: dict[str, str]
) -> None:
    os.environ.update(env)
    try:
        storage = CountingStorage(open_storage(location))
        ds = hsstore.open(storage)
        writer = ds.writer(encode_threads=1)
        samples = [sample(w * 100_000 + i) for i in range(commits)]
        # Each process stands for an extraction worker, and collects as hsstore's own programs
        # do (hsstore.tuning): at CPython's default pace, 64 processes holding torch's start-up
        # objects, reading the same versions, run their passes over every object in lockstep,
        # some 150 ms of CPU each, and stall one another for seconds on 2 cores.
        space_collections()
        storage.counts.clear()  # opening is not what the run measures
        storage.lost_create_s.clear()
        barrier.wait()
        start, cpu = time.monotonic(), time.process_time()
        latencies = []
        for i, (ids, mask, hidden) in enumerate(samples):
            t0 = time.monotonic()
            writer.add(f"w{w}-{i}", ids, mask, hidden)
            writer.commit()
            latencies.append(time.monotonic() - t0)
        end, cpu = time.monotonic(), time.process_time() - cpu
        writer.close()
        results.put({"w": w, "start": start, "end": end, "cpu": cpu, "lat": latencies,
                     "counts": dict(storage.counts), "lost": storage.lost_create_s})  # fmt: skip
    except BaseException as exc:  # noqa: BLE001 - reported by the parent
        results.put({"w": w, "error": f"{type(exc).__name__}: {exc}"})


def server_cpu_s(pid: int | None) -> float:
    """CPU seconds the storage server (None: a local folder, no server) has used so far."""
    if pid is None:
        return 0.0
    with open(f"/proc/{pid}/stat") as f:  # Linux: utime and stime, fields 14 and 15
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def run(
    ctx: Any, location: str, writers: int, commits: int, env: dict[str, str], server_pid: int | None
) -> dict:
    hsstore.create(location, layers=[LayerSpec(k + 1) for k in range(LAYERS)],
                   hidden_size=HIDDEN, dtype=torch.bfloat16)  # fmt: skip
    barrier, results = ctx.Barrier(writers + 1), ctx.Queue()  # this process starts them
    procs = [
        ctx.Process(target=writer_process, args=(location, w, commits, barrier, results, env))
        for w in range(writers)
    ]
    for p in procs:
        p.start()
    barrier.wait()
    server_cpu = server_cpu_s(server_pid)
    got = [results.get(timeout=1800) for _ in procs]
    server_cpu = server_cpu_s(server_pid) - server_cpu  # a writer's close() is a call or two
    for p in procs:
        p.join()
    errors = [r["error"] for r in got if "error" in r]
    if errors:
        raise SystemExit(f"{len(errors)} writer(s) failed; first: {errors[0]}")
    ds = hsstore.open(location)
    expected = {f"w{w}-{i}" for w in range(writers) for i in range(commits)}
    ids = list(ds.sample_ids)
    if len(ids) != len(expected) or set(ids) != expected:
        raise SystemExit(f"{location}: {len(ids)} samples, expected each of {len(expected)} once")
    total = writers * commits
    wall = max(r["end"] for r in got) - min(r["start"] for r in got)
    lat = sorted(x for r in got for x in r["lat"])
    # Past each writer's first commit: the first round is every writer arriving at once.
    later = sorted(x for r in got for x in r["lat"][1:]) or lat
    counts: Counter[str] = Counter()
    for r in got:
        counts.update(r["counts"])
    calls = sum(v for k, v in counts.items() if k != "version_create_lost")
    slowest_writer = max(r["end"] - r["start"] for r in got)
    lost = sorted(x for r in got for x in r["lost"])
    return {
        "writers": writers,
        "commits": total,
        "commits_per_s": total / wall,
        "p50_ms": lat[len(lat) // 2] * 1e3,
        "p99_ms": lat[min(len(lat) - 1, int(len(lat) * 0.99))] * 1e3,
        "max_ms": lat[-1] * 1e3,
        "p99_after_first_ms": later[min(len(later) - 1, int(len(later) * 0.99))] * 1e3,
        "slowest_writer_s": slowest_writer,
        "wall_s": wall,
        "calls_per_commit": calls / total,
        # CPU seconds every writer, and the storage server on the same machine, spent per
        # commit: the machine's cores over their sum bound the commits/s it can reach at
        # this N, whatever the protocol's waits. And since each writer always has a commit in
        # flight, the mean latency is N over commits/s (Little's law): N times the sum over
        # the cores is a floor under the mean latency, so under p50 and p99 alike.
        "cpu_ms_per_commit": sum(r["cpu"] for r in got) / total * 1e3,
        "server_cpu_ms_per_commit": server_cpu / total * 1e3,
        "per_commit": {k: round(v / total, 2) for k, v in sorted(counts.items())},
        # A server may hold a create that loses until the one that won is written: then
        # each lost create is a wait, however few the requests.
        "lost_create_ms_max": lost[-1] * 1e3 if lost else 0.0,
        "version": ds.manifest.version,
    }


def create_race(location: str, racers: int) -> list[float]:
    """``racers`` threads create one object at once (`put_if_absent`, as writers racing for a
    version do): the seconds each took to be answered, sorted. One wins; how long the others
    wait is the server's doing."""
    storage = open_storage(location)
    key = f"create-race/{uuid.uuid4().hex}"
    start = threading.Barrier(racers)

    def create(k: int) -> float:
        start.wait()
        t0 = time.monotonic()
        storage.put_if_absent(key, f"racer {k}".encode())
        return time.monotonic() - t0

    with ThreadPoolExecutor(racers) as pool:
        return sorted(pool.map(create, range(racers)))


def show(prefix: str, r: dict) -> None:
    pc = r["per_commit"]
    cpu = r["cpu_ms_per_commit"] + r["server_cpu_ms_per_commit"]
    print(f"  {prefix}N={r['writers']:>2}: {r['commits_per_s']:7.1f} commits/s  "
          f"p50 {r['p50_ms']:7.1f} ms  p99 {r['p99_ms']:7.1f} ms  max {r['max_ms']:7.1f} ms  "
          f"p99 after the first round {r['p99_after_first_ms']:7.1f} ms  "
          f"calls/commit {r['calls_per_commit']:6.1f}  lost creates/commit "
          f"{pc.get('version_create_lost', 0):.2f} (the longest answered after "
          f"{r['lost_create_ms_max']:.0f} ms)  cpu/commit {r['cpu_ms_per_commit']:.0f} ms "
          f"+ server {r['server_cpu_ms_per_commit']:.0f} ms (at most {CORES / cpu * 1e3:.0f} "
          f"commits/s on {CORES} cores, mean latency at least {r['writers'] * cpu / CORES:.0f} "
          f"ms)  "
          f"versions {r['version'] - 1} ({r['commits'] / max(1, r['version'] - 1):.1f} commits "
          f"each)", flush=True)  # fmt: skip
    print("      per commit: " + " ".join(f"{k}={v}" for k, v in pc.items()), flush=True)


def summary(results: list[dict], prefix: str) -> str:
    by = {r["writers"]: r for r in results}
    lo, hi = min(by), max(by)
    scaling = (
        f"{prefix}commits_per_s_{lo}={by[lo]['commits_per_s']:.1f} "
        f"{prefix}commits_per_s_{hi}={by[hi]['commits_per_s']:.1f} "
        f"{prefix}scaling={by[hi]['commits_per_s'] / by[lo]['commits_per_s']:.2f} "
        if lo != hi  # one N alone: no ratio to show
        else f"{prefix}commits_per_s_{hi}={by[hi]['commits_per_s']:.1f} "
    )
    return (
        scaling + f"{prefix}p99_ms_{hi}={by[hi]['p99_ms']:.0f} "
        f"{prefix}calls_per_commit_{hi}={by[hi]['calls_per_commit']:.1f}"
    )


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--writers", type=int, nargs="+", default=[1, 4, 16, 64])
    ap.add_argument("--commits", type=int, default=5, help="commits per writer")
    ap.add_argument("--backends", nargs="+", default=["local", "s3"], choices=["local", "s3"])
    ap.add_argument("--dir", default=None, help="scratch folder for the local datasets")
    ap.add_argument("--json", action="store_true", help="print one JSON document")
    ap.add_argument("--create-race", type=int, default=0, metavar="N",
                    help="first, N threads create one object at once on each backend")  # fmt: skip
    args = ap.parse_args(argv)

    # Writers fork from a server process that imported everything once and never touched a
    # storage client (an object-store client's threads do not survive a fork).
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["torch", "pandas", "hsstore", "tools.bench_commits"])
    # That server is a new interpreter, and Python 3.11's takes no sys.path from this one:
    # given none, run from outside the checkout it would measure an installed hsstore.
    previous = os.environ.get("PYTHONPATH")
    os.environ["PYTHONPATH"] = os.pathsep.join(
        [str(Path(__file__).resolve().parents[1]), *filter(None, [previous])]
    )
    try:
        forkserver.ensure_running()
    finally:
        if previous is None:
            del os.environ["PYTHONPATH"]
        else:
            os.environ["PYTHONPATH"] = previous
    work = Path(tempfile.mkdtemp(prefix="bench-commits-", dir=args.dir))
    out: dict[str, Any] = {}
    server = None
    try:
        for backend in ["s3", "local"] if "s3" in args.backends else ["local"]:
            if backend not in args.backends:
                continue
            env: dict[str, str] = {}
            if backend == "s3":
                from tools.seaweed import SeaweedServer

                server = SeaweedServer(work / "seaweedfs")
                server.start()
                env = server.env()
                os.environ.update(env)
            if not args.json:
                print(f"{backend}: {args.commits} commits per writer", flush=True)
            out[backend] = []
            if args.create_race:
                where = "s3://hsstore/race" if backend == "s3" else str(work / "race")
                waits = [x * 1e3 for x in create_race(where, args.create_race)]
                out[f"{backend}_create_race_ms"] = waits
                if not args.json:
                    print(f"  {args.create_race} creates of one object at once answered after "
                          f"(ms): {', '.join(f'{x:.0f}' for x in waits)}", flush=True)  # fmt: skip
            for n in args.writers:
                if backend == "s3":
                    location = f"s3://hsstore/{uuid.uuid4().hex}/ds"
                else:
                    location = str(work / f"ds-{n}")
                r = run(ctx, location, n, args.commits, env,
                        server.proc.pid if server is not None and server.proc else None)  # fmt: skip
                out[backend].append(r)
                if not args.json:
                    show("", r)
                if backend == "local":
                    shutil.rmtree(location, ignore_errors=True)
            if server is not None:
                server.stop()
                server = None
    finally:
        if server is not None:
            server.stop()
        shutil.rmtree(work, ignore_errors=True)
    if args.json:
        print(json.dumps(out, indent=1))
        return
    if "s3" in out:
        print(summary(out["s3"], "s3_"))
    if "local" in out:
        print(summary(out["local"], ""))


if __name__ == "__main__":
    main()
