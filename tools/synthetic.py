"""LLM-like synthetic hidden states, for tests and benchmarks.

Real residual streams are not uniform noise: most channels are roughly Gaussian with a scale
that grows with depth, and a few "massive activation" channels carry magnitudes in the
hundreds on most tokens (Sun et al., 2024). Both matter for compression ratio and for the
audit checks, so the generator reproduces them.
"""

from __future__ import annotations

import torch


def llm_like_states(
    num_tokens: int,
    num_layers: int,
    hidden_size: int,
    *,
    dtype: torch.dtype = torch.bfloat16,
    seed: int = 0,
    massive_channels: int = 4,
) -> torch.Tensor:
    """States [T, L, H]: depth-growing Gaussian channels plus a few massive channels."""
    g = torch.Generator().manual_seed(seed)
    depth_scale = torch.linspace(0.5, 4.0, num_layers).view(1, num_layers, 1)
    channel_scale = torch.exp(torch.randn(hidden_size, generator=g) * 0.5).view(1, 1, hidden_size)
    x = torch.randn(num_tokens, num_layers, hidden_size, generator=g) * depth_scale * channel_scale
    k = min(massive_channels, hidden_size)
    channels = torch.randperm(hidden_size, generator=g)[:k]
    magnitude = 100.0 + 400.0 * torch.rand(k, generator=g)
    sign = torch.where(torch.rand(k, generator=g) < 0.5, -1.0, 1.0)
    x[:, 1:, channels] = (magnitude * sign).view(1, 1, k) * (
        1.0 + 0.05 * torch.randn(num_tokens, max(num_layers - 1, 0), k, generator=g)
    )
    return x.to(dtype)


def random_sample(
    num_tokens: int, num_layers: int, hidden_size: int, *, vocab: int = 32000, seed: int = 0,
    dtype: torch.dtype = torch.bfloat16,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:  # fmt: skip
    """(input_ids int64 [T], loss_mask int64 [T], hidden [T, L, H]) for one synthetic sample."""
    g = torch.Generator().manual_seed(seed + 1_000_003)
    ids = torch.randint(0, vocab, (num_tokens,), generator=g)
    mask = torch.zeros(num_tokens, dtype=torch.long)
    mask[num_tokens // 3 :] = 1
    return ids, mask, llm_like_states(num_tokens, num_layers, hidden_size, dtype=dtype, seed=seed)
