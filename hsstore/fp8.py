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
    return torch.mul(fp8.to(dtype), scale, out=out)
