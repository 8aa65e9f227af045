"""A seeded explorer of the commit protocol: schedules of several writers, gc and readers on
one dataset, with faults at random storage calls (`tests.faults`), pauses longer than a
lease's ttl, and writer processes killed with SIGKILL.

After each schedule, with the faults off, it checks:
1. every sample whose commit returned reads back bit-exact;
2. a commit that raised published nothing of its samples or all of them, and said which
   (`CommitUnknownError` is resolved by committing again, which must then say);
3. the dataset opens;
4. verify passes (nothing referenced is missing or damaged);
5. no thread hung, and every error was one of hsstore's or the injected fault itself.

`run_schedule` runs one in-process schedule; `run_crash_schedule` one with a killed writer
process; `explore` many, returning the tallies a test asserts on and `tools/soak_commits.py`
prints.
"""

from __future__ import annotations

import contextlib
import os
import random
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

import torch

import hsstore
from hsstore import LayerSpec
from hsstore.commits.history import list_versions, read_version
from hsstore.errors import CommitUnknownError, HsstoreError
from hsstore.spec.manifest import Delta
from hsstore.storage.locations import open_storage
from tests.faults import Call, Fault, FaultyStorage, InjectedFault, Plan, Tally, seeded
from tools.synthetic import random_sample

HANG_S = 60.0
# Every CROWD_EVERY-th schedule, CROWD writers commit at once (group commit's schedules).
CROWD_EVERY = 4
CROWD = 6
CREATE_S = 0.02


@dataclass
class Results:
    schedules: int = 0
    commits_published: int = 0
    commits_refused: int = 0
    commits_unknown: int = 0  # raised CommitUnknownError, resolved afterwards
    groups: int = 0  # versions that published other writers' commits beside their own
    grouped: int = 0  # commits published in another writer's group
    gc_runs: int = 0
    reads: int = 0
    kills: int = 0
    damage_schedules: int = 0  # metadata damage schedules (tests.damage_explorer)
    files_damaged: int = 0
    faults: Tally = field(default_factory=Tally)
    # What must stay zero:
    lost: list[str] = field(default_factory=list)
    unopenable: list[str] = field(default_factory=list)
    silent: list[str] = field(default_factory=list)
    damaged: list[str] = field(default_factory=list)
    hangs: list[str] = field(default_factory=list)
    raw: list[str] = field(default_factory=list)
    locked: list[str] = field(default_factory=list)  # open or repair refused (damage schedules)

    @property
    def failures(self) -> int:
        return sum(
            len(x)
            for x in (
                self.lost,
                self.unopenable,
                self.silent,
                self.damaged,
                self.hangs,
                self.raw,
                self.locked,
            )  # fmt: skip
        )

    def summary(self) -> str:
        faults = sum(self.faults.counts.values())
        kinds = " ".join(f"{k}={v}" for k, v in self.faults.counts.items())
        return (
            f"schedules={self.schedules} faults={faults} {kinds} kills={self.kills} "
            f"published={self.commits_published} refused={self.commits_refused} "
            f"unknown_resolved={self.commits_unknown} groups={self.groups} "
            f"grouped={self.grouped} gc_runs={self.gc_runs} reads={self.reads} "
            f"lost={len(self.lost)} unopenable={len(self.unopenable)} silent={len(self.silent)} "
            f"damaged={len(self.damaged)} hangs={len(self.hangs)} raw={len(self.raw)}"
            + (
                f" damage_schedules={self.damage_schedules} files_damaged={self.files_damaged} "
                f"locked={len(self.locked)}"
                if self.damage_schedules or self.locked
                else ""
            )
        )


def make_dataset(location: str) -> None:
    hsstore.create(location, layers=[LayerSpec(1), LayerSpec(4)], hidden_size=16,
                   dtype=torch.bfloat16, chunk_bytes=1024, shard_bytes=4096)  # fmt: skip


def sample(name: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The sample a name stands for (so any process can write or check it)."""
    return random_sample(3 + len(name) % 4, 2, 16, seed=sum(map(ord, name)) * 7 + len(name))


def _slow_creates(plan: Plan) -> Plan:
    """``plan``, with each create of a version taking CREATE_S more (an object store's round
    trip; not a fault, so not tallied): writers that commit at once then overlap in their
    creates, as on a remote store, rather than take turns on a fast local disk."""

    def slow(call: Call) -> Fault | None:
        if call.verb == "put_if_absent" and call.key.startswith("manifests/v"):
            time.sleep(CREATE_S)
        return plan(call)

    return slow


def _acceptable(exc: BaseException) -> bool:
    """An error a user may see: one of hsstore's, or the injected storage failure itself."""
    return isinstance(exc, (HsstoreError, InjectedFault))


class _Schedule:
    def __init__(self, location: str, seed: int, results: Results, rate: float):
        self.location = location
        self.rng = random.Random(seed)
        self.seed = seed
        self.results = results
        self.rate = rate
        self.storages: list[FaultyStorage] = []
        self.lock = threading.Lock()
        self.published: set[str] = set()
        self.refused: set[str] = set()
        self.unknown: list[tuple[object, list[str]]] = []
        self.hung = False
        # Crowded schedules: every writer commits at once, round after round, so creates lose
        # their races and commits go in groups (broken for all when a writer leaves early).
        self.start_line: threading.Barrier | None = None

    def storage(self) -> FaultyStorage:
        with self.lock:
            plan = seeded(random.Random(self.rng.random()), self.rate, pause_s=0.04)
            if self.start_line is not None:
                plan = _slow_creates(plan)
            s = FaultyStorage(open_storage(self.location), plan, tally=self.results.faults)
            self.storages.append(s)
            return s

    def note_raw(self, where: str, exc: BaseException) -> None:
        with self.lock:
            self.results.raw.append(f"seed {self.seed} {where}: {type(exc).__name__}: {exc}")

    def writer(self, i: int, commits: int, ttl: float) -> None:
        w = None
        for _ in range(5):
            try:
                w = hsstore.open(self.storage()).writer(lease_ttl_s=ttl, encode_threads=1)
                break
            except BaseException as exc:  # noqa: BLE001 - classified
                if not _acceptable(exc):
                    return self.note_raw(f"writer {i} open", exc)
        if w is None:
            if self.start_line is not None:
                self.start_line.abort()
            return None
        try:
            for c in range(commits):
                names = [f"w{self.seed}x{i}c{c}s{k}" for k in range(1 + (c + i) % 2)]
                try:
                    for name in names:
                        w.add(name, *sample(name))
                    self._line_up(w)
                    w.commit()
                except CommitUnknownError:
                    with self.lock:
                        self.unknown.append((w, names))
                    return None  # this writer resolves after the schedule
                except BaseException as exc:  # noqa: BLE001 - classified
                    if not _acceptable(exc):
                        self.note_raw(f"writer {i} commit", exc)
                    with self.lock:
                        self.refused.update(names)
                        self.results.commits_refused += 1
                    try:
                        w.abort()
                    except BaseException as exc2:  # noqa: BLE001 - classified
                        if not _acceptable(exc2):
                            self.note_raw(f"writer {i} abort", exc2)
                    continue
                with self.lock:
                    self.published.update(names)
                    self.results.commits_published += 1
        finally:
            if self.start_line is not None:
                self.start_line.abort()  # the others go on without this writer
            if not any(u[0] is w for u in self.unknown):
                w.close()
        return None

    def _line_up(self, w: hsstore.Writer) -> None:
        if self.start_line is not None:
            w.flush()  # the segment written first, so the commits race only for the version
            with contextlib.suppress(threading.BrokenBarrierError):
                self.start_line.wait(HANG_S / 4)

    def gc(self, runs: int) -> None:
        for _ in range(runs):
            grace = self.rng.choice([0.0, 0.05, 60.0])
            try:
                hsstore.gc(self.storage(), grace_s=grace)
            except BaseException as exc:  # noqa: BLE001 - classified
                if not _acceptable(exc):
                    self.note_raw("gc", exc)
            with self.lock:
                self.results.gc_runs += 1

    def reader(self) -> None:
        for _ in range(2):
            time.sleep(0.02)
            self._read_all()

    def _read_all(self) -> None:
        try:
            ds = hsstore.open(self.storage())
            for name in ds.sample_ids:
                s = ds.get(name)
                _, _, hidden = sample(name)
                if not torch.equal(s.hidden, hidden):
                    with self.lock:
                        self.results.lost.append(f"seed {self.seed}: {name} read wrong bytes")
                with self.lock:
                    self.results.reads += 1
        except hsstore.IntegrityError as exc:
            # A committed file missing or damaged while a version references it: a loss.
            with self.lock:
                self.results.lost.append(f"seed {self.seed} reader: {exc}")
        except BaseException as exc:  # noqa: BLE001 - classified
            if not _acceptable(exc):
                self.note_raw("reader", exc)

    def resolve_unknown(self) -> None:
        for s in self.storages:
            s.plan = None  # the outage is over
        for w, names in self.unknown:
            try:
                w.commit()  # must now say: published
                self.published.update(names)
                self.results.commits_unknown += 1
            except BaseException as exc:  # noqa: BLE001 - classified
                if not _acceptable(exc):
                    self.note_raw("resolve", exc)
                self.refused.update(names)
            finally:
                w.close()


def check(location: str, seed: int, published: set[str], refused: set[str], r: Results) -> None:
    """The five checks, on the real storage with no faults."""
    try:
        ds = hsstore.open(location)
    except BaseException as exc:  # noqa: BLE001 - counted
        r.unopenable.append(f"seed {seed}: {exc}")
        return
    report = hsstore.verify(location)
    if not report.ok:
        r.damaged.append(f"seed {seed}: {report.problems[:3]}")
    _count_groups(ds, r)
    have = set(ds.sample_ids)
    for name in sorted(published - have):
        r.lost.append(f"seed {seed}: {name} was reported committed")
    for name in sorted(refused & have):
        r.silent.append(f"seed {seed}: {name} was reported not committed")
    for name in sorted(published & have):
        ids, _, hidden = sample(name)
        try:
            s = ds.get(name)
        except HsstoreError as exc:
            r.lost.append(f"seed {seed}: {name}: {exc}")
            continue
        if not (torch.equal(s.hidden, hidden) and torch.equal(s.input_ids.long(), ids)):
            r.lost.append(f"seed {seed}: {name} reads back different bytes")


def _count_groups(ds: hsstore.Dataset, r: Results) -> None:
    """Tally the versions that published a group and the commits they carried for others."""
    for version in list_versions(ds.storage):
        doc = read_version(ds.storage, version)
        if isinstance(doc, Delta) and doc.group:
            r.groups += 1
            r.grouped += len(doc.group)


def run_schedule(location: str, seed: int, results: Results, *, rate: float = 0.04) -> None:
    """One schedule: 2-3 writers (a crowd of CROWD every CROWD_EVERY-th, committing at once),
    gc and a reader on threads, faults at ``rate`` of calls."""
    make_dataset(location)
    sch = _Schedule(location, seed, results, rate)
    # Every third schedule gives writers almost no time to learn an unknown outcome, so
    # CommitUnknownError and its resolution by a second commit() are explored too.
    resolve_s = os.environ.get("HSSTORE_RESOLVE_TIMEOUT")
    if seed % 3 == 0:
        os.environ["HSSTORE_RESOLVE_TIMEOUT"] = "0.01"
    try:
        _run_threads(sch, seed, results)
    finally:
        if resolve_s is None:
            os.environ.pop("HSSTORE_RESOLVE_TIMEOUT", None)
        else:
            os.environ["HSSTORE_RESOLVE_TIMEOUT"] = resolve_s
    if sch.hung:
        return
    sch.resolve_unknown()
    hsstore.gc(location, grace_s=60)  # a clean gc afterwards must not change what is there
    check(location, seed, sch.published, sch.refused, results)
    results.schedules += 1


def _run_threads(sch: _Schedule, seed: int, results: Results) -> None:
    rng = sch.rng
    jobs: list[Callable[[], None]] = []
    if seed % CROWD_EVERY == 1:
        sch.start_line = threading.Barrier(CROWD)
        for i in range(CROWD):
            ttl = rng.choice([0.2, 5.0])
            jobs.append(lambda i=i, ttl=ttl: sch.writer(i, 2, ttl))
    else:
        for i in range(rng.choice([2, 2, 3])):
            ttl = rng.choice([0.03, 0.2, 5.0])
            jobs.append(lambda i=i, ttl=ttl: sch.writer(i, rng.choice([1, 2]), ttl))
    jobs.append(lambda: sch.gc(rng.choice([1, 2])))
    jobs.append(sch.reader)
    threads = [threading.Thread(target=job, daemon=True) for job in jobs]
    for t in threads:
        t.start()
    deadline = time.monotonic() + HANG_S
    for t in threads:
        t.join(max(0.0, deadline - time.monotonic()))
    if any(t.is_alive() for t in threads):
        results.hangs.append(f"seed {seed}: a thread did not finish in {HANG_S:g}s")
        sch.hung = True


_CHILD = r"""
import sys
import hsstore
from tests.explorer import sample
location, prefix, ttl = sys.argv[1], sys.argv[2], float(sys.argv[3])
w = hsstore.open(location).writer(lease_ttl_s=ttl, encode_threads=1)
for c in range(1000):
    names = [f"{prefix}c{c}s{k}" for k in range(1 + c % 2)]
    print("try", *names, flush=True)
    for name in names:
        w.add(name, *sample(name))
    w.commit()
    print("ok", *names, flush=True)
"""


def run_crash_schedule(location: str, seed: int, results: Results) -> None:
    """A writer process killed with SIGKILL at a random moment while another writer and gc
    run here; the commits it printed as returned must all be there."""
    rng = random.Random(seed)
    make_dataset(location)
    env = dict(os.environ)
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env["PYTHONPATH"] = root + os.pathsep + env.get("PYTHONPATH", "")
    ttl = rng.choice([0.2, 1.0])
    child = subprocess.Popen(
        [sys.executable, "-c", _CHILD, location, f"k{seed}x", str(ttl)],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        env=env,
        text=True,
    )
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.extend(child.stdout), daemon=True)
    reader.start()
    sch = _Schedule(location, seed, results, rate=0.02)
    # Let it start committing, then kill it at a random moment of its commits.
    start = time.monotonic()
    while not any(line.startswith("ok") for line in lines) and time.monotonic() - start < 30:
        time.sleep(0.02)
    here = threading.Thread(target=lambda: sch.writer(0, 2, 0.3), daemon=True)
    here.start()
    time.sleep(rng.uniform(0.0, 0.6))
    child.send_signal(signal.SIGKILL)
    child.wait(10)
    reader.join(10)
    results.kills += 1
    here.join(HANG_S)
    if here.is_alive():
        results.hangs.append(f"crash seed {seed}: the surviving writer hung")
        return
    time.sleep(ttl * 1.5)
    sch.gc(2)  # the dead writer's debris goes; nothing it committed does
    sch.resolve_unknown()
    published = set(sch.published)
    for line in lines:
        if line.startswith("ok "):
            published.update(line.split()[1:])
    check(location, seed, published, sch.refused, results)
    results.schedules += 1


def explore(
    locations: Iterable[str], seeds: Iterable[int], *, rate: float = 0.04, crash_every: int = 0
) -> Results:
    """Run a schedule per seed, each on its own dataset from ``locations``; every
    ``crash_every``-th one (0: none) with a killed writer process."""
    results = Results()
    for location, seed in zip(locations, seeds, strict=False):
        if crash_every and seed % crash_every == crash_every - 1:
            run_crash_schedule(location, seed, results)
        else:
            run_schedule(location, seed, results, rate=rate)
        if "://" not in location:
            shutil.rmtree(location, ignore_errors=True)  # checked: thousands fit in tmpfs
    return results
