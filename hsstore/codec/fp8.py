"""FP8 hidden states with one float32 scale per token, with hs-connectors 0.9's arithmetic.

hs-connectors' ``FP8HiddenStatesConnector`` writes ``hidden_states`` as ``float8_e4m3fn`` plus
``hidden_states_scales`` float32 [T, 1, 1] (``hs_connectors/fp8_utils.py``
``quantize_tensor_to_fp8``: scale = max(amax / 448, 1e-12) over a token's layers and channels),
and speculators' trainer reads them through ``FP8Transfer`` (``hs_connectors/transfer.py``),
which returns ``fp8.to(bf16) * scale.to(bf16)`` (``fp8_utils.py`` ``dequantize_fp8_tensor``
with the default ``dequantize_dtype=torch.bfloat16``). hsstore stores the fp8 bits and the scales
as they are (a dataset of dtype ``float8_e4m3fn``, scales in a per-token column) and computes
the trainer's values with the same two operations here, so they match bit for bit.
"""

from __future__ import annotations

import numpy as np
import torch

FP8_DTYPE = torch.float8_e4m3fn
# What speculators' trainer sees: FP8Transfer.__init__'s default dequantize_dtype.
DEQUANTIZED_DTYPE = torch.bfloat16


def quantize(hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(fp8 states, float32 scales [T]) of ``hidden`` [T, ...], exactly as hs-connectors'
    ``quantize_tensor_to_fp8`` computes them (its scale is the same values shaped [T, 1, ...])."""
    fp32 = hidden.float()
    amax = fp32.abs().amax(dim=tuple(range(1, fp32.dim())), keepdim=True)
    scale = (amax / torch.finfo(FP8_DTYPE).max).clamp(min=1e-12)
    return (fp32 / scale).to(FP8_DTYPE), scale.reshape(-1)


def dequantize(
    fp8: torch.Tensor,
    scales: torch.Tensor,
    dtype: torch.dtype = DEQUANTIZED_DTYPE,
    *,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """``fp8.to(dtype) * scale.to(dtype)`` per token: hs-connectors' ``dequantize_fp8_tensor``.

    ``fp8`` is [T, ...] and ``scales`` holds T values (any shape, e.g. [T] or [T, 1, 1]), or
    one per token and layer ([T, L] for [T, L, H] states: the fp8-token-layer tier).
    """
    scale = scales.reshape(fp8.shape[0], -1, *([1] * (fp8.dim() - 2))).to(dtype)
    if _by_table(fp8, scale, out):
        return _dequantize_by_table(fp8, scale, out)
    return torch.mul(fp8.to(dtype), scale, out=out)


# On the CPU torch converts fp8 at a few hundred MB/s; a table of the 256 products per scale
# gives the same bits several times faster. Both compute round_bf16(float(code) *
# float(scale_bf16)): the product of an e4m3 and a bf16 significand (4 and 8 bits) is exact in
# float32, so one rounding to bf16 is all either does (the same rounding, to nearest even).
# Rows shorter than this pay more for the Python loop over rows than they save.
_TABLE_MIN_ROW = 1024
_TABLE_BLOCK = 1 << 16  # codes per lookup of a block of short rows


def _by_table(fp8: torch.Tensor, scale: torch.Tensor, out: torch.Tensor | None) -> bool:
    """Whether ``fp8 * scale`` (scale [T, S, 1, ...] in bf16) may take the table path."""
    rows = scale.numel()
    return (
        fp8.device.type == "cpu"
        and fp8.dtype == FP8_DTYPE
        and scale.dtype == torch.bfloat16
        and fp8.is_contiguous()
        and rows > 0
        and fp8.numel() // rows >= _TABLE_MIN_ROW
        and (scale.dim() < 2 or scale.shape[1] in (1, fp8.shape[1]))
        and (
            out is None
            or (out.dtype == torch.bfloat16 and out.is_contiguous() and out.shape == fp8.shape)
        )
    )


def _dequantize_by_table(
    fp8: torch.Tensor, scale: torch.Tensor, out: torch.Tensor | None
) -> torch.Tensor:
    """`dequantize` on the CPU: each row of codes that shares one scale looks its values up in
    that scale's 256 products."""
    out = torch.empty(fp8.shape, dtype=torch.bfloat16) if out is None else out
    rows = scale.numel()
    products = (_CODE_VALUES[None, :] * scale.reshape(rows, 1).float()).to(torch.bfloat16)
    table = products.view(torch.int16).numpy()
    codes = fp8.view(torch.uint8).reshape(rows, -1).numpy()
    values = out.view(torch.int16).reshape(rows, -1).numpy()
    block = max(1, _TABLE_BLOCK // codes.shape[1])  # rows per lookup: few calls, cached index
    if block == 1:
        for r in range(rows):
            np.take(table[r], codes[r], out=values[r], mode="clip")  # clip: no bounds pass
        return out
    flat, offsets = table.reshape(-1), np.arange(0, rows * 256, 256, dtype=np.intp)[:, None]
    for r in range(0, rows, block):
        index = codes[r : r + block] + offsets[r : r + block]  # row r's table starts at 256 r
        np.take(flat, index, out=values[r : r + block], mode="clip")
    return out


_CODE_VALUES = torch.arange(256, dtype=torch.uint8).view(FP8_DTYPE).float()
