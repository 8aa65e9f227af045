"""Streaming per-layer statistics, recorded at write time so auditing a terabyte is instant.

Cost is kept to a few percent of writing: one fast pass computes every row's abs-max (which
yields exact counts of all-zero and non-finite rows and an exact histogram of row magnitudes),
and moments (mean, std, RMS, min, max) come from every ``sample_every``-th row.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import torch

# Row abs-max histogram: bin k counts rows with floor(log2(absmax)) == HIST_MIN_EXP + k
# (clipped into the end bins); zero rows and non-finite rows are counted apart.
HIST_MIN_EXP = -24
HIST_MAX_EXP = 40
HIST_BINS = HIST_MAX_EXP - HIST_MIN_EXP + 1


@dataclass
class LayerStats:
    """Statistics of one stored layer over a set of rows (tokens)."""

    rows: int = 0
    zero_rows: int = 0
    nonfinite_rows: int = 0
    sampled_values: int = 0
    sum: float = 0.0
    sumsq: float = 0.0
    min: float = math.inf
    max: float = -math.inf
    rowmax_hist: list[int] = field(default_factory=lambda: [0] * HIST_BINS)

    @property
    def mean(self) -> float:
        return self.sum / self.sampled_values if self.sampled_values else math.nan

    @property
    def rms(self) -> float:
        return math.sqrt(self.sumsq / self.sampled_values) if self.sampled_values else math.nan

    @property
    def std(self) -> float:
        if not self.sampled_values:
            return math.nan
        var = self.sumsq / self.sampled_values - self.mean**2
        return math.sqrt(max(var, 0.0))

    def rowmax_quantile(self, q: float) -> float:
        """Approximate quantile of per-row abs-max (upper edge of its log2 bin)."""
        total = sum(self.rowmax_hist)
        if not total:
            return math.nan
        target = q * total
        acc = 0
        for k, n in enumerate(self.rowmax_hist):
            acc += n
            if acc >= target:
                return 2.0 ** (HIST_MIN_EXP + k + 1)
        return 2.0 ** (HIST_MAX_EXP + 1)

    def merge(self, other: LayerStats) -> None:
        self.rows += other.rows
        self.zero_rows += other.zero_rows
        self.nonfinite_rows += other.nonfinite_rows
        self.sampled_values += other.sampled_values
        self.sum += other.sum
        self.sumsq += other.sumsq
        self.min = min(self.min, other.min)
        self.max = max(self.max, other.max)
        self.rowmax_hist = [a + b for a, b in zip(self.rowmax_hist, other.rowmax_hist)]

    def to_json(self) -> dict[str, Any]:
        return {
            "rows": self.rows,
            "zero_rows": self.zero_rows,
            "nonfinite_rows": self.nonfinite_rows,
            "sampled_values": self.sampled_values,
            "sum": self.sum,
            "sumsq": self.sumsq,
            "min": None if math.isinf(self.min) else self.min,
            "max": None if math.isinf(self.max) else self.max,
            "rowmax_hist": self.rowmax_hist,
        }

    @classmethod
    def from_json(cls, obj: dict[str, Any]) -> LayerStats:
        return cls(
            rows=obj["rows"],
            zero_rows=obj["zero_rows"],
            nonfinite_rows=obj["nonfinite_rows"],
            sampled_values=obj["sampled_values"],
            sum=obj["sum"],
            sumsq=obj["sumsq"],
            min=math.inf if obj["min"] is None else obj["min"],
            max=-math.inf if obj["max"] is None else obj["max"],
            rowmax_hist=list(obj["rowmax_hist"]),
        )


@dataclass(frozen=True)
class RowFlags:
    """What the stats pass learned about one sample: counts of bad rows over all layers."""

    zero_rows: int
    nonfinite_rows: int


class StatsAccumulator:
    """Accumulates `LayerStats` for every layer of the samples a segment receives."""

    def __init__(self, num_layers: int, *, sample_every: int = 8):
        self.layers = [LayerStats() for _ in range(num_layers)]
        self.sample_every = sample_every
        self._phase = 0  # keeps the row sampling uniform across sample boundaries

    def update(self, hidden: torch.Tensor) -> RowFlags:
        """``hidden``: [T, L, H] in the logical dtype."""
        rowmax = hidden.abs().amax(dim=-1).float()  # [T, L]; NaN and inf propagate
        finite = torch.isfinite(rowmax)
        zero = rowmax == 0
        nonfinite_per_layer = (~finite).sum(0).tolist()
        zero_per_layer = zero.sum(0).tolist()
        good = finite & ~zero
        exps = torch.floor(torch.log2(rowmax.clamp_min(2.0**HIST_MIN_EXP)))
        bins = (exps.clamp(HIST_MIN_EXP, HIST_MAX_EXP) - HIST_MIN_EXP).long()

        start = (-self._phase) % self.sample_every
        sampled = hidden[start :: self.sample_every].float()  # [t, L, H]
        self._phase = (self._phase + hidden.shape[0]) % self.sample_every
        if sampled.shape[0]:
            ok_rows = torch.isfinite(sampled).all(dim=-1)  # [t, L]
            clean = torch.where(
                ok_rows.unsqueeze(-1), sampled, torch.zeros((), dtype=sampled.dtype)
            )
            sums = clean.sum(dim=(0, 2)).double().tolist()
            sumsqs = clean.double().pow(2).sum(dim=(0, 2)).tolist()
            counts = (ok_rows.sum(0) * hidden.shape[-1]).tolist()
            big = torch.finfo(torch.float32).max
            mins = torch.where(ok_rows.unsqueeze(-1), sampled, big).amin(dim=(0, 2)).tolist()
            maxs = torch.where(ok_rows.unsqueeze(-1), sampled, -big).amax(dim=(0, 2)).tolist()
        for layer_index, st in enumerate(self.layers):
            st.rows += hidden.shape[0]
            st.zero_rows += int(zero_per_layer[layer_index])
            st.nonfinite_rows += int(nonfinite_per_layer[layer_index])
            hist = torch.bincount(bins[:, layer_index][good[:, layer_index]], minlength=HIST_BINS)
            st.rowmax_hist = [a + int(b) for a, b in zip(st.rowmax_hist, hist.tolist())]
            if sampled.shape[0] and counts[layer_index]:
                st.sampled_values += int(counts[layer_index])
                st.sum += sums[layer_index]
                st.sumsq += sumsqs[layer_index]
                st.min = min(st.min, mins[layer_index])
                st.max = max(st.max, maxs[layer_index])
        return RowFlags(
            zero_rows=int(zero.any(dim=1).sum()), nonfinite_rows=int((~finite).any(dim=1).sum())
        )

    def to_json(self) -> dict[str, Any]:
        return {"sample_every": self.sample_every, "layers": [s.to_json() for s in self.layers]}


def merge_layer_stats(docs: list[dict[str, Any]], num_layers: int) -> list[LayerStats]:
    """Combine the per-segment stats documents into one `LayerStats` per layer."""
    total = [LayerStats() for _ in range(num_layers)]
    for doc in docs:
        for acc, obj in zip(total, doc["layers"]):
            acc.merge(LayerStats.from_json(obj))
    return total
