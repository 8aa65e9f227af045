"""Lossy tiers: what a dataset gave up when it was written, and the arithmetic of each.

A dataset is lossless unless it was created with a tier. A tier is chosen when writing
(``hsstore.create(tier=...)``, ``hsstore extract --tier``, ``hsstore convert --tier``); the
writer then turns each sample's states into the tier's stored form before the lossless chunk
codec, and the manifest records the tier (``"tier"``: name, stored dtype, scale granularity and
error bound), so readers, inspect and exports know what they hold.

Tiers (every bound is on the values a reader gets back, dequantized to bf16, against the
values the writer was given):

- ``fp8-token``: FP8 e4m3 with one float32 scale per token across all layers, exactly
  hs-connectors 0.9's ``quantize_tensor_to_fp8`` (``hs_connectors/fp8_utils.py``, lines 29-51:
  ``scale = max(amax / 448, 1e-12)`` over a token's layers and channels, ``fp8 =
  (x.float() / scale).to(float8_e4m3fn)``; the same two lines as `hsstore.codec.fp8.quantize`), so
  its export to speculators' fp8 files is bit-exact with what hs-connectors writes.
- ``fp8-token-layer``: the same arithmetic with one scale per token and layer (a [T, L]
  scales column), which keeps layers of small magnitude out of the subnormal range.
- ``bf16-mK`` (K = 0..6): bf16 keeping K of its 7 mantissa bits, rounded to nearest even; the
  dropped bits are zeros, which the entropy coder removes.
- ``bf16-mK-final-mJ`` (0 <= K < J <= 7): ``bf16-mK`` for every layer but the verifier's state
  (`hsstore.spec.layers.verifier_position`), which keeps J bits. The verifier's state makes
  the drafter's training targets (the target's head reads it), so its rounding moves every
  label near a tie, while an aux layer's only blurs an input. Such a dataset stores each layer
  in chunks of its own by default (``layers_per_chunk`` 1): the entropy coder of a chunk that
  holds several layers sees their kept bits as one mix, and the verifier's zero bits then save
  nothing.

Error bound of a stored value x̂ against the value x given: ``|x̂ - x| <= r |x| + a s``, with
r = ``max_relative_error``, a = ``absolute_error`` and s the value's scale (1 for bf16 tiers).
For fp8: r covers e4m3's 3 mantissa bits (2^-4), the fp32 division and the two bf16 roundings
of hs-connectors' dequantization (``fp8.to(bf16) * scale.to(bf16)``); a s covers the subnormal
range (half its step, 2^-10 s). For bf16-mK: r = 2^-(K+1); a = 2^-(K+127) covers bf16's
subnormals. Non-finite values stay as they are in bf16 tiers; fp8 tiers refuse them (no
scale exists). A finite value that K bits would round past the largest finite bf16 is kept at
the largest K-bit value instead of becoming infinite.
"""

from __future__ import annotations

import re
from dataclasses import asdict, astuple, dataclass
from typing import Any

import numpy as np
import torch

from hsstore.codec import fp8
from hsstore.errors import BadInputError, FormatError, IncompatibleDatasetError

LOSSLESS = "lossless"
FP8_TOKEN = "fp8-token"
FP8_TOKEN_LAYER = "fp8-token-layer"
_BF16_NAME = re.compile(r"bf16-m([0-6])(?:-final-m([1-7]))?")
TIER_NAMES = (
    LOSSLESS,
    FP8_TOKEN,
    FP8_TOKEN_LAYER,
    *(f"bf16-m{k}" for k in range(7)),
    *(f"bf16-m{k}-final-m{j}" for k in range(7) for j in range(k + 1, 8)),
)
_NAMES_TOLD = (
    f"{LOSSLESS}, {FP8_TOKEN}, {FP8_TOKEN_LAYER}, bf16-mK (K = 0..6) "
    "or bf16-mK-final-mJ (K < J <= 7)"
)
SCALES_NONE, SCALES_TOKEN, SCALES_TOKEN_LAYER = "none", "token", "token-layer"

_BF16_ROUNDING = 2.0**-9  # half a bf16 ulp, relative
_FP32_ROUNDING = 2.0**-24
_E4M3_MANTISSA_BITS = 3
_E4M3_SUBNORMAL_HALF_STEP = 2.0**-10  # e4m3fn's subnormal step is 2^-9


@dataclass(frozen=True)
class Rounding:
    """Mantissa bits kept and the error bound that follows (r, a)."""

    mantissa_bits: int
    max_relative_error: float
    absolute_error: float  # times the value's scale (1 for unscaled tiers)

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True)
class Tier:
    """One lossy tier, as the manifest records it."""

    name: str
    dtype: str  # the stored logical dtype
    scales: str  # "none", "token" or "token-layer"
    mantissa_bits: int
    max_relative_error: float
    absolute_error: float  # times the value's scale (1 for unscaled tiers)
    final_state: Rounding | None = None  # the verifier's state's own, where it keeps more

    @property
    def scaled(self) -> bool:
        return self.scales != SCALES_NONE

    def rounding(self, position: int, final_position: int | None) -> Rounding:
        """The rounding of the layer at ``position`` of a dataset whose verifier's state is at
        ``final_position`` (`hsstore.spec.layers.verifier_position`)."""
        if self.final_state is not None and position == self.final_index(final_position):
            return self.final_state
        return Rounding(self.mantissa_bits, self.max_relative_error, self.absolute_error)

    def final_index(self, final_position: int | None) -> int:
        """``final_position``, which a tier that rounds the verifier's state apart needs."""
        if final_position is None:
            raise ValueError(f"tier {self.name} needs the position of the verifier's state")
        return final_position

    def bound(
        self, values: torch.Tensor, scales: torch.Tensor | None, final_position: int | None = None
    ) -> torch.Tensor:
        """The largest error each of ``values`` [T, L, H] may have; ``scales`` as stored
        ([T] or [T, L]) for a scaled tier; ``final_position`` where the verifier's state is
        (needed by a tier that rounds it apart)."""
        per_layer = [self.rounding(j, final_position) for j in range(values.shape[1])]
        r = torch.tensor([x.max_relative_error for x in per_layer]).view(1, -1, 1)
        a = torch.tensor([x.absolute_error for x in per_layer]).view(1, -1, 1)
        x = values.float().abs() * r
        if scales is None:
            return x + a
        return x + a * _broadcast(scales.float(), values)

    def to_json(self) -> dict[str, Any]:
        out = {
            "name": self.name,
            "dtype": self.dtype,
            "scales": self.scales,
            "mantissa_bits": self.mantissa_bits,
            "max_relative_error": self.max_relative_error,
            "absolute_error": self.absolute_error,
        }
        if self.final_state is not None:
            out["final_state"] = self.final_state.to_json()
        return out

    @classmethod
    def from_json(cls, obj: dict[str, Any], *, where: str) -> Tier:
        """The recorded tier, which must be exactly what its name defines."""
        try:
            tier = parse(obj.get("name", ""))
        except ValueError as exc:
            raise FormatError(f"manifest tier: {exc}", path=where) from None
        if tier is None or tier.to_json() != obj:
            raise FormatError(
                f"manifest tier {obj!r} is not what tier {obj.get('name')!r} records "
                f"({None if tier is None else tier.to_json()!r})",
                path=where,
            )
        return tier


def parse(name: str | None) -> Tier | None:
    """The tier called ``name`` (None for lossless); ValueError naming the known ones."""
    if name is None or name == LOSSLESS:
        return None
    if name in (FP8_TOKEN, FP8_TOKEN_LAYER):
        r = ((2.0**-_E4M3_MANTISSA_BITS / 2) * (1 + _FP32_ROUNDING) + _FP32_ROUNDING) * (
            1 + _BF16_ROUNDING
        ) ** 2 + ((1 + _BF16_ROUNDING) ** 2 - 1)
        return Tier(
            name=name,
            dtype="float8_e4m3fn",
            scales=SCALES_TOKEN if name == FP8_TOKEN else SCALES_TOKEN_LAYER,
            mantissa_bits=_E4M3_MANTISSA_BITS,
            max_relative_error=r,
            absolute_error=_E4M3_SUBNORMAL_HALF_STEP * (1 + _BF16_ROUNDING) ** 2,
        )
    match = _BF16_NAME.fullmatch(name) if isinstance(name, str) else None
    if match is None:
        raise ValueError(f"unknown tier {name!r}; expected one of {_NAMES_TOLD}")
    k = int(match.group(1))
    final = None if match.group(2) is None else _bf16_rounding(int(match.group(2)))
    if final is not None and final.mantissa_bits <= k:
        raise ValueError(
            f"tier {name!r} keeps no more bits of the final state than of the others; use bf16-m{k}"
        )
    return Tier(name, "bfloat16", SCALES_NONE, *astuple(_bf16_rounding(k)), final_state=final)


def _bf16_rounding(bits: int) -> Rounding:
    """Round to nearest even at ``bits`` mantissa bits: half an ulp relative, and bf16's
    subnormal half-step absolute."""
    return Rounding(bits, 2.0 ** -(bits + 1), 2.0 ** -(bits + 127))


def checked(name: str | None, *, option: str = "--tier") -> Tier | None:
    """`parse` for user input: an unknown name is a BadInputError naming the option."""
    try:
        return parse(name)
    except ValueError as exc:
        raise BadInputError(f"{option}: {exc}") from None


def name_of(tier: Tier | None) -> str:
    return LOSSLESS if tier is None else tier.name


def check_matches(tier: Tier | None, dtype: str, *, where: str) -> None:
    """A manifest's tier must store the manifest's dtype."""
    if tier is not None and tier.dtype != dtype:
        raise FormatError(
            f"tier {tier.name} stores {tier.dtype}, manifest says {dtype}", path=where
        )


def check_same(have: Tier | None, wanted: Tier | None, *, path: str | None) -> None:
    """Samples of one tier go into a dataset of that tier only."""
    if have != wanted:
        raise IncompatibleDatasetError(
            f"existing dataset does not match: it has tier {name_of(have)} "
            f"(asked for {name_of(wanted)})",
            path=path,
        )


# -- arithmetic --------------------------------------------------------------------------------
def _broadcast(scales: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """[T] or [T, L] scales shaped to multiply states [T, L, H] (or [T, H])."""
    return scales.reshape(like.shape[0], -1, *([1] * (like.dim() - 2)))


def round_mantissa(values: torch.Tensor, bits: int) -> torch.Tensor:
    """``values`` as bf16 keeping ``bits`` mantissa bits, rounded to nearest even from their
    float32 form (exact for bf16, fp16 and fp32 inputs: one rounding, not two)."""
    x = values.float().contiguous()
    b = x.view(torch.int32)
    drop = 23 - bits
    mask = -(1 << drop)  # the kept bits (sign, exponent, top mantissa bits)
    rounded = ((b + ((1 << (drop - 1)) - 1) + ((b >> drop) & 1)) & mask).view(torch.float32)
    finite = torch.isfinite(x)
    overflow = torch.isinf(rounded) & finite
    if bool(overflow.any()):
        rounded = torch.where(overflow, (b & mask).view(torch.float32), rounded)
    return torch.where(finite, rounded, x).to(torch.bfloat16)


def quantize(
    tier: Tier, values: torch.Tensor, final_position: int | None = None
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(stored states, float32 scales or None) of ``values`` [T, L, H] in ``tier``;
    ``final_position`` where the verifier's state is (needed by a tier that rounds it apart)."""
    if not tier.scaled:
        rounded = round_mantissa(values, tier.mantissa_bits)
        if tier.final_state is not None:
            j = tier.final_index(final_position)
            rounded[:, j] = round_mantissa(values[:, j], tier.final_state.mantissa_bits)
        return rounded, None
    if tier.scales == SCALES_TOKEN:
        return fp8.quantize(values)
    t, n_layers = values.shape[0], values.shape[1]
    states, scales = fp8.quantize(values.reshape(t * n_layers, -1))
    return states.reshape(values.shape), scales.reshape(t, n_layers)


def dequantize(
    states: torch.Tensor, scales: torch.Tensor | None, dtype: torch.dtype = torch.bfloat16
) -> torch.Tensor:
    """The values of stored ``states`` (as the loader and adapters deliver them, on the
    states' device): fp8 times its [T] or [T, L] scales, computed as hs-connectors'
    ``dequantize_fp8_tensor``; unscaled states are their own values."""
    if scales is None:
        return states
    return fp8.dequantize(states, scales, dtype)


def prepare(
    tier: Tier | None,
    hidden: Any,
    scales: Any,
    *,
    final_position: int,
    where: str,
    sample_id: str,
) -> tuple[Any, Any]:
    """What a writer of a ``tier`` dataset stores for a sample given as ``hidden`` (values of
    any float dtype, or fp8 states with ``scales``): the writer's add path calls this first.
    ``final_position``: where the dataset's verifier's state is.

    fp8 states whose scales the tier can hold as they are (per token into ``fp8-token``; per
    token, or per token and layer, into ``fp8-token-layer``) are kept bit for bit; anything
    else is dequantized and quantized into the tier. Inputs that are not float tensors are
    returned unchanged for the writer's own checks to name.
    """
    if tier is None:
        return hidden, scales
    if isinstance(hidden, np.ndarray):
        hidden = torch.from_numpy(hidden)
    if isinstance(scales, np.ndarray):
        scales = torch.from_numpy(scales)
    if (
        not isinstance(hidden, torch.Tensor)
        or not hidden.dtype.is_floating_point
        or hidden.dim() != 3
    ):
        return hidden, scales
    t, n_layers = hidden.shape[0], hidden.shape[1]
    if final_position >= n_layers:
        return hidden, scales  # the writer names the wrong layer count
    if hidden.dtype == fp8.FP8_DTYPE:
        if not isinstance(scales, torch.Tensor) or scales.dtype != torch.float32:
            return hidden, scales  # the writer refuses fp8 states without float32 scales
        per_token = scales.numel() == t
        if tier.scales == SCALES_TOKEN and per_token:
            return hidden, scales
        if tier.scales == SCALES_TOKEN_LAYER and (per_token or scales.numel() == t * n_layers):
            return hidden, scales.reshape(t, -1).expand(t, n_layers).contiguous()
        if scales.numel() not in (t, t * n_layers):
            return hidden, scales  # the writer names the wrong shape
        values = fp8.dequantize(hidden, scales.reshape(t, -1), torch.float32)
    else:
        if scales is not None:
            return hidden, scales  # the writer refuses scales beside unscaled states
        values = hidden
    if tier.scaled and not bool(torch.isfinite(values).all()):
        raise BadInputError(
            f"hidden holds NaN or Inf, which tier {tier.name} cannot scale "
            "(store it lossless, or in a bf16-mK tier, which keeps them)",
            path=where,
            sample_id=sample_id,
        )
    return quantize(tier, values, final_position)


def layers_per_chunk(tier: Tier | None, asked: int | None) -> int | None:
    """The layers per chunk of a new dataset: what was asked, else one for a tier that rounds
    the verifier's state apart (its zero bits save only in a stream of their own), else the
    layout's default (None)."""
    if asked is None and tier is not None and tier.final_state is not None:
        return 1
    return asked


def scales_width(tier: Tier | None, num_layers: int) -> int | None:
    """Scales per token row of a scaled dataset: None for one (a [rows] column), else the
    layer count (a [rows, L] column)."""
    return num_layers if tier is not None and tier.scales == SCALES_TOKEN_LAYER else None


def shape_scales(column: np.ndarray, tier: Tier | None, num_layers: int) -> np.ndarray:
    """A segment's scales column as read (flat) in its stored shape, [rows] or [rows, L]."""
    width = scales_width(tier, num_layers)
    return column.reshape(-1, width) if width and column.size % width == 0 else column


def scales_for_layers(scales: np.ndarray | None, layers: list[int] | None) -> np.ndarray | None:
    """The scales of a read of ``layers`` only: per-layer scales follow the layers picked."""
    if scales is None or layers is None or scales.ndim != 2:
        return scales
    return scales[:, layers]
