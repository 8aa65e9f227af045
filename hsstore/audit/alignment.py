"""Checks that need the model's output head: token alignment and the exact norm identity.

Pure functions over the final-layer rows inspect kept (``Collected.lm_rows``) and an
:class:`~hsstore.audit.lm_head.OutputHead`.
"""

from __future__ import annotations

from typing import Any

import torch

from hsstore.audit.collect import SHIFTS
from hsstore.audit.lm_head import UNIT_RMS_TOL, OutputHead
from hsstore.audit.verdict import CheckResult, fail, ok, skip, warn
from hsstore.spec.layers import LayerSpec

# The declared cell may trail the best one by this much before it counts as beaten (noise).
MARGIN = 0.02
# Below this best agreement the table says nothing: wrong model, or sampled at high temperature.
MEANINGFUL = 0.05


def shift_label(shift: int) -> str:
    return f"{shift:+d}" if shift else "0"


def _interp(post: bool) -> str:
    return "post_norm" if post else "pre_norm"


def agreement_table(
    head: OutputHead, rows: torch.Tensor, targets: torch.Tensor, spec: LayerSpec
) -> dict[str, Any]:
    """Next-token agreement of one final layer's rows for both norm readings and every shift.

    ``rows`` [M, H] float32; ``targets`` [M, len(SHIFTS)] token ids (-1 where out of range).
    Reading a row as post-norm feeds it to the head as is; as pre-norm applies the norm first.
    """
    preds = {True: head.argmax(rows), False: head.argmax(head.normalize(rows))}
    cells = []
    for post in (True, False):
        for k, shift in enumerate(SHIFTS):
            t = targets[:, k]
            valid = t >= 0
            n = int(valid.sum())
            agree = float((preds[post][valid] == t[valid]).float().mean()) if n else float("nan")
            cells.append(
                {
                    "interpretation": _interp(post),
                    "shift": shift,
                    "declared": post == spec.final_norm and shift == 0,
                    "agreement": agree,
                    "tokens": n,
                }
            )
    return {"layer_label": spec.label, "final_norm_declared": spec.final_norm, "cells": cells}


def check_alignment(tables: list[dict[str, Any]], layer_index: list[int]) -> CheckResult:
    """FAIL when, for some final layer, another norm reading or shift beats the declared one."""
    name = "lm_head_alignment"
    if not tables:
        return skip(name, "no stored state at the final depth, nothing to compare with lm_head")
    problems, lines, weak = [], [], []
    for idx, table in zip(layer_index, tables, strict=True):
        cells = [c for c in table["cells"] if c["agreement"] == c["agreement"]]  # drop NaN
        declared = next((c for c in cells if c["declared"]), None)
        if declared is None or not cells:
            weak.append(f"layer {idx}: no loss tokens with a next token")
            continue
        best = max(cells, key=lambda c: (c["agreement"], c["declared"]))
        desc = f"layer {idx} ({table['layer_label']})"
        if best["agreement"] < MEANINGFUL:
            weak.append(f"{desc}: best agreement {best['agreement']:.1%}")
        elif best["agreement"] - declared["agreement"] > MARGIN:
            problems.append(
                f"{desc}: declared {declared['interpretation']} shift 0 agrees "
                f"{declared['agreement']:.1%}, but {best['interpretation']} shift "
                f"{shift_label(best['shift'])} agrees {best['agreement']:.1%}"
            )
        else:
            lines.append(f"{desc}: declared alignment agrees {declared['agreement']:.1%}")
    if problems:
        return fail(name, "; ".join(problems), layers=layer_index)
    if weak:
        return warn(
            name,
            "; ".join(weak) + " (too low to judge: is MODEL_DIR the model that made these states?)",
            layers=layer_index,
        )
    return ok(name, "; ".join(lines) + ", best of all readings", layers=layer_index)


def check_norm_exact(
    head: OutputHead, rows_by_layer: dict[int, torch.Tensor], specs: list[LayerSpec]
) -> CheckResult:
    """With the norm weight known, post-norm rows satisfy RMS(state / weight) == 1 exactly."""
    name = "final_norm_exact"
    if not rows_by_layer:
        return skip(name, "no stored state at the final depth")
    bad, good, details = [], [], {}
    for idx, rows in rows_by_layer.items():
        rows = rows[torch.isfinite(rows).all(dim=1)]
        if rows.shape[0] == 0:
            continue
        frac = float(((head.unit_rms(rows) - 1).abs() < UNIT_RMS_TOL).float().mean())
        details[str(idx)] = {"unit_rms_fraction": frac, "rows": int(rows.shape[0])}
        declared_post = specs[idx].final_norm
        desc = f"layer {idx} ({specs[idx].label})"
        if declared_post and frac < 0.5:
            bad.append(f"{desc} is declared post-norm but only {frac:.0%} of rows have unit RMS "
                       "after dividing by the norm weight (pre-norm states?)")  # fmt: skip
        elif not declared_post and frac >= 0.5:
            bad.append(f"{desc} is declared pre-norm but {frac:.0%} of rows have unit RMS "
                       "after dividing by the norm weight, as post-norm states do")  # fmt: skip
        else:
            good.append(f"{desc}: {frac:.0%} unit-RMS rows, consistent with its declaration")
    if bad:
        return fail(name, "; ".join(bad), layers=details)
    if not good:
        return skip(name, "no finite final-layer rows were read")
    return ok(name, "; ".join(good), layers=details)
