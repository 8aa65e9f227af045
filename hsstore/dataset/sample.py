"""`Sample`: what a read of one sample returns."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from hsstore.codec import fp8


@dataclass(frozen=True)
class Sample:
    """One sample: token ids, loss mask and hidden states [T, num_layers, H] as stored.

    In a ``float8_e4m3fn`` dataset ``hidden`` holds the fp8 states and ``scales`` their float32
    per-token scales [T] ([T, L] in the fp8-token-layer tier; None for every other dtype);
    `dequantized` gives the values.
    """

    sample_id: str
    input_ids: torch.Tensor
    loss_mask: torch.Tensor
    hidden: torch.Tensor
    scales: torch.Tensor | None = None

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[0])

    def dequantized(self, dtype: torch.dtype = fp8.DEQUANTIZED_DTYPE) -> torch.Tensor:
        """The states as values: fp8 ones as speculators' trainer computes them (hs-connectors'
        ``fp8.to(dtype) * scale.to(dtype)``, bf16 by default, bit for bit); the states of any
        other dtype are returned as stored (``dtype`` does not apply to them)."""
        if self.scales is None:
            return self.hidden
        return fp8.dequantize(self.hidden, self.scales, dtype)
