"""Datasets over an hsstore dataset: an iterable stream of batches and a map-style view.

``HiddenStateStream`` is a ``torch.utils.data.IterableDataset`` of collated batches, usable
directly or inside ``DataLoader(stream, batch_size=None, num_workers=N)``. It stores only a
``DatasetSource`` (path + index metadata), so each worker opens the dataset itself.

Position is ``(epoch, step)``: ``step`` batches of this rank's epoch plan are done. Inside a
DataLoader worker the stream's ``state_dict()`` describes that worker's progress (torchdata's
``StatefulDataLoader`` snapshots and restores each worker's dataset copy); in the main process
it describes the whole rank.
"""

from __future__ import annotations

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
from hsstore.loader.partition import worker_steps
from hsstore.loader.plan import PlanConfig, fingerprint, rank_plan

STATE_VERSION = 1


def default_rank_world() -> tuple[int, int]:
    """(rank, world_size) of torch.distributed when initialised, else (0, 1)."""
    dist = torch.distributed
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


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

    @classmethod
    def from_options(
        cls,
        dataset: Any,
        *,
        max_tokens: int = 8192,
        batch_size: int | None = None,
        pad_to_multiple_of: int = 8,
        open_bins: int = 4,
        shuffle: bool = True,
        seed: int = 0,
        block_size: int = 64,
        window: int = 1024,
        over_long: str = "truncate",
        tail: str = "pad",
        aux_layers: list[int] | None = None,
        verifier: bool = True,
        rank: int | None = None,
        world_size: int | None = None,
        pad_token_id: int = 0,
        verify_reads: bool | None = None,
    ) -> RankPlan:
        """The options of docs/LOADER.md (``dataset``: a path, a Dataset or a DatasetSource)."""
        source = (
            dataset
            if isinstance(dataset, DatasetSource)
            else DatasetSource(dataset, verify_reads=verify_reads)
        )
        config = PlanConfig(
            max_tokens=max_tokens,
            batch_size=batch_size,
            pad_to_multiple_of=pad_to_multiple_of,
            open_bins=open_bins,
            shuffle=shuffle,
            seed=seed,
            block_size=block_size,
            window=window,
            over_long=over_long,
            tail=tail,
        )
        shape = BatchShape(
            packed=batch_size is None,
            max_tokens=max_tokens,
            batch_size=batch_size,
            pad_to_multiple_of=pad_to_multiple_of,
            pad_token_id=pad_token_id,
        )
        if rank is None or world_size is None:
            d_rank, d_world = default_rank_world()
            rank = d_rank if rank is None else rank
            world_size = d_world if world_size is None else world_size
        choice = LayerChoice.resolve(source.layers, aux_layers, verifier)
        return cls(source, config, choice, shape, rank, world_size)


class PlannedEpochs:
    """What the stream, the batch sampler and the Loader share: a ``RankPlan`` and the
    position ``(epoch, step)`` in its epochs.

    Built from the options of docs/LOADER.md, or from a ``RankPlan`` (another object's, when
    one of them hands its plan on, as the Loader does to its worker processes' stream).
    """

    def __init__(self, dataset: Any, **options: Any):
        if isinstance(dataset, RankPlan):
            if options:
                raise TypeError(f"options {sorted(options)} given with a RankPlan that fixes them")
            spec = dataset
        else:
            spec = RankPlan.from_options(dataset, **options)
        self.rank_plan = spec
        self.source, self.config = spec.source, spec.config
        self.choice, self.shape = spec.choice, spec.shape
        self.rank, self.world_size = spec.rank, spec.world_size
        self.epoch = 0
        self.step = 0
        self._plan_cache: tuple[int, BatchPlan] | None = None
        self.fingerprint = fingerprint(self.config, self.source.data_fingerprint, self.world_size)

    def plan(self, epoch: int | None = None) -> BatchPlan:
        """This rank's batches for ``epoch`` (default: the current one)."""
        epoch = self.epoch if epoch is None else epoch
        if self._plan_cache is None or self._plan_cache[0] != epoch:
            plan = rank_plan(
                self.config,
                self.source.num_tokens,
                self.source.segments,
                epoch,
                self.rank,
                self.world_size,
            )
            self._plan_cache = (epoch, plan)
        return self._plan_cache[1]

    def __len__(self) -> int:
        """Batches this rank yields in the current epoch (from its start)."""
        return len(self.plan())

    def set_epoch(self, epoch: int) -> None:
        """Move to ``epoch`` from its start; a no-op if already there (keeps a resumed step)."""
        if epoch != self.epoch:
            self.epoch, self.step = int(epoch), 0

    def _check_state(self, state: dict[str, Any]) -> None:
        if int(state.get("version", STATE_VERSION)) > STATE_VERSION:
            raise LoaderStateError(
                f"loader state version {state['version']} is newer than this hsstore"
            )
        fp = state.get("fingerprint")
        if fp is not None and int(fp) != self.fingerprint:
            raise LoaderStateError(
                "loader state was saved for another dataset version, world size or plan "
                "settings; it cannot resume this one",
                path=self.source.path,
            )

    def _base_state(self) -> dict[str, Any]:
        return {
            "version": STATE_VERSION,
            "epoch": self.epoch,
            "step": self.step,
            "seed": self.config.seed,
            "fingerprint": self.fingerprint,
        }


class HiddenStateStream(PlannedEpochs, IterableDataset):
    """Collated batches of this rank's epoch plan (CPU tensors, fresh per batch by default).

    Options are the ``Loader``'s (see docs/LOADER.md) minus ``device``; ``num_threads`` decode
    threads per process (keep it 1-2 inside DataLoader workers). ``reuse_buffers=True`` makes a
    batch valid only until the next one is requested, and must stay False with workers.
    """

    def __init__(
        self,
        dataset: Any,
        *,
        num_threads: int = 2,
        prefetch: int = 2,
        reuse_buffers: bool = False,
        **options: Any,
    ):
        super().__init__(dataset, **options)
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
            self.epoch, self.step = self.epoch + 1, 0

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
        self._check_state(state)
        self.epoch, self.step = int(state["epoch"]), int(state["step"])
        self._skip = int(state.get("yielded", 0)) if "worker" in state else 0
        self._yielded = 0


class PlannedBatchSampler(PlannedEpochs, Sampler):
    """The epoch plan as lists of storage positions, for a map-style ``HiddenStateDataset``.

    ``DataLoader(HiddenStateDataset(p), batch_sampler=PlannedBatchSampler(p, ...),
    collate_fn=pack_collate(max_tokens))`` yields the same batches as ``HiddenStateStream``
    (the plan already respects the budget, so ``pack_collate`` never cuts a sample).
    """

    def __iter__(self) -> Iterator[list[int]]:
        plan = self.plan()
        for j in range(self.step, len(plan)):
            yield plan.batch(j)[0].tolist()

    def state_dict(self) -> dict[str, Any]:
        return self._base_state()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._check_state(state)
        self.epoch, self.step = int(state["epoch"]), int(state["step"])


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
