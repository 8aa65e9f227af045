"""Streaming hidden states from an hsstore dataset into PyTorch training loops.

``Loader`` is the one-stop object (see docs/LOADER.md); ``HiddenStateStream``,
``HiddenStateDataset`` and ``PlannedBatchSampler`` are the torch ``Dataset``/``Sampler``
building blocks; ``order``, ``batching`` and ``partition`` hold the pure planning functions.
"""

from __future__ import annotations

from hsstore.loader.batching import BatchPlan, plan_packed, plan_padded
from hsstore.loader.collate import pack_collate, pad_collate
from hsstore.loader.options import LoaderOptions
from hsstore.loader.order import epoch_order
from hsstore.loader.partition import rank_batches, worker_steps
from hsstore.loader.plan import PlanConfig
from hsstore.loader.stream import (
    HiddenStateDataset,
    HiddenStateStream,
    PlannedBatchSampler,
    PlannedEpochs,
    RankPlan,
)
from hsstore.loader.train_loader import Loader

__all__ = [
    "BatchPlan",
    "HiddenStateDataset",
    "HiddenStateStream",
    "Loader",
    "LoaderOptions",
    "PlanConfig",
    "PlannedBatchSampler",
    "PlannedEpochs",
    "RankPlan",
    "epoch_order",
    "pack_collate",
    "pad_collate",
    "plan_packed",
    "plan_padded",
    "rank_batches",
    "worker_steps",
]
