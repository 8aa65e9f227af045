"""The epoch plan of one rank: order -> batches -> this rank's share, from the index alone."""

from __future__ import annotations

import zlib
from dataclasses import asdict, dataclass

import numpy as np

from hsstore.loader.batching import (
    OVER_LONG_POLICIES,
    BatchPlan,
    plan_packed,
    plan_padded,
)
from hsstore.loader.order import epoch_order
from hsstore.loader.partition import TAIL_POLICIES, rank_batches


@dataclass(frozen=True)
class PlanConfig:
    """Everything that decides which sample lands in which batch of which rank (built from
    ``LoaderOptions``, which holds the defaults)."""

    max_tokens: int
    batch_size: int | None  # None: packed mode
    pad_to_multiple_of: int
    open_bins: int
    shuffle: bool
    seed: int
    block_size: int
    window: int
    over_long: str
    tail: str

    def __post_init__(self) -> None:
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens}")
        if self.batch_size is not None and self.batch_size < 1:
            raise ValueError(f"batch_size must be >= 1 or None, got {self.batch_size}")
        if self.pad_to_multiple_of < 1:
            raise ValueError("pad_to_multiple_of must be >= 1")
        if self.over_long not in OVER_LONG_POLICIES:
            raise ValueError(f"over_long must be one of {OVER_LONG_POLICIES}")
        if self.tail not in TAIL_POLICIES:
            raise ValueError(f"tail must be one of {TAIL_POLICIES}")

    @property
    def packed(self) -> bool:
        return self.batch_size is None


def global_plan(
    cfg: PlanConfig,
    num_tokens: np.ndarray,
    segments: np.ndarray | None,
    epoch: int,
    *,
    lo: int = 0,
    hi: int | None = None,
    part: int | None = None,
) -> BatchPlan:
    """Every batch of the epoch, over all ranks: of the samples at storage positions
    ``[lo, hi)`` (default: all), shuffled by the stream ``part`` of the epoch (see
    ``order.epoch_order``)."""
    hi = len(num_tokens) if hi is None else hi
    order = lo + epoch_order(
        hi - lo,
        seed=cfg.seed,
        epoch=epoch,
        shuffle=cfg.shuffle,
        block_size=cfg.block_size,
        window=cfg.window,
        segments=None if segments is None else segments[lo:hi],
        part=part,
    )
    if cfg.packed:
        return plan_packed(
            order, num_tokens, cfg.max_tokens, open_bins=cfg.open_bins, over_long=cfg.over_long
        )
    assert cfg.batch_size is not None
    return plan_padded(order, num_tokens, cfg.batch_size, cfg.max_tokens, over_long=cfg.over_long)


def rank_plan(
    cfg: PlanConfig,
    num_tokens: np.ndarray,
    segments: np.ndarray | None,
    epoch: int,
    rank: int,
    world_size: int,
    start: int = 0,
) -> BatchPlan:
    """The batches rank ``rank`` processes in epoch ``epoch`` from global position ``start``
    (batches of the epoch already done, by any number of ranks), in order."""
    full = global_plan(cfg, num_tokens, segments, epoch)
    return full.select(rank_batches(len(full), rank, world_size, cfg.tail, start))


def fingerprint_v1(cfg: PlanConfig, data_fingerprint: int, world_size: int) -> int:
    """The checksum of a version 1 state, which also covered the world size."""
    text = repr(sorted(asdict(cfg).items())) + f"|{data_fingerprint}|{world_size}"
    return zlib.crc32(text.encode())


def fingerprint(cfg: PlanConfig, data_fingerprint: int) -> int:
    """A checksum of what a resumed run must share with the run that saved its state: the
    plan settings and the data, never the world size (the global plan does not depend on it)."""
    text = repr(sorted(asdict(cfg).items())) + f"|{data_fingerprint}"
    return zlib.crc32(text.encode())
