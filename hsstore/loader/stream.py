"""Datasets over an hsstore dataset: an iterable stream of batches and a map-style view.

``HiddenStateStream`` is a ``torch.utils.data.IterableDataset`` of collated batches, usable
directly or inside ``DataLoader(stream, batch_size=None, num_workers=N)``. It stores only a
``DatasetSource`` (path + index metadata), so each worker opens the dataset itself.

Position is ``(epoch, start, step)``: the rank's share of the epoch's global batches from
global position ``start`` on (``partition.rank_batches``), of which ``step`` are done. The
global position ``start + step * world_size`` is what a saved state carries over to a run at
another world size (see docs/LOADER.md, "Elastic resume"). Inside a DataLoader worker the
stream's ``state_dict()`` describes that worker's progress (torchdata's
``StatefulDataLoader`` snapshots and restores each worker's dataset copy); in the main process
it describes the whole rank.
"""

from __future__ import annotations

import zlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils.data import Dataset, IterableDataset, Sampler, get_worker_info

from hsstore.errors import LoaderStateError
from hsstore.loader.batching import BatchPlan
from hsstore.loader.collate import RawBatch, as_eagle3
from hsstore.loader.dataset_handle import DatasetSource, LayerChoice
from hsstore.loader.fetch import BatchFetcher, BatchShape
from hsstore.loader.follow import WAIT, FirstPass, FollowConfig, FollowState, rank_len, rank_steps
from hsstore.loader.options import LoaderOptions, shows_options
from hsstore.loader.partition import position_after, rank_batches, worker_steps
from hsstore.loader.plan import PlanConfig, fingerprint, fingerprint_v1, global_plan

STATE_VERSION = 2


def default_rank_world() -> tuple[int, int]:
    """(rank, world_size) of torch.distributed when initialised, else (0, 1)."""
    dist = torch.distributed
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def agreed_start_version(source: DatasetSource, world_size: int) -> int:
    """The version a following loader starts from: the latest one rank 0 sees, broadcast to
    the other ranks when torch.distributed runs this world (they may each see a newer one)."""
    version = source.ds.refresh().manifest.version
    dist = torch.distributed
    distributed = world_size > 1 and dist.is_available() and dist.is_initialized()
    if distributed and dist.get_world_size() == world_size:
        box = [version]
        dist.broadcast_object_list(box, src=0)
        version = int(box[0])
    return version


@dataclass(frozen=True)
class RankPlan:
    """Everything that fixes a rank's batches: the data, the plan settings, which layers a
    batch carries, how batches become tensors, and the rank among ``world_size``."""

    source: DatasetSource
    config: PlanConfig
    choice: LayerChoice
    shape: BatchShape
    rank: int
    world_size: int
    follow: FollowConfig | None = None  # set: follow the dataset as it grows
    follow_from: int | None = None  # the version the first window is, when following
    options: LoaderOptions | None = None  # what this plan was built from, as given

    @classmethod
    def from_options(cls, dataset: Any, options: LoaderOptions) -> RankPlan:
        """The plan of ``options`` over ``dataset`` (a path, a Dataset or a DatasetSource)."""
        source = (
            dataset
            if isinstance(dataset, DatasetSource)
            else DatasetSource(dataset, verify_reads=options.verify_reads)
        )
        rank, world_size = options.rank, options.world_size
        if rank is None or world_size is None:
            d_rank, d_world = default_rank_world()
            rank = d_rank if rank is None else rank
            world_size = d_world if world_size is None else world_size
        aux = None if options.aux_layers is None else list(options.aux_layers)
        choice = LayerChoice.resolve(source.layers, aux, options.verifier)
        config, shape = options.plan_config(), options.batch_shape()
        how = options.follow_config()
        follow_from = options.follow_from
        if how is not None and follow_from is None:
            follow_from = agreed_start_version(source, world_size)
        return cls(source, config, choice, shape, rank, world_size, how, follow_from, options)


class PlannedEpochs:
    """What the stream, the batch sampler and the Loader share: a ``RankPlan`` and the
    position ``(epoch, start, step)`` in its epochs.

    Built from the options of docs/LOADER.md, or from a ``RankPlan`` (another object's, when
    one of them hands its plan on, as the Loader does to its worker processes' stream). When
    following (``follow=True``), epoch 0 is the first pass over the growing dataset
    (``follow.FirstPass``) and later epochs cover the samples of that pass.
    """

    skips_damaged = False  # whether it honours skip_damaged (the Loader does)

    @shows_options
    def __init__(self, dataset: Any, options: LoaderOptions | None = None, **overrides: Any):
        if isinstance(dataset, RankPlan):
            if options is not None or overrides:
                given = sorted(overrides) or ["options"]
                raise TypeError(f"options {given} given with a RankPlan that fixes them")
            spec = dataset
        else:
            spec = RankPlan.from_options(dataset, LoaderOptions.of(options, overrides))
            if spec.options is not None and spec.options.skip_damaged and not self.skips_damaged:
                raise TypeError(
                    f"skip_damaged is an option of the Loader, not of {type(self).__name__}"
                )
        self.rank_plan = spec
        self.options = spec.options
        # How the fetchers decode (LoaderOptions.decode_path), resolved by each fetcher.
        self.decode_path = "auto" if spec.options is None else spec.options.decode_path
        self.source, self.config = spec.source, spec.config
        self.choice, self.shape = spec.choice, spec.shape
        self.rank, self.world_size = spec.rank, spec.world_size
        self.epoch = 0
        self.start = 0  # global batches of this epoch done before this rank's step 0
        self.step = 0
        self._plan_cache: tuple[tuple[int, int], BatchPlan] | None = None
        self._global_cache: tuple[int, BatchPlan] | None = None
        self.first_pass: FirstPass | None = None
        data = self.source.data_fingerprint
        if spec.follow is not None:
            assert spec.follow_from is not None
            self.first_pass = FirstPass.start(
                self.source, self.config, spec.follow, spec.follow_from
            )
            data = zlib.crc32(f"{self.source.dataset_id}|{spec.follow.key()}".encode())
        self._data_fingerprint = data
        self.fingerprint = fingerprint(self.config, data)

    @property
    def following(self) -> bool:
        """Whether this is a following loader still in its first pass."""
        return self.first_pass is not None and self.epoch == 0

    def global_plan(self, epoch: int) -> BatchPlan:
        """Every batch of ``epoch`` over all ranks (not of a following loader's first pass)."""
        if self._global_cache is None or self._global_cache[0] != epoch:
            hi = None
            if self.first_pass is not None:
                if epoch == 0:
                    raise TypeError("the first pass of a following loader grows as it goes")
                if not self.first_pass.state.done:
                    raise TypeError("a following loader's later epochs start after its first pass")
                hi = self.first_pass.state.samples
            full = global_plan(
                self.config, self.source.num_tokens, self.source.segments, epoch, hi=hi
            )
            self._global_cache = (epoch, full)
        return self._global_cache[1]

    def plan(self, epoch: int | None = None) -> BatchPlan:
        """This rank's batches for ``epoch`` (default: the current one, from its position)."""
        epoch = self.epoch if epoch is None else epoch
        start = self.start if epoch == self.epoch else 0
        if self._plan_cache is None or self._plan_cache[0] != (epoch, start):
            full = self.global_plan(epoch)
            ids = rank_batches(len(full), self.rank, self.world_size, self.config.tail, start)
            self._plan_cache = ((epoch, start), full.select(ids))
        return self._plan_cache[1]

    def epoch_batches(self, epoch: int) -> int | None:
        """Global batches of ``epoch`` (None while a following first pass is still growing)."""
        if self.first_pass is not None and epoch == 0:
            return self.first_pass.total
        return len(self.global_plan(epoch))

    def __len__(self) -> int:
        """Batches this rank yields in the current epoch (from its start, or the position it
        resumed at)."""
        if self.following:
            assert self.first_pass is not None
            total = self.first_pass.total
            if total is None:
                raise TypeError("the first pass of a following loader has no length yet")
            return rank_len(total, self.rank, self.world_size, self.config.tail, self.start)
        return len(self.plan())

    @property
    def position(self) -> int:
        """Global batches of the current epoch done, over all ranks (ranks in lockstep)."""
        return position_after(
            self.start, self.step, self.world_size, self.epoch_batches(self.epoch)
        )

    def set_epoch(self, epoch: int) -> None:
        """Move to ``epoch`` from its start; a no-op if already there (keeps a resumed step)."""
        if epoch != self.epoch:
            self.epoch, self.start, self.step = int(epoch), 0, 0

    def _check_state(self, state: dict[str, Any]) -> None:
        version = int(state.get("version", STATE_VERSION))
        if version > STATE_VERSION:
            raise LoaderStateError(
                f"loader state version {state['version']} is newer than this hsstore"
            )
        fp = state.get("fingerprint")
        if version < 2:
            want = fingerprint_v1(self.config, self._data_fingerprint, self.world_size)
        else:
            want = self.fingerprint
        if fp is not None and int(fp) != want:
            raise LoaderStateError(
                "loader state was saved for another dataset version or plan settings; it "
                "cannot resume this one",
                path=self.source.path,
            )
        if ("follow" in state) != (self.first_pass is not None) and fp is not None:
            raise LoaderStateError(
                "loader state was saved by a following loader and this one is not, or the "
                "other way round",
                path=self.source.path,
            )

    def _restore(self, state: dict[str, Any]) -> None:
        """Move to a saved position: the same (start, step) at the same world size, else the
        same global position with this rank's share of what is left."""
        self._check_state(state)
        if self.first_pass is not None and "follow" in state:
            restored = FirstPass(
                self.source,
                self.config,
                self.first_pass.follow,
                FollowState.from_json(state["follow"]),
            )
            restored.check_against(self.source.path)
            self.first_pass = restored
        epoch, step = int(state["epoch"]), int(state["step"])
        saved_world = int(state.get("world_size", self.world_size))
        start = int(state.get("start", 0))
        position = int(state.get("position", start + step * saved_world))
        if saved_world != self.world_size:
            start, step = position, 0
        self.epoch, self.start, self.step = epoch, start, step
        self._plan_cache = None
        total = self.epoch_batches(epoch)
        if total is not None and position >= total and total > 0:  # the epoch is over
            self.epoch, self.start, self.step = epoch + 1, 0, 0

    def _base_state(self) -> dict[str, Any]:
        state = {
            "version": STATE_VERSION,
            "epoch": self.epoch,
            "step": self.step,
            "start": self.start,
            "world_size": self.world_size,
            "position": self.position,
            "seed": self.config.seed,
            "fingerprint": self.fingerprint,
        }
        if self.first_pass is not None:
            state["follow"] = self.first_pass.state.to_json()
        return state

    def _rank_steps(self, stop: Any = None) -> Iterator[tuple[int, int, bool] | object]:
        """The first pass's schedule for this rank from its position (following only)."""
        assert self.first_pass is not None
        return rank_steps(
            self.first_pass,
            self.rank,
            self.world_size,
            self.config.tail,
            self.start,
            self.step,
            stop,
        )


class HiddenStateStream(PlannedEpochs, IterableDataset):
    """Collated batches of this rank's epoch plan (CPU tensors, fresh per batch by default).

    Options are the ``Loader``'s (see docs/LOADER.md) minus ``device``; ``num_threads`` decode
    threads per process (keep it 1-2 inside DataLoader workers). ``reuse_buffers=True`` makes a
    batch valid only until the next one is requested, and must stay False with workers.
    """

    dequantize = True  # fp8 states leave as values (the Loader's workers may leave them fp8)
    skip: frozenset[int] = frozenset()  # damaged samples the Loader's workers blank

    @shows_options
    def __init__(
        self,
        dataset: Any,
        options: LoaderOptions | None = None,
        *,
        num_threads: int = 2,
        prefetch: int = 2,
        reuse_buffers: bool = False,
        **overrides: Any,
    ):
        super().__init__(dataset, options, **overrides)
        self.num_threads, self.prefetch, self.reuse_buffers = num_threads, prefetch, reuse_buffers
        self._skip = 0  # batches this worker already yielded (restored worker state)
        self._yielded = 0
        self._worker: tuple[int, int] | None = None

    def __iter__(self) -> Iterator[dict[str, torch.Tensor]]:
        raws = self._raw_batches()
        try:
            for raw in raws:
                yield as_eagle3(raw, self.choice)
        finally:
            raws.close()  # now, not at garbage collection: it commits the delivered position

    def _raw_batches(self) -> Iterator[RawBatch]:
        """This process's batches of the plan, as decoded (the Loader's workers send these)."""
        if self.following:
            raise TypeError(
                "HiddenStateStream plans fixed epochs: follow a growing dataset with Loader or "
                "PlannedBatchSampler"
            )
        info = get_worker_info()
        worker, num_workers = (info.id, info.num_workers) if info is not None else (0, 1)
        plan = self.plan()
        steps = worker_steps(len(plan), self.step, worker, num_workers)[self._skip :]
        self._worker = (worker, num_workers) if info is not None else None
        self._yielded = self._skip
        fetcher = BatchFetcher(
            self.source,
            self.choice,
            self.shape,
            (plan.batch(int(j)) for j in steps),
            num_threads=self.num_threads,
            prefetch=self.prefetch,
            reuse_buffers=self.reuse_buffers,
            dequantize=self.dequantize,
            skip=self.skip,
            decode_path=self.decode_path,
        )
        try:
            for raw in fetcher:
                self._yielded += 1
                yield raw
        finally:
            fetcher.close()
            if info is None:  # the main process owns the position: commit what was delivered
                self.step += self._yielded
                self._yielded = 0
        if info is None:  # whole epoch delivered: move on to the next one
            self.epoch, self.start, self.step = self.epoch + 1, 0, 0

    def state_dict(self) -> dict[str, Any]:
        """Position to resume from (this worker's, inside a DataLoader worker)."""
        state = self._base_state()
        if self._worker is None:
            state["step"] = self.step + self._yielded
        else:
            state["worker"], state["num_workers"] = self._worker
            state["yielded"] = self._yielded
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._restore(state)
        self._skip = int(state.get("yielded", 0)) if "worker" in state else 0
        self._yielded = 0


class PlannedBatchSampler(PlannedEpochs, Sampler):
    """The epoch plan as lists of storage positions, for a map-style ``HiddenStateDataset``.

    ``DataLoader(HiddenStateDataset(p), batch_sampler=PlannedBatchSampler(p, ...),
    collate_fn=pack_collate(max_tokens))`` yields the same batches as ``HiddenStateStream``
    (the plan already respects the budget, so ``pack_collate`` never cuts a sample).
    """

    def __iter__(self) -> Iterator[list[int]]:
        if self.following:  # as the windows come in (waiting for them here)
            assert self.first_pass is not None
            for item in self._rank_steps():
                if item is not WAIT:
                    _i, g, _repeat = item  # type: ignore[misc]
                    yield self.first_pass.batch(g)[0].tolist()
            return
        plan = self.plan()
        for j in range(self.step, len(plan)):
            yield plan.batch(j)[0].tolist()

    def state_dict(self) -> dict[str, Any]:
        return self._base_state()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._restore(state)


class HiddenStateDataset(Dataset):
    """Map-style: item i is sample i (storage order) in speculators' per-sample format.

    Keys: ``hidden_states`` [T, k*H] (aux layers), ``verifier_last_hidden_states`` [T, H],
    ``input_ids`` [T], ``loss_mask`` [T], ``lengths`` [1], ``position_ids`` [T]; ``max_tokens``
    truncates.
    """

    def __init__(
        self,
        dataset: Any,
        *,
        aux_layers: list[int] | None = None,
        verifier: bool = True,
        max_tokens: int | None = None,
    ):
        self.source = dataset if isinstance(dataset, DatasetSource) else DatasetSource(dataset)
        self.choice = LayerChoice.resolve(self.source.layers, aux_layers, verifier)
        self.max_tokens = max_tokens

    def __len__(self) -> int:
        return len(self.source)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        i = int(i)
        if i >= len(self):  # a followed dataset may have grown since it was opened here
            self.source.ensure(i + 1)
        if not -len(self) <= i < len(self):
            raise IndexError(f"sample {i} out of range for {len(self)} samples")
        i %= len(self)
        src = self.source
        full = int(src.num_tokens[i])
        layers = self.choice.read
        hidden = torch.empty(full, len(layers), src.hidden_size, dtype=src.dtype)
        src.read_hidden_into(i, hidden, layers)
        ids, mask = src.read_tokens(i)
        t = full if self.max_tokens is None else min(full, self.max_tokens)
        hidden = hidden[:t]
        k = len(self.choice.aux)
        out = {
            "hidden_states": hidden[:, :k].reshape(t, k * src.hidden_size),
            "input_ids": ids[:t].to(torch.int64),
            "loss_mask": mask[:t].to(torch.int64),
            "lengths": torch.tensor([t], dtype=torch.int64),
            "position_ids": torch.arange(t, dtype=torch.int64),
        }
        if self.choice.verifier is not None:
            out["verifier_last_hidden_states"] = hidden[:, k]
        return out
