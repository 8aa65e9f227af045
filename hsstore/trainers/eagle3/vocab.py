"""The reduced draft vocabulary and its maps to and from the target vocabulary.

EAGLE-3 drafts over the D most frequent target tokens (D = 32k for a 128k-vocabulary Llama 3):
the LM head and its softmax shrink by the ratio V/D, and the tokens left out are rare enough
that the draft would almost never propose them correctly anyway. Frequencies come from the
training data itself, counting the tokens the draft will be asked to predict (loss tokens).

The maps use the layout of published EAGLE-3 checkpoints, read by SGLang and vLLM:
``d2t[d]`` is the offset to add to draft id d to get its target id, and ``t2d[t]`` is True where
target token t is in the draft vocabulary. Draft ids keep target order, so d2t is non-negative
and non-decreasing.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import torch


@dataclass
class VocabMaps:
    d2t: torch.Tensor  # int64 [D]: target_id = draft_id + d2t[draft_id]
    t2d: torch.Tensor  # bool [V]: target token is in the draft vocabulary

    @property
    def draft_to_target(self) -> torch.Tensor:
        """int64 [D]: the target id of each draft id."""
        return torch.arange(len(self.d2t), device=self.d2t.device) + self.d2t

    @property
    def target_to_draft(self) -> torch.Tensor:
        """int64 [V]: the draft id of each target id, -1 where the token has none."""
        index = torch.cumsum(self.t2d.long(), 0) - 1
        return torch.where(self.t2d, index, torch.full_like(index, -1))


def count_tokens(samples: Iterable[tuple[torch.Tensor, torch.Tensor]], vocab_size: int):
    """Count token ids over (input_ids, loss_mask) pairs, at loss positions only.

    A sample with no loss token at all (e.g. a dataset without masks) counts every token,
    so an unmasked dataset still yields a sensible vocabulary.
    """
    counts = torch.zeros(vocab_size, dtype=torch.long)
    for input_ids, loss_mask in samples:
        ids = input_ids.reshape(-1).long()
        mask = loss_mask.reshape(-1).bool()
        if mask.any():
            ids = ids[mask]
        counts += torch.bincount(ids, minlength=vocab_size)[:vocab_size]
    return counts


def build_vocab_maps(counts: torch.Tensor, draft_vocab_size: int) -> VocabMaps:
    """Keep the ``draft_vocab_size`` most frequent tokens (ties: lower id first)."""
    vocab_size = len(counts)
    d = min(draft_vocab_size, vocab_size)
    # A stable sort on -count keeps ids in ascending order among equal counts: deterministic.
    order = torch.sort(-counts.long(), stable=True).indices[:d]
    draft_to_target = torch.sort(order).values
    t2d = torch.zeros(vocab_size, dtype=torch.bool)
    t2d[draft_to_target] = True
    return VocabMaps(d2t=draft_to_target - torch.arange(d), t2d=t2d)


def dataset_token_counts(ds, vocab_size: int, max_samples: int | None = None) -> torch.Tensor:
    """Token counts of an hsstore dataset: all samples, or ``max_samples`` spread evenly.

    ``ds.read_tokens`` decodes no hidden state, so counting costs a few bytes per token.
    """
    n = len(ds)
    if max_samples and max_samples < n:
        positions = torch.linspace(0, n - 1, max_samples).round().long().unique().tolist()
    else:
        positions = range(n)
    return count_tokens((ds.read_tokens(i) for i in positions), vocab_size)
