"""The model-free checks: pure functions from collected statistics to a verdict and one line.

Each check names the fault it looks for in the terms a user would search for (padding,
a layer captured twice, off-by-one lengths), and lists the first offending sample ids.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from hsstore.audit.collect import SampleRecord
from hsstore.audit.norm_fit import BROKEN, HOLDS, norm_fit, rows_needed
from hsstore.audit.verdict import CheckResult, Verdict, fail, ok, skip, warn
from hsstore.spec.layers import LayerSpec, verifier_position

SHOW = 5  # sample ids quoted in a reason line
# Relative distance below which two stored layers count as "nearly identical".
NEAR_IDENTICAL = 1e-3
SUSPICIOUS = 1e-2
# A deeper layer's median per-token RMS may dip this much below a shallower one's.
RMS_DROP_TOLERANCE = 0.9
# Share of samples with an empty loss mask that is still only a warning.
EMPTY_MASK_WARN_SHARE = 0.01


def _ids(ids: Sequence[str]) -> str:
    more = f" (+{len(ids) - SHOW} more)" if len(ids) > SHOW else ""
    return ", ".join(repr(s) for s in ids[:SHOW]) + more


def check_readable(
    records: list[SampleRecord], left_out: str | None = None, rebuilt: str | None = None
) -> CheckResult:
    """Every sample chosen for reading decodes (corrupt bytes and malformed files fail here),
    and no committed sample is left out of the view (a segment whose index cannot be read)."""
    if left_out is not None:
        return fail("samples_readable", left_out)
    if not records:
        return skip("samples_readable", "no samples to read")
    bad = [r for r in records if r.error is not None]
    if not bad and rebuilt is not None:
        return warn("samples_readable", f"all {len(records)} samples read decoded; {rebuilt}")
    if not bad:
        return ok("samples_readable", f"all {len(records)} samples read decoded cleanly")
    first = bad[0]
    return fail(
        "samples_readable",
        f"{len(bad)} of {len(records)} samples could not be read, e.g. {first.sample_id!r}: "
        f"{first.error}",
        samples=[{"sample_id": r.sample_id, "error": r.error} for r in bad],
    )


def check_nonfinite(summaries: list[dict[str, Any]], write_stats: list[Any] | None) -> CheckResult:
    """Any NaN or Inf poisons training; write-time counts cover the whole dataset exactly."""
    name = "nonfinite"
    per_layer = []
    for i, s in enumerate(summaries):
        whole = write_stats[i].nonfinite_rows if write_stats else 0
        if s["nan"] or s["inf"] or s["nonfinite_rows"] or whole:
            per_layer.append(
                f"layer {i}: {s['nan']} NaN, {s['inf']} Inf in read rows"
                + (f", {whole} non-finite rows in the whole dataset" if whole else "")
            )
    if per_layer:
        return fail(name, "; ".join(per_layer))
    scope = "whole dataset (write-time counts) and read rows" if write_stats else "read rows"
    return ok(name, f"no NaN or Inf in the {scope}")


def check_padding_rows(
    summaries: list[dict[str, Any]], write_stats: list[Any] | None
) -> CheckResult:
    """All-zero or constant rows are padding or unwritten buffers, never real states."""
    name = "zero_or_constant_rows"
    found = []
    for i, s in enumerate(summaries):
        whole = write_stats[i].zero_rows if write_stats else 0
        if s["zero_rows"] or s["constant_rows"] or whole:
            found.append(
                f"layer {i}: {s['zero_rows']} zero and {s['constant_rows']} constant rows read"
                + (f", {whole} zero rows in the whole dataset" if whole else "")
            )
    if found:
        return fail(name, "; ".join(found) + " (padding or unwritten rows?)")
    return ok(name, "no all-zero or constant rows")


def check_duplicate_layers(pairs: list[dict[str, Any]], specs: list[LayerSpec]) -> CheckResult:
    """Two stored layers that are (nearly) equal mean one layer was captured twice."""
    name = "duplicate_layers"
    same = [p for p in pairs if p["bit_identical"] or p["relative_distance"] < NEAR_IDENTICAL]
    close = [p for p in pairs if p not in same and p["relative_distance"] < SUSPICIOUS]

    def desc(p: dict[str, Any]) -> str:
        how = (
            "bit-identical"
            if p["bit_identical"]
            else f"relative distance {p['relative_distance']:.1e}"
        )
        return f"layers {p['a']} ({specs[p['a']].label}) and {p['b']} ({specs[p['b']].label}) {how}"

    if same:
        return fail(name, "; ".join(desc(p) for p in same) + " (one layer captured twice?)")
    if close:
        return warn(name, "; ".join(desc(p) for p in close))
    measured = [p for p in pairs if not math.isnan(p["relative_distance"])]
    if not measured:
        return skip(name, "only one stored layer" if not pairs else "no rows read")
    nearest = min(measured, key=lambda p: p["relative_distance"])
    return ok(name, f"closest pair: {desc(nearest)}")


def _groups(pairs: Sequence[tuple[str, str]]) -> list[list[str]]:
    by: dict[str, list[str]] = defaultdict(list)
    for sid, digest in pairs:
        by[digest].append(sid)
    return [g for g in by.values() if len(g) > 1]


def check_duplicate_samples(
    ids_hashes: Sequence[tuple[str, str]], states_hashes: Sequence[tuple[str, str]], scope: str
) -> CheckResult:
    """The same token sequence (or the same states) stored twice skews training.

    ``ids_hashes`` / ``states_hashes``: (sample id, content digest) of the samples examined.
    """
    name = "duplicate_samples"
    groups = _groups(ids_hashes)
    state_groups = [g for g in _groups(states_hashes) if not any(set(g) <= set(h) for h in groups)]
    if groups or state_groups:
        parts = [f"same tokens: {_ids(g)}" for g in groups]
        parts += [f"same states: {_ids(g)}" for g in state_groups]
        extra = sum(len(g) - 1 for g in groups + state_groups)
        return fail(name, f"{extra} duplicate samples; " + "; ".join(parts[:3]),
                    groups=groups, state_groups=state_groups)  # fmt: skip
    return ok(name, f"no duplicate samples ({scope})")


def check_empty_loss_masks(
    sample_ids: Sequence[str], loss_tokens: np.ndarray, scope: str
) -> CheckResult:
    """Samples without a single loss token train nothing; many of them mean a broken mask."""
    name = "empty_loss_masks"
    if len(sample_ids) == 0:
        return skip(name, "no samples")
    empty = [sid for sid, n in zip(sample_ids, loss_tokens, strict=True) if n == 0]
    if not empty:
        return ok(name, f"every sample has loss tokens ({scope})")
    share = len(empty) / len(sample_ids)
    line = (
        f"{len(empty)} of {len(sample_ids)} samples ({share:.1%}) have no loss token: {_ids(empty)}"
    )
    if share <= EMPTY_MASK_WARN_SHARE and len(empty) < len(sample_ids):
        return warn(name, line, samples=empty)
    return fail(name, line + " (mask built on the wrong template or truncated?)", samples=empty)


def check_lengths(records: list[SampleRecord]) -> CheckResult:
    """input_ids, loss_mask, state rows (and the index) must count the same tokens."""
    name = "lengths"
    bad = [r for r in records if r.error is None and not r.lengths_agree]
    read = sum(r.error is None for r in records)
    if not read:
        return skip(name, "no samples read")
    if not bad:
        return ok(name, f"ids, mask and state rows agree in all {read} samples read")
    r = bad[0]
    return fail(
        name,
        f"{len(bad)} samples disagree, e.g. {r.sample_id!r}: {r.num_ids} ids, {r.num_mask} mask, "
        f"{r.num_rows} state rows"
        + (f", index says {r.expected_tokens}" if r.expected_tokens else ""),
        samples=[b.sample_id for b in bad],
    )


def check_vocab(
    extremes: Sequence[tuple[str, int, int]], vocab_size: int | None, scope: str
) -> CheckResult:
    """Token ids outside [0, vocab_size) mean the wrong tokenizer or corrupted ids.

    ``extremes``: (sample id, min id, max id) of the samples examined.
    """
    name = "token_ids_in_vocab"
    if not vocab_size:
        return skip(name, "the dataset does not record the model's vocab_size")
    bad = [sid for sid, lo, hi in extremes if hi >= vocab_size or lo < 0]
    if bad:
        top = max(hi for _, _, hi in extremes)
        return fail(name, f"{len(bad)} samples hold ids outside [0, {vocab_size}) (max id {top}): "
                    f"{_ids(bad)}", samples=bad)  # fmt: skip
    return ok(name, f"all ids are in [0, {vocab_size}) ({scope})")


def check_depth_order(
    summaries: list[dict[str, Any]], specs: list[LayerSpec], num_hidden_layers: int | None
) -> CheckResult:
    """The residual stream grows with depth, so per-token RMS must not fall as depth rises.

    The median per-token RMS is used, not the pooled RMS, so a few massive-activation tokens
    (BOS, delimiters) cannot decide the order.
    """
    name = "depth_order"
    declared = []
    if num_hidden_layers is not None:
        for i, s in enumerate(specs):
            if s.depth > num_hidden_layers:
                declared.append(
                    f"layer {i} has depth {s.depth} > num_hidden_layers {num_hidden_layers}"
                )
            if s.final_norm and s.depth != num_hidden_layers:
                declared.append(
                    f"layer {i} claims final_norm at depth {s.depth}, not the last layer"
                )
    if declared:
        return fail(name, "; ".join(declared))
    residual = sorted(
        (s.depth, i)
        for i, s in enumerate(specs)
        if not s.final_norm and not math.isnan(summaries[i]["token_rms_median"])
    )
    rms = {i: summaries[i]["token_rms_median"] for _, i in residual}
    if len(residual) < 2:
        return skip(name, "fewer than two pre-norm layers with rows read to compare")
    drops = []
    for (d0, a), (d1, b) in zip(residual, residual[1:], strict=False):
        comparable = d1 > d0 and not (math.isnan(rms[a]) or math.isnan(rms[b]))
        if comparable and rms[b] < RMS_DROP_TOLERANCE * rms[a]:
            drops.append(f"depth {d1} (layer {b}) RMS {rms[b]:.3g} < depth {d0} (layer {a}) "
                         f"RMS {rms[a]:.3g}")  # fmt: skip
    seq = ", ".join(f"{specs[i].depth}:{rms[i]:.3g}" for _, i in residual)
    if drops:
        return fail(
            name, "; ".join(drops) + " (layers stored in the wrong order?)", rms_by_depth=seq
        )
    return ok(name, f"median token RMS grows with depth ({seq})")


def check_model_depth(
    specs: list[LayerSpec], recorded: int | None, model_layers: int | None
) -> CheckResult:
    """Do the stored depths fit the model given with --lm-head? A wrong --num-hidden-layers at
    import (e.g. 32 for an 8-layer model) labels the final state "after 32" and nothing else
    in the data can tell."""
    name = "model_depth"
    if model_layers is None:
        return skip(name, "pass --lm-head MODEL_DIR (with num_hidden_layers in its config.json)")
    deepest = specs[verifier_position(specs)]
    if recorded not in (None, model_layers) or deepest.depth > model_layers:
        n = recorded if recorded is not None else deepest.depth
        return fail(name, f"the dataset's final state is labelled {deepest.label} of {n} "
                    f"decoder layers, but the model has {model_layers}: re-convert with "
                    f"--num-hidden-layers {model_layers}")  # fmt: skip
    return ok(name, f"depths fit the model's {model_layers} decoder layers")


def check_final_norm(
    fit_rows: dict[int, torch.Tensor], specs: list[LayerSpec], hidden_size: int
) -> CheckResult:
    """Does each final-depth state's scale match its declared norm? (see norm_fit)."""
    name = "final_norm"
    if not fit_rows:
        return skip(name, "no stored state at the final depth")
    bad, unsure, good, short, details = [], [], [], [], {}
    for idx, rows in fit_rows.items():
        spec = specs[idx]
        desc = f"layer {idx} ({spec.label})"
        fit = norm_fit(rows) if rows.shape[0] > hidden_size else None
        if fit is None:
            short.append(
                f"{desc}: {rows.shape[0]} rows read, the fit needs {rows_needed(hidden_size)}"
            )
            continue
        details[str(idx)] = {"fit_residual": fit.residual, "rounding_noise": fit.noise,
                             "ratio": fit.ratio, "rows": fit.rows,
                             "negative_share": fit.negative_share}  # fmt: skip
        how = f"norm-identity fit residual {fit.ratio:.3g}x rounding noise"
        if fit.degenerate:
            short.append(f"{desc}: the fit passes through its {fit.rows} distinct rows only with "
                         f"negative weights ({fit.negative_share:.0%} of the fitted norm), so they "
                         "hold too few distinct states to test the identity")  # fmt: skip
        elif spec.final_norm and fit.ratio > BROKEN:
            bad.append(f"{desc} is declared post-norm but no norm weight explains its row "
                       f"scales ({how}): pre-norm states?")  # fmt: skip
        elif not spec.final_norm and fit.holds:
            bad.append(f"{desc} is declared pre-norm but its rows satisfy an RMSNorm identity "
                       f"({how}, positive weights): post-norm states?")  # fmt: skip
        elif HOLDS <= fit.ratio <= BROKEN:
            unsure.append(f"{desc}: {how} is inconclusive (per-token scale barely varies)")
        else:
            good.append(f"{desc}: {how}, as its declaration implies")
    if bad:
        return fail(name, "; ".join(bad), layers=details)
    if unsure:
        return warn(name, "; ".join(unsure) + "; use --lm-head for an exact answer", layers=details)
    if not good:
        return skip(name, "; ".join(short) + " (raise --sample, or use --lm-head)", layers=details)
    return ok(name, "; ".join(good), layers=details)


def reconcile_final_norm(weight_free: CheckResult, exact: CheckResult) -> CheckResult:
    """``final_norm`` as reported once ``final_norm_exact`` (the model's own norm weight) has
    spoken: the weight-free fit is a heuristic, and a trained model's pre-norm states can keep a
    nearly constant weighted norm, which the fit mistakes for a norm's output; the exact test
    cannot be fooled that way, so where it confirms the declaration its answer stands."""
    if exact.verdict is not Verdict.OK or weight_free.verdict not in (Verdict.FAIL, Verdict.WARN):
        return weight_free
    return ok(weight_free.name, f"{exact.reason} (final_norm_exact, with the model's norm "
              f"weight; the weight-free fit alone said: {weight_free.reason})",
              **weight_free.details)  # fmt: skip
