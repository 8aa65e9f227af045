"""Streaming per-layer statistics, recorded at write time so auditing a terabyte is instant.

Cost is kept to a few percent of writing: one integer pass over the bit patterns computes every row's
abs-max (which yields exact counts of all-zero and non-finite rows and an exact histogram of
row magnitudes), and moments (mean, std, RMS, min, max) come from every ``sample_every``-th row.

All of it is numpy on the calling thread. torch's reductions would run on its OpenMP threads,
which spin between calls and so take CPU from the pool the writer encodes on (on a node with
many cores every reduction wakes them all); numpy on one thread is about as fast per call and
costs a few tenths of a percent of a write.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from hsstore.spec.sample_index import row_magnitudes

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


# Per storage dtype: (signed integer view, abs mask, smallest non-finite pattern, mantissa
# bits, exponent bias). The full pass works on bit patterns: exact, and an integer max is ~10x
# faster than float abs/amax/isfinite passes on bf16.
_BITS = {
    "bfloat16": (np.dtype("<i2"), 0x7FFF, 0x7F80, 7, 127),
    "float16": (np.dtype("<i2"), 0x7FFF, 0x7C00, 10, 15),
    "float32": (np.dtype("<i4"), 0x7FFFFFFF, 0x7F800000, 23, 127),
}

# The same bit patterns read as unsigned: their max finds the largest negative magnitude.
_UNSIGNED = {"bfloat16": np.dtype("<u2"), "float16": np.dtype("<u2"), "float32": np.dtype("<u4")}


class StatsAccumulator:
    """Accumulates `LayerStats` for every layer of the samples a segment receives.

    The running totals are numpy arrays over layers (one vector operation per sample instead of
    a Python loop over layers: on small samples the loop cost more than the arithmetic), read
    out as `LayerStats` by `layers`. Every total is updated exactly as a `LayerStats` field
    would be (float64 additions in the same order), so the numbers are the same.
    """

    def __init__(self, num_layers: int, dtype_name: str = "bfloat16", *, sample_every: int = 8):
        self.num_layers = num_layers
        self.sample_every = sample_every
        self.dtype_name = dtype_name
        self._phase = 0  # keeps the row sampling uniform across sample boundaries
        self._rows = 0
        self._zero = np.zeros(num_layers, np.int64)
        self._nonfinite = np.zeros(num_layers, np.int64)
        self._hist = np.zeros((num_layers, HIST_BINS), np.int64)
        self._sampled = np.zeros(num_layers, np.int64)
        self._sum = np.zeros(num_layers, np.float64)
        self._sumsq = np.zeros(num_layers, np.float64)
        self._min = np.full(num_layers, math.inf)
        self._max = np.full(num_layers, -math.inf)
        self._layer_offsets = np.arange(num_layers) * HIST_BINS
        # Reused: a fresh multi-MB array per sample costs page faults, a large share of the
        # stats time.
        self._floats = np.empty(0, np.float32)

    @property
    def layers(self) -> list[LayerStats]:
        return [
            LayerStats(
                rows=self._rows,
                zero_rows=int(self._zero[j]),
                nonfinite_rows=int(self._nonfinite[j]),
                sampled_values=int(self._sampled[j]),
                sum=float(self._sum[j]),
                sumsq=float(self._sumsq[j]),
                min=float(self._min[j]),
                max=float(self._max[j]),
                rowmax_hist=self._hist[j].tolist(),
            )
            for j in range(self.num_layers)
        ]

    def update(self, stored: np.ndarray) -> RowFlags:
        """``stored``: one sample's states [T, L, H] in the storage dtype."""
        zero, nonfinite = self.update_block(stored, None)
        return RowFlags(zero_rows=int(zero.sum()), nonfinite_rows=int(nonfinite.sum()))

    def update_block(
        self,
        stored: np.ndarray,
        real: np.ndarray | None,
        rowmax: np.ndarray | None = None,
        sampled: np.ndarray | None = None,
    ) -> tuple[np.ndarray, np.ndarray]:
        """Rows [N, L, H] of several samples at once (a writer's shard buffer): the same totals
        as `update` on each sample in turn, up to the order of float64 additions, for a
        fraction of the per-call overhead on small samples. ``real``: which rows belong to a
        sample (False for alignment padding; None = all). ``rowmax``: `row_absmax` of
        ``stored``, and ``sampled``: its sampled rows (`sampled_rows`) as float32 (overwritten),
        where the caller has them already. Returns per row whether it is all
        zeros, or holds a NaN/Inf, in some layer (so the caller can count per sample)."""
        _, _, nonfinite_at, mantissa, bias = _BITS[self.dtype_name]
        n_layers = stored.shape[1]
        if rowmax is None:
            rowmax = row_absmax(stored, self.dtype_name)  # [T, L]
        nonfinite = rowmax >= nonfinite_at
        zero = rowmax == 0
        if real is not None:  # padding rows are neither zero rows nor anything else
            nonfinite &= real[:, None]
            zero &= real[:, None]
        good = ~nonfinite & ~zero
        if real is not None:
            good &= real[:, None]
        exps = (rowmax >> mantissa).astype(np.int64) - bias
        bins = np.clip(exps, HIST_MIN_EXP, HIST_MAX_EXP) - HIST_MIN_EXP
        # One bincount for all layers: layer j's bins are offset by j * HIST_BINS.
        self._hist += np.bincount(
            (bins + self._layer_offsets)[good], minlength=n_layers * HIST_BINS
        ).reshape(n_layers, HIST_BINS)
        t = rowmax.shape[0] if real is None else int(np.count_nonzero(real))
        self._rows += t
        self._zero += zero.sum(axis=0)
        self._nonfinite += nonfinite.sum(axis=0)

        # Every sample_every-th real row, counted across calls.
        start = (-self._phase) % self.sample_every
        self._phase = (self._phase + t) % self.sample_every
        if real is None:
            picked: slice | np.ndarray = slice(start, None, self.sample_every)
        else:
            picked = np.flatnonzero(real)[start :: self.sample_every]
        ok = ~nonfinite[picked]  # [t', L]
        if sampled is not None and sampled.shape[0] != ok.shape[0]:
            raise ValueError(f"{sampled.shape[0]} sampled rows given, {ok.shape[0]} picked")
        if ok.shape[0]:
            values = self._sampled_floats(stored[picked]) if sampled is None else sampled
            counts, sums, sumsqs, mins, maxs = sampled_moments(values, ok)
            has = counts > 0  # a layer with no finite sampled row keeps its totals
            self._sampled += np.where(has, counts, 0)
            self._sum = np.where(has, self._sum + sums, self._sum)
            self._sumsq = np.where(has, self._sumsq + sumsqs, self._sumsq)
            self._min = np.where(has, np.minimum(self._min, mins), self._min)
            self._max = np.where(has, np.maximum(self._max, maxs), self._max)
        return zero.any(axis=1), nonfinite.any(axis=1)

    def sampled_rows(self, rows_before: int, rows: int) -> tuple[int, int]:
        """Which of ``rows`` real rows, after ``rows_before`` real rows of this accumulator,
        `update_block` samples: (the first, how many); every ``sample_every``-th follows."""
        first = (-rows_before) % self.sample_every
        return first, max(0, -(-(rows - first) // self.sample_every))

    def _sampled_floats(self, sampled: np.ndarray) -> np.ndarray:
        """The sampled rows (storage dtype) as float32 in a reused buffer (exact: every storage
        dtype widens)."""
        if self._floats.size < sampled.size:
            self._floats = np.empty(sampled.size, np.float32)
        out = self._floats[: sampled.size].reshape(sampled.shape)
        return widen(sampled, self.dtype_name, out)

    def to_json(self) -> dict[str, Any]:
        return {"sample_every": self.sample_every, "layers": [s.to_json() for s in self.layers]}


def magnitude_dtype(dtype_name: str) -> np.dtype | None:
    """The dtype of `row_absmax` for states of ``dtype_name`` (None: not measured by bits)."""
    bits = _BITS.get(dtype_name)
    return None if bits is None else bits[0]


def row_absmax(stored: np.ndarray, dtype_name: str) -> np.ndarray:
    """Per-row max of the magnitude bits (sign cleared) of [T, L, H] sign-magnitude floats
    (``stored``: their bit patterns, or the values).

    One compiled pass where built (`row_magnitudes`). Else two read-only reductions instead of
    masking the sign into a scratch copy and reducing that: the signed max is the largest
    non-negative pattern, the unsigned max (sign bit set) the largest negative magnitude. Half
    the memory traffic of the masked copy."""
    idtype, abs_mask = _BITS[dtype_name][:2]
    if stored.itemsize == idtype.itemsize:
        out = np.empty(stored.shape[:-1], idtype)
        if row_magnitudes(stored, out):
            return out
    positive = np.maximum(stored.view(idtype).max(axis=-1), 0)
    umax = stored.view(_UNSIGNED[dtype_name]).max(axis=-1)
    negative = np.where(umax > abs_mask, umax & abs_mask, 0).astype(positive.dtype)
    return np.maximum(positive, negative)


def nonfinite_rows(stored: np.ndarray, dtype_name: str) -> int:
    """How many rows of [T, L, H] (per layer) hold a NaN or an Inf, from the bit patterns."""
    return int((row_absmax(stored, dtype_name) >= _BITS[dtype_name][2]).sum())


def widen(stored: np.ndarray, dtype_name: str, out: np.ndarray) -> np.ndarray:
    """``stored`` (bf16 bit patterns, or float16/float32 values) as float32 values in
    ``out``."""
    if dtype_name == "bfloat16":  # a bf16 is the high half of the float32 of the same value
        np.left_shift(stored.view(np.uint16), 16, out=out.view(np.uint32), dtype=np.uint32)
    else:
        np.copyto(out, stored.view(np.dtype(dtype_name)))
    return out


def sampled_moments(
    values: np.ndarray, ok: np.ndarray
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Per layer, over the rows of ``values`` [t, L, H] (float32; overwritten) where ``ok``
    [t, L] (no NaN/Inf in the row): how many values, their sum and sum of squares, min and max.
    Each row is reduced in float32, then rows are added up in float64. Rows that are not ok
    (and squares past float32's range) make NaN and Inf along the way, which are left out or
    clipped, not reported: numpy's warnings about them are silenced."""
    okf = ok.astype(np.float64)
    counts = ok.sum(axis=0) * values.shape[-1]
    with np.errstate(invalid="ignore", over="ignore"):
        sums = (np.nan_to_num(values.sum(axis=-1).astype(np.float64)) * okf).sum(axis=0)
        mins = np.where(ok, values.min(axis=-1), np.inf).min(axis=0).astype(np.float64)
        maxs = np.where(ok, values.max(axis=-1), -np.inf).max(axis=0).astype(np.float64)
        squares = np.multiply(values, values, out=values)  # in place: values are not needed
        sumsqs = (np.nan_to_num(squares.sum(axis=-1).astype(np.float64)) * okf).sum(axis=0)
    return counts, sums, sumsqs, mins, maxs


def merge_layer_stats(docs: list[dict[str, Any]], num_layers: int) -> list[LayerStats]:
    """Combine the per-segment stats documents into one `LayerStats` per layer."""
    total = [LayerStats() for _ in range(num_layers)]
    for doc in docs:
        for acc, obj in zip(total, doc["layers"]):
            acc.merge(LayerStats.from_json(obj))
    return total
