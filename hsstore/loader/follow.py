"""Following a dataset while it grows: the first pass, one committed window at a time.

A following loader starts from the version committed when it starts (``start_version``: the
first window is every sample of it) and reads the versions published after it one by one.
A window is cut at the first version that adds at least ``window`` samples to the last cut,
and a last one when the extraction's run records say it is complete (``hsstore.commits.runs``)
or the first ``until`` samples are in. Versions are immutable and positions only ever get
appended, so this rule gives every rank, and every resumed run, the same windows from the
same history however late it reads it: windows need no coordination, only the start version
(which ranks agree on once, at construction).

Each window's samples are shuffled as an epoch's are (blocks, then windows of positions; a
stream of its own per window) and planned into batches; the first pass is the concatenation
of the windows' batches. It is epoch 0: its global batches are shared out over the ranks like
any epoch's (``rank_steps``), so every sample is seen exactly once in it (up to the tail
policy's last round), and a state saved anywhere in it resumes on any number of ranks. Later
epochs are ordinary epochs over the samples of the first pass.
"""

from __future__ import annotations

import threading
import time
import zlib
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from hsstore.commits import commit
from hsstore.commits.runs import completion
from hsstore.errors import HsstoreError, LoaderStateError, NotADatasetError
from hsstore.loader.batching import WAIT, BatchPlan
from hsstore.loader.dataset_handle import DatasetSource
from hsstore.loader.plan import PlanConfig, global_plan
from hsstore.spec import paths
from hsstore.spec.manifest import Delta, Manifest

__all__ = ["WAIT", "FirstPass", "FollowConfig", "FollowState", "rank_len", "rank_steps"]


FIRST_POLL_S = 0.02  # a wait for a new version first looks again after this long


class FollowTimeoutError(HsstoreError):
    """No new version for ``follow_timeout_s`` while the extraction is not complete."""


@dataclass(frozen=True)
class FollowConfig:
    """How a following loader cuts the first pass into windows and waits for them (built
    from ``LoaderOptions``' follow_* options, which hold the defaults)."""

    window: int  # a window is cut once this many new samples are committed
    until: int | None  # the first pass ends after this many samples (None: at completion)
    poll_s: float  # the longest pause between two looks for a new version while waiting
    timeout_s: float | None  # give up after this long without a new version

    def __post_init__(self) -> None:
        if self.window < 1:
            raise ValueError(f"follow_window must be >= 1, got {self.window}")
        if self.until is not None and self.until < 1:
            raise ValueError(f"follow_until must be >= 1 or None, got {self.until}")
        if self.poll_s <= 0:
            raise ValueError(f"follow_poll_s must be > 0, got {self.poll_s}")

    def key(self) -> str:
        """What a resumed run must share (how to wait is its own business)."""
        return f"follow|{self.window}|{self.until}"


@dataclass
class Window:
    """Samples ``[previous window's end, end)``, cut at ``version``; ``crc`` checks the ids."""

    version: int
    end: int
    crc: int

    def to_json(self) -> list[int]:
        return [self.version, self.end, self.crc]


@dataclass
class FollowState:
    """Which windows the first pass is made of, so far; ``done`` once the last was cut."""

    start_version: int
    windows: list[Window] = field(default_factory=list)
    done: bool = False

    @property
    def samples(self) -> int:
        return self.windows[-1].end if self.windows else 0

    @property
    def scanned_to(self) -> int:
        """The version the rule goes on from (the last cut, or the start)."""
        return self.windows[-1].version if self.windows else self.start_version

    def to_json(self) -> dict[str, Any]:
        return {
            "start_version": self.start_version,
            "windows": [w.to_json() for w in list(self.windows)],
            "done": self.done,
        }

    @classmethod
    def from_json(cls, obj: dict[str, Any]) -> FollowState:
        try:
            windows = [Window(int(v), int(e), int(c)) for v, e, c in obj["windows"]]
            return cls(int(obj["start_version"]), windows, bool(obj["done"]))
        except (KeyError, TypeError, ValueError) as exc:
            raise LoaderStateError(f"loader state has a malformed follow record ({exc})") from None


def ids_crc(sample_ids: list[str], after: int | None = None) -> int:
    """CRC-32 of the sample ids joined by NUL. ``after``: the CRC of the ids before these,
    which the CRC runs on from (a window's CRC from the last one's, without rereading all
    the ids before it: that would cost O(samples) Python work per window)."""
    if after is None:
        return zlib.crc32("\x00".join(sample_ids).encode())
    return zlib.crc32(("\x00" + "\x00".join(sample_ids)).encode(), after)


class FirstPass:
    """The first pass's global batch list, growing one window at a time as versions land.

    One planning thread at a time calls ``wait``; ``state`` may be read from any thread (the
    windows only ever get appended, and a copy of them is always a valid state).
    """

    def __init__(
        self, source: DatasetSource, cfg: PlanConfig, follow: FollowConfig, state: FollowState
    ):
        self.source, self.cfg, self.follow, self.state = source, cfg, follow, state
        self._plans: list[BatchPlan] = []
        self._ends: list[int] = []  # cumulative batch counts of the planned windows
        self._lock = threading.Lock()
        self._scan: Manifest | None = None  # the version the rule has read up to

    def __getstate__(self) -> dict[str, Any]:
        """What a DataLoader worker process gets: the windows decided so far. It plans them,
        and reads the versions after them, itself; the window rule being a function of the
        history, it cuts the same windows as every other process."""
        state = FollowState(self.state.start_version, list(self.state.windows), self.state.done)
        return {"source": self.source, "cfg": self.cfg, "follow": self.follow, "state": state}

    def __setstate__(self, d: dict[str, Any]) -> None:
        self.__init__(d["source"], d["cfg"], d["follow"], d["state"])  # type: ignore[misc]

    @classmethod
    def start(
        cls, source: DatasetSource, cfg: PlanConfig, follow: FollowConfig, version: int
    ) -> FirstPass:
        """A first pass whose first window is version ``version`` (all ranks agree on it)."""
        first = cls(source, cfg, follow, FollowState(version))
        man = commit.load_manifest(source.location, version)
        first._scan = man
        first._consider(man)
        return first

    # --- what the schedule asks --------------------------------------------------------------

    @property
    def total(self) -> int | None:
        """Batches of the whole pass, once its last window is cut."""
        self._plan_known()
        return (
            self._ends[-1] if self.state.done and self._ends else (0 if self.state.done else None)
        )

    def ready(self, g: int) -> bool:
        """Whether ``wait(g)`` would answer without waiting for a new version."""
        self._plan_known()
        return g < self._num_planned() or self.state.done

    def wait(self, g: int, stop: Any = None) -> bool:
        """True once batch ``g`` of the pass exists; False if the pass ended before it (or the
        wait was stopped: ``stop`` is a threading or multiprocessing Event).

        Looks for a new version after ``FIRST_POLL_S``, then after a quarter of the time
        waited so far, up to ``poll_s``: a commit is seen within about a quarter of the time
        already waited for it (the follower is often waiting for the extraction's last commit,
        and everything after that is the run's tail), while a long wait costs a look per
        ``poll_s``.
        """
        waited_since = time.monotonic()
        while True:
            if self.ready(g):
                return g < self._num_planned()
            if stop is not None and stop.is_set():
                return False
            if self._poll():
                waited_since = time.monotonic()
                continue
            waited = time.monotonic() - waited_since
            timeout = self.follow.timeout_s
            if timeout is not None and waited > timeout:
                raise FollowTimeoutError(
                    f"no new version for {timeout:g} s and the extraction has not recorded "
                    f"its completion (following from version {self.state.start_version})",
                    path=self.source.path,
                )
            pause = min(self.follow.poll_s, max(FIRST_POLL_S, waited / 4))
            if stop is not None:
                stop.wait(pause)
            else:
                time.sleep(pause)

    def batch(self, g: int) -> tuple[np.ndarray, np.ndarray]:
        k = int(np.searchsorted(self._ends, g, side="right"))
        before = self._ends[k - 1] if k else 0
        return self._plans[k].batch(g - before)

    # --- growing -----------------------------------------------------------------------------

    def _num_planned(self) -> int:
        return self._ends[-1] if self._ends else 0

    def _plan_known(self) -> None:
        """Plan the windows already decided (a restored state's, or new ones) but not planned."""
        with self._lock:
            windows = list(self.state.windows)
            if len(self._plans) == len(windows):
                return
            if self.source.num_tokens.shape[0] < windows[-1].end:
                self.source.grow(commit.load_manifest(self.source.location, windows[-1].version))
            for k in range(len(self._plans), len(windows)):
                lo = windows[k - 1].end if k else 0
                plan = global_plan(
                    self.cfg,
                    self.source.num_tokens,
                    self.source.segments,
                    0,
                    lo=lo,
                    hi=windows[k].end,
                    part=k,
                )
                self._plans.append(plan)
                self._ends.append(self._num_planned() + len(plan))

    def _poll(self) -> bool:
        """Read the versions published since the last one read; True if a window was cut."""
        with self._lock:
            if self._scan is None:
                self._scan = commit.load_manifest(self.source.location, self.state.scanned_to)
            cut = False
            while not self.state.done:
                try:
                    doc = commit.read_version(self.source.location, self._scan.version + 1)
                except NotADatasetError:  # not published yet
                    break
                where = self.source.location.path_of(paths.manifest_key(doc.version))
                if isinstance(doc, Delta):
                    self._scan = self._scan.apply(doc, where=where)
                else:
                    self._scan = doc
                cut |= self._consider(self._scan)
        if cut:
            self._plan_known()
        return cut

    def _consider(self, man: Manifest) -> bool:
        """Apply the window rule to version ``man``; True if it cut a window."""
        state, follow = self.state, self.follow
        have = man.num_samples if follow.until is None else min(man.num_samples, follow.until)
        last = state.samples
        over = completion(man.provenance).complete or (
            follow.until is not None and man.num_samples >= follow.until
        )
        if have > last and (over or have - last >= follow.window or not state.windows):
            if self.source.num_tokens.shape[0] < have:
                self.source.grow(man)
            ids = self.source.ds.index.column("sample_id").slice(last, have - last).to_pylist()
            crc = ids_crc(ids, state.windows[-1].crc if state.windows else None)
            state.windows.append(Window(man.version, have, crc))
            if over:
                state.done = True
            return True
        if over:
            state.done = True
            return True
        return False

    def check_against(self, where: str) -> None:
        """Refuse a restored state whose windows are not this dataset's history."""
        windows = self.state.windows
        if not windows:
            return
        last = windows[-1]
        try:
            man = commit.load_manifest(self.source.location, last.version)
        except NotADatasetError:
            raise LoaderStateError(
                f"loader state follows version {last.version}, which this dataset lacks",
                path=where,
            ) from None
        if man.num_samples < last.end:
            raise LoaderStateError(
                f"loader state has {last.end} samples at version {last.version}, the dataset "
                f"{man.num_samples}",
                path=where,
            )
        if self.source.num_tokens.shape[0] < last.end:
            self.source.grow(man)
        ids = self.source.ds.index.column("sample_id").slice(0, last.end).to_pylist()
        if ids_crc(ids) != last.crc:
            raise LoaderStateError(
                "loader state was saved while following another dataset (its sample ids differ)",
                path=where,
            )


def rank_steps(
    batches: FirstPass,
    rank: int,
    world_size: int,
    tail: str,
    start: int,
    step: int,
    stop: Any = None,
) -> Iterator[tuple[int, int, bool] | object]:
    """``(step, global batch, repeat)`` of rank ``rank`` from position ``start`` and its own
    ``step`` on, as the batches come into existence; ``WAIT`` before it would block.

    The same rule as ``partition.rank_batches`` (batch ``start + rank + i * world_size`` at
    step i; the tail policy decides the last round), decided one round at a time because the
    number of batches is not known until the pass ends. ``repeat``: a padding batch of the
    last round (a batch from the start of the pass, under ``tail="pad"``).
    """
    i = step
    while True:
        first = start + i * world_size
        g = first + rank
        probe = {"drop": first + world_size - 1, "uneven": g, "pad": first}[tail]
        if not batches.ready(probe):
            yield WAIT
        if not batches.wait(probe, stop):
            return
        repeat = False
        if tail == "pad":
            if not batches.ready(g):
                yield WAIT
            if not batches.wait(g, stop):
                if stop is not None and stop.is_set():
                    return
                total = batches.total
                assert total, "a pass that ended has a batch count"
                g, repeat = g % total, True
        yield i, g, repeat
        i += 1


def rank_len(total: int, rank: int, world_size: int, tail: str, start: int) -> int:
    """Steps of rank ``rank`` from position ``start`` in a pass of ``total`` batches."""
    from hsstore.loader.partition import rank_batches

    return len(rank_batches(total, rank, world_size, tail, start))
