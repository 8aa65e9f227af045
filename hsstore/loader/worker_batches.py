"""The Loader's DataLoader-worker path and the tags that place each batch in the plan.

With ``workers > 0`` the rank's plan runs in DataLoader worker processes
(``RawBatchStream``); the Loader copies their batches into a ring of buffers it owns
(``WorkerBatches``) and, in a following first pass, tags each with the step the same schedule
gives in this process (``FollowTagged``).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any, NamedTuple

import numpy as np
from torch.utils.data import DataLoader, get_worker_info

from hsstore.errors import IntegrityError
from hsstore.loader.collate import HostBuffers, RawBatch
from hsstore.loader.fetch import BatchFetcher
from hsstore.loader.follow import WAIT, FirstPass, rank_len
from hsstore.loader.stream import HiddenStateStream, RankPlan

if TYPE_CHECKING:
    from hsstore.loader.train_loader import Loader


class Tag(NamedTuple):
    """Where a decoded batch sits in the plan: step ``step`` of ``epoch_len`` (None while a
    following first pass grows) in ``epoch``; global batch ``batch``, ``repeat`` if it pads
    the last round."""

    epoch: int
    step: int
    epoch_len: int | None
    batch: int = -1
    repeat: bool = False


def first_pass_tag(spec: RankPlan, first_pass: FirstPass, start: int, item: Any) -> Tag:
    """The tag of ``(step, global batch, repeat)`` of the first pass (``follow.rank_steps``)."""
    i, g, repeat = item
    total = first_pass.total
    n = None
    if total is not None:
        n = rank_len(total, spec.rank, spec.world_size, spec.config.tail, start)
    return Tag(0, i, n, g, repeat)


class RawBatchStream(HiddenStateStream):
    """The Loader's plan for its DataLoader workers: each sends its batches as decoded
    (``RawBatch``), and the Loader makes the trainer's keys once, in the main process.

    In a following first pass, worker w of n decodes the rank's steps ``step + w``,
    ``step + w + n``, ... as their windows are cut, reading the new versions itself: the
    windows are a function of the version history, so every worker plans the same pass.
    """

    stop: Any = None  # a multiprocessing Event, set when the Loader stops following

    def __iter__(self) -> Iterator[RawBatch]:  # type: ignore[override]
        return self._followed() if self.following else self._raw_batches()

    def _followed(self) -> Iterator[RawBatch]:
        info = get_worker_info()
        worker, num_workers = (info.id, info.num_workers) if info is not None else (0, 1)
        first_pass = self.first_pass
        assert first_pass is not None

        def planned() -> Iterator[tuple[np.ndarray, np.ndarray] | object]:
            for item in self._rank_steps(self.stop):
                if item is WAIT:
                    yield WAIT
                elif (item[0] - self.step) % num_workers == worker:  # type: ignore[index]
                    yield first_pass.batch(item[1])  # type: ignore[index]

        fetcher = BatchFetcher(self.source, self.choice, self.shape, planned(),
                               num_threads=self.num_threads, prefetch=self.prefetch,
                               reuse_buffers=self.reuse_buffers,
                               dequantize=self.dequantize, skip=self.skip,
                               decode_path=self.decode_path)  # fmt: skip
        try:
            yield from fetcher
        finally:
            fetcher.close()


class FollowTagged:
    """Worker batches of a following first pass, tagged by the same schedule run in this
    process (which reads each version after a worker has), and checked against it."""

    def __init__(self, batches: WorkerBatches, loader: Loader, tags: deque[Tag]):
        assert loader.first_pass is not None
        self._batches, self._tags, self._pass = batches, tags, loader.first_pass
        self._spec, self._start = loader.rank_plan, loader.start
        self._steps = loader._rank_steps()

    def __iter__(self) -> FollowTagged:
        return self

    def _next_step(self) -> Any:
        return next((item for item in self._steps if item is not WAIT), None)

    def __next__(self) -> RawBatch:
        try:
            raw = next(self._batches)
        except StopIteration:
            if self._next_step() is not None:
                raise RuntimeError("the loader's workers ended the first pass early") from None
            raise
        except IntegrityError:  # tag the batch that failed, for the Loader to look into
            item = self._next_step()
            if item is not None:
                self._tags.append(first_pass_tag(self._spec, self._pass, self._start, item))
            raise
        item = self._next_step()
        if item is None or not np.array_equal(raw.sample_index, self._pass.batch(item[1])[0]):
            raise RuntimeError(f"a loader worker decoded another batch than planned ({item})")
        self._tags.append(first_pass_tag(self._spec, self._pass, self._start, item))
        return raw

    def close(self) -> None:
        self._batches.close()


class WorkerBatches:
    """Host batches decoded by DataLoader worker processes, copied into a reusable ring.

    Batches from workers arrive in fresh shared-memory tensors; copying them into pinned
    buffers we own is what lets the device copy run asynchronously without pinning a fresh
    tensor per batch. Bound for a device, fp8 batches come in their stored form, to be
    dequantized there; else the workers dequantize them.
    """

    def __init__(self, loader: Loader, pin: bool, stop: Any = None):
        stream = RawBatchStream(
            loader.rank_plan,
            num_threads=max(1, loader.num_threads // max(1, loader.workers)),
            prefetch=loader.prefetch,
            reuse_buffers=False,
        )
        stream.epoch, stream.start, stream.step = loader.epoch, loader.start, loader.step
        stream.first_pass, stream.stop = loader.first_pass, stop  # the windows so far
        stream.dequantize = loader.device is None
        stream.skip = loader.damaged.positions
        # Only this object holds the DataLoader's iterator: dropping it (close) is what shuts
        # its worker processes down, the way DataLoader documents for an iterator going away.
        self._dl: Iterator[RawBatch] | None = iter(
            DataLoader(
                stream,
                batch_size=None,
                num_workers=loader.workers,
                prefetch_factor=loader.prefetch,
                persistent_workers=False,
                # The storage says how a process that uses it must start (an object-store
                # client does not survive fork()).
                multiprocessing_context=loader.source.location.worker_start_method,
            )
        )
        self._capacity, self._pin = loader.shape.capacity, pin
        self._ring: list[HostBuffers] = []  # two, made in the form of the first batch
        self._next = 0

    def __iter__(self) -> WorkerBatches:
        return self

    def __next__(self) -> RawBatch:
        if self._dl is None:
            raise StopIteration
        batch = next(self._dl)
        if not self._ring:
            self._ring = [HostBuffers.like(batch, self._capacity, self._pin) for _ in range(2)]
        buf = self._ring[self._next]
        self._next = (self._next + 1) % len(self._ring)
        return buf.hold(batch)

    def close(self) -> None:
        self._dl = None
