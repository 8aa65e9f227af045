"""``--check-against BACKEND``: extract the same prompts with a second backend and compare.

This is how a user validates a model (or an SGLang release) hsstore was not tested with: the
first samples are extracted by both backends and every stored layer is compared. A wrong layer
id is off by a whole layer, which is far more than two backends' kernel differences, so the
verdict asks two things of every layer: the worst relative error over the samples is within
``tolerance``, and it is less than half the distance from the reference layer to any *other*
stored layer of the same sample (what a wrong layer would cost).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

import hsstore

DEFAULT_TOLERANCE = 0.05  # relative error of bf16 kernels on a real model is ~1e-2


def compare_datasets(ref_dir: str | Path, other_dir: str | Path) -> dict[str, Any]:
    """Per stored layer: worst relative error and worst cosine over the shared samples, and how
    far apart the reference's own layers are."""
    ref, other = hsstore.open(ref_dir), hsstore.open(other_dir)
    shared = sorted(set(ref.sample_ids) & set(other.sample_ids))
    labels = [s.label for s in ref.layers]
    worst_rel = [0.0] * len(labels)
    worst_cos = [1.0] * len(labels)
    separation = [float("inf")] * len(labels)
    tokens_equal = True

    def rel(x: torch.Tensor, y: torch.Tensor) -> float:
        return ((x - y).norm() / x.norm().clamp_min(1e-12)).item()

    for sid in shared:
        a, b = ref.get(sid), other.get(sid)
        same = torch.equal(a.input_ids, b.input_ids) and torch.equal(a.loss_mask, b.loss_mask)
        tokens_equal &= same
        if not same:
            continue
        for j in range(len(labels)):
            x, y = a.hidden[:, j].float(), b.hidden[:, j].float()
            worst_rel[j] = max(worst_rel[j], rel(x, y))
            cos = torch.nn.functional.cosine_similarity(x, y, dim=-1).min().item()
            worst_cos[j] = min(worst_cos[j], cos)
            for k in range(len(labels)):
                if k != j:
                    separation[j] = min(separation[j], rel(x, a.hidden[:, k].float()))
    return {
        "samples": len(shared),
        "layers": labels,
        "max_rel_err": worst_rel,
        "min_cosine": worst_cos,
        "min_rel_distance_to_other_layers": separation,
        "tokens_and_masks_equal": bool(tokens_equal),
    }


def verdict(report: dict[str, Any], tolerance: float = DEFAULT_TOLERANCE) -> dict[str, Any]:
    """Add ``ok`` and one reason per failing layer to a :func:`compare_datasets` report."""
    problems = []
    if report["samples"] == 0:
        problems.append("no sample was extracted by both backends")
    if not report["tokens_and_masks_equal"]:
        problems.append("the backends tokenised some samples differently")
    for label, err, sep in zip(
        report["layers"], report["max_rel_err"], report["min_rel_distance_to_other_layers"]
    ):
        if err > tolerance:
            problems.append(f"{label}: relative error {err:.3g} > tolerance {tolerance:g}")
        if err >= 0.5 * sep:
            problems.append(
                f"{label}: relative error {err:.3g} is not below half the distance to another "
                f"stored layer ({sep:.3g}): a wrong layer?"
            )
    return {**report, "tolerance": tolerance, "ok": not problems, "problems": problems}
