"""``Loader``: the one object a training loop needs (plan, decode threads, GPU prefetch, state).

It composes the pieces: the rank's epoch plan (``plan.rank_plan``), decoding into a ring of
reusable (pinned, with CUDA) host buffers by a thread pool (``fetch.BatchFetcher``) or by
DataLoader worker processes, and the side-stream copy to the device
(``prefetch.DevicePrefetcher``).

The decode pipeline is not tied to one epoch. Epoch e+1's plan is a pure function of
``(seed, epoch, rank, world_size)``, so the pipeline plans it itself and rolls straight on
into it: a training loop never waits for a cold start at an epoch boundary, which on a small
dataset (a few batches per epoch) would be most of its data wait. The Loader keeps the
pipeline between iterations for as long as its position is the one the pipeline continues
from. Every batch comes out tagged with the (epoch, step) it was planned at, and the Loader
counts only the batches it has handed to the caller, so ``state_dict()`` is exact whatever
was prefetched.
"""

from __future__ import annotations

import multiprocessing
import threading
from collections import deque
from collections.abc import Iterator
from typing import Any

import numpy as np
import torch

from hsstore.errors import BadInputError, IntegrityError
from hsstore.loader.collate import HostBuffers, RawBatch, as_eagle3
from hsstore.loader.damaged import DamagedSamples, refuse_left_out, stopped_by
from hsstore.loader.fetch import BatchFetcher
from hsstore.loader.follow import WAIT, FirstPass, rank_steps
from hsstore.loader.options import LoaderOptions, shows_options
from hsstore.loader.partition import rank_batches
from hsstore.loader.plan import global_plan
from hsstore.loader.prefetch import DevicePrefetcher, resolve_device
from hsstore.loader.stream import PlannedEpochs, RankPlan
from hsstore.loader.worker_batches import FollowTagged, Tag, WorkerBatches, first_pass_tag
from hsstore.tuning import tune_process


def _planned_from(
    spec: RankPlan,
    first_pass: FirstPass | None,
    epoch: int,
    start: int,
    step: int,
    tags: deque[Tag],
    stop: threading.Event,
) -> Iterator[tuple[np.ndarray, np.ndarray] | object]:
    """The rank's planned batches from ``(epoch, start, step)`` on, epoch after epoch.

    Runs on the fetcher's planning thread, so it takes plain values and never the Loader
    (a thread holding the Loader would keep it from being collected and closed). Each batch's
    tag is queued before the batch enters the fetcher, which keeps plan order, so the consumer
    pops exactly one tag per batch. A following first pass yields ``follow.WAIT`` before it
    waits for the dataset to grow. Stops before the first whole epoch that has no batches for
    this rank: planning on would spin through empty epochs forever.
    """
    cfg, rank, world = spec.config, spec.rank, spec.world_size
    while True:
        if first_pass is not None and epoch == 0:
            for item in rank_steps(first_pass, rank, world, cfg.tail, start, step, stop):
                if item is WAIT:
                    yield WAIT
                    continue
                tags.append(first_pass_tag(spec, first_pass, start, item))
                yield first_pass.batch(tags[-1].batch)
            if stop.is_set():
                return
        else:
            hi = first_pass.state.samples if first_pass is not None else None
            src = spec.source
            full = global_plan(cfg, src.num_tokens, src.segments, epoch, hi=hi)
            ids = rank_batches(len(full), rank, world, cfg.tail, start)
            if len(ids) == 0 and start == 0:
                return
            for j in range(step, len(ids)):
                repeat = start + rank + j * world >= len(full)
                tags.append(Tag(epoch, j, len(ids), int(ids[j]), repeat))
                yield full.batch(int(ids[j]))
        epoch, start, step = epoch + 1, 0, 0


class _Pipeline:
    """Decoded batches from one plan position on, each with its ``Tag``.

    ``peek`` decodes the next batch without delivering it: the Loader looks at its epoch to
    tell whether the current epoch is over, and leaves it for the next one. ``last_epoch`` is
    the last epoch this pipeline covers (None: it runs on until an empty epoch).
    """

    def __init__(
        self,
        batches: Any,
        tags: deque[Tag],
        last_epoch: int | None,
        stop: Any = None,
    ):
        self._batches, self._tags, self.last_epoch = batches, tags, last_epoch
        self._pending: tuple[Tag, RawBatch] | None = None
        self.finished = False
        self._stop = stop  # ends a planner waiting for a followed dataset to grow

    def covers(self, epoch: int) -> bool:
        return not self.finished and (self.last_epoch is None or epoch <= self.last_epoch)

    def peek(self) -> Tag | None:
        """The next batch's tag (decoding it if needed), or None when the pipeline has ended."""
        if self._pending is None and not self.finished:
            try:
                raw = next(self._batches)
            except StopIteration:
                self.finished = True
                return None
            self._pending = (self._tags.popleft(), raw)
        return None if self._pending is None else self._pending[0]

    def failed_batch(self) -> Tag | None:
        """The tag of the batch whose decoding raised (the next one not delivered), if known."""
        return self._tags[0] if self._tags else None

    def take(self) -> RawBatch:
        """Deliver the peeked batch."""
        assert self._pending is not None, "take() without a successful peek()"
        raw = self._pending[1]
        self._pending = None
        return raw

    def close(self) -> None:
        self.finished = True
        self._pending = None
        if self._stop is not None:
            self._stop.set()
        self._batches.close()


class Loader(PlannedEpochs):
    """Batches of an hsstore dataset for this rank, on ``device`` (or the CPU).

    See docs/LOADER.md for the options and the batch keys. ``for batch in loader`` runs the
    rest of the current epoch; ``loader.iter_epochs(n)`` runs on through epoch ``n - 1``
    (forever with None). Either way decoding continues across epoch boundaries. On the CPU a
    yielded batch is valid until the next one is requested (its buffers are reused); on a GPU
    every batch is a fresh device allocation and stays valid. ``close()`` stops the decode
    threads now rather than when the Loader is garbage collected.
    """

    skips_damaged = True

    @shows_options
    def __init__(
        self,
        dataset: Any,
        options: LoaderOptions | None = None,
        *,
        device: str | torch.device | None = None,
        num_threads: int = 4,
        prefetch: int = 2,
        workers: int = 0,
        **overrides: Any,
    ):
        super().__init__(dataset, options, **overrides)
        tune_process()  # a training process reads as hsstore's own programs do (hsstore.tuning)
        if num_threads < 1 or prefetch < 1 or workers < 0:
            raise ValueError("need num_threads >= 1, prefetch >= 1 and workers >= 0")
        self.device = resolve_device(device)
        self.num_threads, self.prefetch, self.workers = num_threads, prefetch, workers
        self._ring: list[HostBuffers] | None = None  # allocated on first use, kept for good
        self._pipe: _Pipeline | None = None
        self._pipe_pos: tuple[int, int, int] | None = None  # the position _pipe continues from
        self._epoch_len: tuple[int, int] | None = None  # (epoch, batches), once seen in a tag
        self._owner: object | None = None  # the iterator currently delivering batches
        # (epoch, global batch, repeat) of the batch delivered last: which of the epoch's
        # batches it was, and whether it only pads the last round (see tail="pad").
        self.last_batch: tuple[int, int, bool] | None = None
        self.damaged = DamagedSamples()  # found so far (skip_damaged: blanked in batches)
        # Committed samples the dataset's view leaves out (segments whose index cannot be
        # read): refused unless skip_damaged, which trains on the rest (docs/LOADER.md).
        skip = self.options is not None and self.options.skip_damaged
        self.left_out = refuse_left_out(self.source, skip)

    # --- position ------------------------------------------------------------------------

    @property
    def skipped(self) -> list[str]:
        """The ids of the damaged samples this loader has blanked so far (``skip_damaged``),
        those of the run it resumed included, in the order found."""
        return list(self.damaged.ids)

    def state_dict(self) -> dict[str, Any]:
        """``{"version", "epoch", "step", "start", "world_size", "position", "seed",
        "fingerprint", "skipped"}`` (and ``"follow"`` when following): batches delivered so
        far, and the damaged samples found (ids)."""
        return {**self._base_state(), "skipped": self.skipped}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue with exactly the batches the saving run had not delivered yet, at this
        loader's world size (docs/LOADER.md, "Elastic resume")."""
        self._restore(state)
        self.damaged.restore(self.source, state.get("skipped", ()))
        self._epoch_len = None
        if self.first_pass is not None:
            self.close()  # the restored windows replace the pass the pipeline was planning
        self._release_if_moved()

    def set_epoch(self, epoch: int) -> None:
        """Move to ``epoch`` from its start; a no-op if already there (keeps a resumed step,
        and the batches already decoded for it)."""
        super().set_epoch(epoch)
        self._release_if_moved()

    def close(self) -> None:
        """Stop decoding and release the threads (idempotent; iterating again restarts)."""
        if self._pipe is not None:
            pipe, self._pipe, self._pipe_pos = self._pipe, None, None
            pipe.close()

    def __del__(self) -> None:
        # Not contextlib.suppress: at interpreter exit this module's globals may already be
        # None when the last reference goes, and a failing __del__ prints a traceback.
        try:  # noqa: SIM105
            self.close()
        except Exception:
            pass

    def _release_if_moved(self) -> None:
        """Batches decoded for another position are of no use: stop decoding them now."""
        if self._pipe is not None and self._pipe_pos != self._pos():
            self.close()

    def _pos(self) -> tuple[int, int, int]:
        return self.epoch, self.start, self.step

    # --- iteration -----------------------------------------------------------------------

    def __iter__(self) -> Iterator[dict[str, torch.Tensor]]:
        """The rest of the current epoch; when it has all been delivered, the Loader moves
        to the next epoch (whose first batches are already being decoded)."""
        yield from self._deliver(self.epoch + 1)

    def iter_epochs(self, num_epochs: int | None = None) -> Iterator[dict[str, torch.Tensor]]:
        """Batches from the current position through the end of epoch ``num_epochs - 1``.

        The same batches as ``for e in range(loader.epoch, num_epochs): loader.set_epoch(e);
        yield from loader``; ``num_epochs=None`` runs forever (a trainer that counts steps).
        ``loader.epoch`` is the epoch of the batch last delivered; ``state_dict()`` resumes
        exactly at any point, epoch boundaries included. Unbounded, an epoch with no batches
        for this rank raises ``BadInputError`` instead of looping without yielding.
        """
        yield from self._deliver(num_epochs)

    def _deliver(self, num_epochs: int | None) -> Iterator[dict[str, torch.Tensor]]:
        # The most recently started iterator owns the loader; an older one, resumed later,
        # stops instead of stealing batches (and moving the position) behind its back.
        token = self._owner = object()
        while num_epochs is None or self.epoch < num_epochs:
            epoch, from_start, delivered = self.epoch, self._pos()[1:] == (0, 0), 0
            while not self._epoch_done():
                pipe = self._pipeline()
                try:
                    tag = pipe.peek()
                except IntegrityError as exc:
                    self.close()  # the fetcher is dead after an error; the next call restarts
                    if self._skips(exc, pipe.failed_batch()):
                        continue  # the same position again, without the damaged samples
                    raise stopped_by(exc, self.source.path) from exc
                except BaseException:
                    self.close()
                    raise
                if tag is None or tag.epoch != epoch:  # nothing (more) in this epoch
                    break
                assert tag.step == self.step, (tag, self.step)
                raw = pipe.take()
                self.step = tag.step + 1
                self._pipe_pos = self._pos()
                if tag.epoch_len is not None:
                    self._epoch_len = (epoch, tag.epoch_len)
                self.last_batch = (epoch, tag.batch, tag.repeat)
                delivered += 1
                yield as_eagle3(raw, self.choice)
                if self._owner is not token:
                    return
            in_sync = self._pipe_pos == self._pos()
            self.epoch, self.start, self.step = epoch + 1, 0, 0
            if in_sync:  # the pipeline runs on into this epoch: keep it
                self._pipe_pos = self._pos()
            if num_epochs is None and delivered == 0 and from_start:
                raise BadInputError(
                    f"rank {self.rank} of {self.world_size} has no batches in epoch {epoch} "
                    "(empty dataset, or tail='drop' with fewer batches than ranks)",
                    path=self.source.path,
                )

    def _skips(self, error: IntegrityError, failed: Tag | None) -> bool:
        """With ``skip_damaged``: whether the samples of the failed batch (else the one the
        error names) include damaged ones not yet skipped, now added to those skipped."""
        if self.options is None or not self.options.skip_damaged:
            return False
        candidates: list[int] = []
        if failed is not None:
            batches = (self.first_pass if failed.epoch == 0 and self.first_pass is not None
                       else self.global_plan(failed.epoch))  # fmt: skip
            candidates += batches.batch(failed.batch)[0].tolist()
        if error.sample_id is not None:
            candidates.append(self.source.ds.position(error.sample_id))
        return bool(self.damaged.find(self.source, self.choice.read, candidates))

    def _epoch_done(self) -> bool:
        """Whether the current epoch was delivered to its end (known from the last tag)."""
        known = self._epoch_len
        return known is not None and known[0] == self.epoch and self.step >= known[1]

    def _pipeline(self) -> _Pipeline:
        """The live pipeline if it continues from the current position, else a fresh one."""
        pipe = self._pipe
        if pipe is not None and (self._pipe_pos != self._pos() or not pipe.covers(self.epoch)):
            self.close()
            pipe = None
        if pipe is None:
            pipe = self._pipe = self._start_pipeline()
            self._pipe_pos = self._pos()
        return pipe

    def _start_pipeline(self) -> _Pipeline:
        pin = self.device is not None and self.device.type == "cuda"  # page-locked: async H2D
        tags: deque[Tag] = deque()
        host: Any
        if self.workers == 0:
            if self._ring is None:
                self._ring = BatchFetcher.make_ring(
                    self.source, self.choice, self.shape, self.prefetch, pin, self.device is None
                )
            stop = threading.Event()
            planned = _planned_from(
                self.rank_plan,
                self.first_pass,
                self.epoch,
                self.start,
                self.step,
                tags,
                stop,
            )
            host = BatchFetcher(
                self.source,
                self.choice,
                self.shape,
                planned,
                num_threads=self.num_threads,
                prefetch=self.prefetch,
                reuse_buffers=True,
                pin_memory=pin,
                ring=self._ring,
                dequantize=self.device is None,
                skip=self.damaged.positions,
                decode_path=self.decode_path,
            )
            last_epoch = None
        elif self.following:
            # The workers read the new versions themselves; the stop event ends their waits.
            stop = multiprocessing.get_context("spawn").Event()
            host = FollowTagged(WorkerBatches(self, pin, stop), self, tags)
            last_epoch = 0
        else:
            # Worker processes iterate one epoch each (DataLoader's round robin over workers
            # is per epoch): the pipeline covers the current epoch only.
            stop = None
            full, n = self.global_plan(self.epoch), len(self.plan())
            ids = rank_batches(len(full), self.rank, self.world_size, self.config.tail, self.start)
            tags.extend(
                Tag(self.epoch, j, n, int(ids[j]), self.start + self.rank + j * self.world_size
                     >= len(full))
                for j in range(self.step, n)
            )  # fmt: skip
            host = WorkerBatches(self, pin)
            last_epoch = self.epoch
        batches = host if self.device is None else DevicePrefetcher(host, self.device)
        return _Pipeline(batches, tags, last_epoch, stop)
