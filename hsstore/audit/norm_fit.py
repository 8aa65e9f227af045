"""Is a stored state the output of an RMSNorm? A test that needs no model weights.

After RMSNorm, y = w * x / rms(x), so sum_i (y_i / w_i)^2 = H for every token: one unknown
positive weight per dimension (u_i = 1 / (H w_i^2)) makes a weighted squared norm exactly
constant across tokens. A pre-norm residual stream has no such weights: its per-token scale
varies freely. Given more tokens than dimensions, the least-squares fit of
``sum_i u_i y_ti^2 = 1`` therefore leaves, for post-norm states, a residual at the level of
storage rounding, and for pre-norm states a residual many times larger.

The residual is judged against the rounding noise it would have if the identity held exactly
(bf16 precision is assumed even for float32 files, since most producers compute in bf16), so
the verdict does not depend on the hidden size or on how the scale is spread over channels.

Exact for RMSNorm and for LayerNorm without bias; a LayerNorm *with* bias breaks the identity,
so such models look "pre-norm" here and need ``--lm-head`` for a definite answer. When the
per-token scale of a pre-norm stream barely varies (e.g. dominated by a few constant massive
channels) the two readings are genuinely close and the answer is "inconclusive".

A tight fit alone proves nothing when the rows hold too few distinct states: a trained model
whose attention has saturated computes nearly the same state in many contexts, and the same
prefix extracted in two batch shapes differs only in the last bits, so rows that are not
bit-identical can still be fewer distinct equations than unknowns. The fit then passes through
them whatever they are, by cancelling large positive and negative weights. A norm's weights
``1 / (H w_i^2)`` are all positive, so the identity only counts as holding when the fitted
weighted norm is made of positive terms (``negative_share``, the part of it carried by negative
weights, near zero).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

# residual / rounding noise: below HOLDS the identity holds (post-norm), above BROKEN it fails.
HOLDS = 2.0
BROKEN = 20.0
_BF16_MANTISSA_BITS = 7
# Share of the fitted weighted norm carried by negative weights above which the fit is no norm's.
NEGATIVE_SHARE_MAX = 0.05


@dataclass(frozen=True)
class NormFit:
    residual: float  # relative RMS residual of the fit
    noise: float  # the residual rounding alone would leave, same scale
    rows: int
    negative_share: float = 0.0  # part of the fitted weighted norm from negative weights

    @property
    def ratio(self) -> float:
        return self.residual / self.noise if self.noise > 0 else math.inf

    @property
    def holds(self) -> bool:
        """The rows are a norm's output: a tight fit, with a norm's (positive) weights."""
        return self.ratio < HOLDS and self.negative_share <= NEGATIVE_SHARE_MAX

    @property
    def degenerate(self) -> bool:
        """A tight fit whose weights are no norm's: too few distinct states to test anything."""
        return self.ratio < HOLDS and self.negative_share > NEGATIVE_SHARE_MAX


def rows_needed(hidden_size: int) -> int:
    """Tokens for a meaningful fit: comfortably more equations than unknowns."""
    return hidden_size + max(64, hidden_size // 8)


def norm_fit(rows: torch.Tensor) -> NormFit | None:
    """Fit ``sum_i u_i y_i^2 = 1`` over ``rows`` [N, H]; None without more distinct usable rows
    than H."""
    y = rows.float()
    good = torch.isfinite(y).all(dim=1) & (y.abs().amax(dim=1) > 0)
    # Identical rows (a prompt prefix shared by many samples, duplicate samples) are one
    # equation: counted as several they would let the fit pass through them.
    y = torch.unique(y[good], dim=0)
    n, h = y.shape
    if n <= h:
        return None
    sq = y.pow(2)
    ms = sq.mean(dim=1, keepdim=True)
    a = sq / ms  # each equation divided by its token's scale keeps the system well conditioned
    b = 1.0 / ms.squeeze(1)
    col = torch.linalg.vector_norm(a, dim=0)
    used = col > 0
    a = a[:, used] / col[used]  # a channel that is always zero constrains nothing
    # QR without pivoting ("gels") is several times faster than the default; fall back to the
    # rank-revealing solver if the system turns out rank deficient (duplicated channels).
    sol = torch.linalg.lstsq(a, b.unsqueeze(1), driver="gels").solution.squeeze(1)
    if not bool(torch.isfinite(sol).all()):
        sol = torch.linalg.lstsq(a, b.unsqueeze(1), driver="gelsy").solution.squeeze(1)
    resid = (a @ sol - b).double()
    # Each channel's term in the fitted norm, sum_i u_i y_i^2, averaged over the rows (the
    # column scaling cancels: a_i / col_i * sol_i == y_i^2 / ms * u_i).
    terms = sol * (a.mean(dim=0))
    negative = float(terms.clamp(max=0).abs().sum() / terms.abs().sum().clamp(min=1e-30))
    scale = b.double().pow(2).mean().sqrt()
    # Rounding noise each equation would have if the identity held: with p_i = u_i y_i^2 (sum 1)
    # and dy_i the rounding of y_i, d(sum u y^2) = sum 2 p_i dy_i / y_i. p is estimated as
    # y_i^2 / sum y^2 (not from the fit, which is meaningless when the identity fails). The
    # rounding step of y_i is 2^(exponent - mantissa bits), read off with frexp.
    _, exp = torch.frexp(y)
    sigma = torch.ldexp(torch.full_like(y, 1 / math.sqrt(12.0)), exp - 1 - _BF16_MANTISSA_BITS)
    noise = 2 * torch.linalg.vector_norm(y * sigma, dim=1).double() / sq.sum(dim=1).double()
    return NormFit(
        residual=float(resid.pow(2).mean().sqrt() / scale),
        noise=float(noise.pow(2).mean().sqrt()),
        rows=n,
        negative_share=negative,
    )
