"""Turning a batch of fp8 states into the bf16 values a trainer reads, where the batch goes.

A batch of a scaled dataset (``fp8-token``, ``fp8-token-layer``) is decoded in its stored form:
fp8 states plus float32 scales (`collate.RawBatch.scales`), half the bytes of bf16 values.
Bound for a GPU it crosses PCIe in that form and is dequantized there, after the copy; on the
CPU it is dequantized once per batch, into host buffers. Both run `dequantize_batch`, whose
arithmetic is `hsstore.codec.fp8.dequantize` (hs-connectors' ``fp8.to(bf16) * scale.to(bf16)``), so
the values are bit for bit those of `Sample.dequantized` whatever the device.
"""

from __future__ import annotations

import dataclasses

import torch

from hsstore.codec import fp8
from hsstore.loader.collate import RawBatch


def dequantize_batch(raw: RawBatch, out: torch.Tensor | None = None) -> RawBatch:
    """``raw`` with values (bf16) for its fp8 states, on ``raw``'s device, into ``out``
    ([B, T, L', H] there) if given; a batch without scales is returned as it is."""
    if raw.scales is None:
        return raw
    b, t, n_layers, h = raw.hidden.shape
    flat_out = None if out is None else out.view(b * t, n_layers, h)
    values = fp8.dequantize(
        raw.hidden.reshape(b * t, n_layers, h), raw.scales.reshape(b * t, -1), out=flat_out
    )
    return dataclasses.replace(raw, hidden=values.view(b, t, n_layers, h), scales=None)


def to_device(raw: RawBatch, device: torch.device, non_blocking: bool = False) -> RawBatch:
    """``raw`` copied to ``device`` as it is (stored form: fp8 and scales), then dequantized
    there."""
    return dequantize_batch(raw.to(device, non_blocking=non_blocking))
