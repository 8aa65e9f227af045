"""Which samples inspect reads, and a uniform reservoir of token rows.

The default audit must be fast on a terabyte, so it reads a random subset of samples chosen
with probability proportional to their length: every token of the dataset then has the same
chance to be looked at, and long samples (where prefix-cache and chunked-prefill faults live)
are not under-represented. ``--full`` reads everything.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch


@dataclass(frozen=True)
class ReadPlan:
    """Sample positions to read, in order; stop once ``token_budget`` tokens were read (if set)."""

    indices: list[int]
    token_budget: int | None
    full: bool


def plan_reads(
    num_samples: int,
    lengths: np.ndarray | None,
    *,
    token_budget: int,
    seed: int,
    full: bool,
) -> ReadPlan:
    """Choose samples so that each token has (about) the same chance of being read.

    With known lengths this is weighted sampling without replacement (Efraimidis-Spirakis
    keys), cut where the budget is reached and sorted back into storage order for sequential
    reads. Without lengths (foreign formats that must be opened to be measured) the order is a
    random permutation and the reader stops at the budget.
    """
    if full or num_samples == 0:
        return ReadPlan(list(range(num_samples)), None, True)
    rng = np.random.default_rng(seed)
    if lengths is None:
        return ReadPlan(rng.permutation(num_samples).tolist(), token_budget, False)
    weights = np.maximum(np.asarray(lengths, dtype=np.float64), 1.0)
    keys = rng.random(num_samples) ** (1.0 / weights)
    order = np.argsort(-keys, kind="stable")
    covered = np.cumsum(np.asarray(lengths, dtype=np.int64)[order])
    take = int(np.searchsorted(covered, token_budget) + 1)
    chosen = np.sort(order[: min(take, num_samples)])
    return ReadPlan(chosen.tolist(), None, len(chosen) == num_samples)


class RowReservoir:
    """A uniform random subset of at most ``capacity`` rows from a stream of row batches.

    Each row gets a random key and the reservoir keeps the rows with the largest keys, which
    is a uniform sample without replacement whatever the batch sizes. Extra per-row tensors
    (targets, positions) travel with their rows. Storage is allocated once and rows are
    replaced in place, so a long stream costs no re-concatenation; the order of kept rows is
    arbitrary.
    """

    def __init__(self, capacity: int, seed: int):
        self.capacity = capacity
        self._gen = torch.Generator().manual_seed(seed)
        self._keys = torch.empty(0)
        self._cols: dict[str, torch.Tensor] = {}

    def add(self, **cols: torch.Tensor) -> None:
        n = next(iter(cols.values())).shape[0]
        if n == 0 or self.capacity == 0:
            return
        keys = torch.rand(n, generator=self._gen)
        if n > self.capacity:  # rows outside this batch's top keys can never be kept
            pick = torch.topk(keys, self.capacity).indices
            keys = keys[pick]
            cols = {k: v[pick] for k, v in cols.items()}
            n = self.capacity
        if not self._cols:
            self._cols = {
                k: torch.empty((self.capacity, *v.shape[1:]), dtype=v.dtype)
                for k, v in cols.items()
            }
        held = self._keys.shape[0]
        free = min(self.capacity - held, n)
        if free:  # fill empty slots first
            for k, v in cols.items():
                self._cols[k][held : held + free] = v[:free]
            self._keys = torch.cat([self._keys, keys[:free]])
            keys, cols = keys[free:], {k: v[free:] for k, v in cols.items()}
        if keys.shape[0] == 0:
            return
        # Full: a new row replaces the current smallest key while its own key is larger.
        both = torch.cat([self._keys, keys])
        keep = torch.zeros(both.shape[0], dtype=torch.bool)
        keep[torch.topk(both, self.capacity).indices] = True
        evicted = torch.nonzero(~keep[: self.capacity]).flatten()
        entering = torch.nonzero(keep[self.capacity :]).flatten()
        for k, v in cols.items():
            self._cols[k][evicted] = v[entering]
        self._keys[evicted] = keys[entering]

    def __len__(self) -> int:
        return int(self._keys.shape[0])

    def get(self, name: str) -> torch.Tensor | None:
        col = self._cols.get(name)
        return None if col is None else col[: len(self)]
