"""Packed loader batches in EAGLE's alignment, and which draft steps each position may score.

The loader packs samples unshifted, as stored. EAGLE pairs the feature of position t with the
token of position t+1, so each packed document loses its first token (for tokens and targets)
and its last feature (for the aux states). Done per document, never across two. After
alignment, step s at position i drafts the token at position i+s+1; it counts only if that token
is a loss token of the same document.
"""

from __future__ import annotations

import torch


def align_batch(batch: dict) -> dict:
    """[1, T] packed loader batch -> the EAGLE-aligned view, [1, T - n_docs]."""
    doc = batch["document_ids"][0]
    boundary = doc[1:] != doc[:-1]
    first = torch.cat([boundary.new_ones(1), boundary])  # first token of each document
    last = torch.cat([boundary, boundary.new_ones(1)])  # last token of each document
    out = {
        "input_ids": batch["input_ids"][:, ~first],
        "aux": batch["hidden_states"][:, ~last],
        "loss_mask": batch["loss_mask"][:, ~first],
        "position_ids": batch["position_ids"][:, ~first],
        "document_ids": doc[~first],
    }
    if "verifier_last_hidden_states" in batch:
        out["verifier"] = batch["verifier_last_hidden_states"][:, ~first]
    return out


def step_validity(view: dict, steps: int) -> list[torch.Tensor]:
    doc, mask = view["document_ids"], view["loss_mask"][0].bool()
    t = len(doc)
    valid = []
    for s in range(steps):
        j = s + 1
        ok = torch.zeros(t, dtype=torch.bool, device=doc.device)
        if j < t:
            ok[:-j] = (doc[j:] == doc[:-j]) & mask[j:] & (doc[:-j] >= 0)
        valid.append(ok)
    return valid


def shift_left(x: torch.Tensor, n: int) -> torch.Tensor:
    """x[i + n] at position i along dim 0 (zeros past the end)."""
    if n == 0:
        return x
    return torch.cat([x[n:], x.new_zeros((n, *x.shape[1:]))])
