"""Per-layer statistics measured by inspect on the rows it reads.

The totals every reader of statistics shares (rows, all-zero and non-finite rows, mean, std,
RMS, min, max) are hsstore.segment.stats' ``StatsAccumulator``, the one the writer records, here run on
every row. What it cannot see is per-token structure: NaN and Inf counts, constant rows, the
spread of per-token RMS, how close two layers are. These accumulators add that, streaming over
[T, H] slices so memory stays flat.

Cost matters (inspect of a GB must take seconds), so each row batch gets a handful of fused
reductions; anything element-wise beyond that (histograms, percentiles, pair distances) runs
on a uniform reservoir of rows instead of on every row.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from hsstore.segment.stats import HIST_BINS, HIST_MAX_EXP, HIST_MIN_EXP, LayerStats

# Element-magnitude histogram, on the same log2 bins as the write-time row histogram:
# bin k counts |x| with floor(log2|x|) == HIST_MIN_EXP + k.
__all__ = ["HIST_BINS", "HIST_MAX_EXP", "HIST_MIN_EXP", "LayerAccumulator"]


@dataclass
class LayerAccumulator:
    """What inspect adds, for one stored layer, to the shared totals (``LayerStats``)."""

    nan: int = 0
    inf: int = 0
    constant_rows: int = 0
    token_rms: list[torch.Tensor] = field(default_factory=list)

    def update(self, x: torch.Tensor) -> None:
        """``x``: [T, H] float32 rows of this layer."""
        if x.shape[0] == 0:
            return
        lo, hi = torch.aminmax(x, dim=1)  # NaN propagates; +-inf shows in lo/hi
        finite = torch.isfinite(lo) & torch.isfinite(hi)
        if not bool(finite.all()):
            bad = x[~finite]
            self.nan += int(torch.isnan(bad).sum())
            self.inf += int(torch.isinf(bad).sum())
            x, lo, hi = x[finite], lo[finite], hi[finite]
            if x.shape[0] == 0:
                return
        zero = (lo == 0) & (hi == 0)
        self.constant_rows += int(((lo == hi) & ~zero).sum())
        norms = torch.linalg.vector_norm(x, dim=1)
        self.token_rms.append(norms / math.sqrt(x.shape[1]))

    def summary(self, totals: LayerStats, rows_sample: torch.Tensor | None) -> dict[str, Any]:
        """Finished statistics: ``totals`` are this layer's over every row (sampled every row),
        ``rows_sample`` a uniform subset of its rows."""
        n = totals.sampled_values
        tok = torch.cat(self.token_rms) if self.token_rms else torch.empty(0)
        out: dict[str, Any] = {
            "rows": totals.rows,
            "mean": totals.mean,
            "std": totals.std,
            "rms": totals.rms,
            "min": totals.min if n else math.nan,
            "max": totals.max if n else math.nan,
            "nan": self.nan,
            "inf": self.inf,
            "nonfinite_rows": totals.nonfinite_rows,
            "zero_rows": totals.zero_rows,
            "constant_rows": self.constant_rows,
            "token_rms_median": float(tok.median()) if tok.numel() else math.nan,
            "token_rms_cv": float(tok.std() / tok.mean())
            if tok.numel() > 1 and tok.mean() > 0
            else math.nan,
        }
        values = None if rows_sample is None else rows_sample.reshape(-1)
        if values is not None:
            values = values[torch.isfinite(values)].abs()
        out.update(abs_percentiles(values))
        out["abs_max"] = max(abs(out["min"]), abs(out["max"])) if n else math.nan
        out["log2_hist"] = {"min_exp": HIST_MIN_EXP, "counts": log2_histogram(values)}
        return out


def abs_percentiles(values: torch.Tensor | None) -> dict[str, float]:
    """p50 / p99 / p99.9 of finite |x| values."""
    keys = {"abs_p50": 0.5, "abs_p99": 0.99, "abs_p999": 0.999}
    if values is None or values.numel() == 0:
        return dict.fromkeys(keys, math.nan)
    q = np.quantile(values.float().numpy(), list(keys.values()))  # partition, not a full sort
    return {k: float(x) for k, x in zip(keys, q.tolist(), strict=True)}


def log2_histogram(values: torch.Tensor | None) -> list[int]:
    """Counts of |x| per power-of-two bin (zeros left out), for the magnitude plot."""
    if values is None:
        return [0] * HIST_BINS
    _, exp = torch.frexp(values[values > 0].float())  # |x| = m * 2^exp, m in [0.5, 1)
    bins = (exp.long() - 1).clamp(HIST_MIN_EXP, HIST_MAX_EXP) - HIST_MIN_EXP
    return torch.bincount(bins, minlength=HIST_BINS).tolist()


class PairAccumulator:
    """How far apart every pair of stored layers is, to catch one layer captured twice.

    Bit equality is checked on every row read (cheap, in the stored dtype); the relative
    distance is measured on a uniform reservoir of rows passed to ``distances``.
    """

    def __init__(self, num_layers: int):
        self.n = num_layers
        self.identical = torch.ones(num_layers, num_layers, dtype=torch.bool)
        self.rows = 0

    def update(self, hidden: torch.Tensor) -> None:
        """``hidden``: [T, L, H] in the stored dtype."""
        if hidden.shape[0] == 0:
            return
        self.rows += hidden.shape[0]
        for i in range(self.n):
            for j in range(i + 1, self.n):
                if self.identical[i, j] and not torch.equal(hidden[:, i], hidden[:, j]):
                    self.identical[i, j] = self.identical[j, i] = False

    def pairs(self, rows_sample: torch.Tensor | None) -> list[dict[str, Any]]:
        """Every pair with its relative distance ||a-b|| / rms(||a||, ||b||) on ``rows_sample``."""
        x = None
        if rows_sample is not None:
            x = rows_sample.float()
            x = x[torch.isfinite(x).all(dim=(1, 2))].double()
        out = []
        for i in range(self.n):
            for j in range(i + 1, self.n):
                rel = math.nan
                if x is not None and x.shape[0]:
                    scale = math.sqrt(float(x[:, i].pow(2).sum() + x[:, j].pow(2).sum()) / 2)
                    diff = math.sqrt(float((x[:, i] - x[:, j]).pow(2).sum()))
                    rel = diff / scale if scale > 0 else 0.0
                same = bool(self.identical[i, j]) and self.rows > 0
                out.append({"a": i, "b": j, "relative_distance": 0.0 if same else rel,
                            "bit_identical": same})  # fmt: skip
        return out
