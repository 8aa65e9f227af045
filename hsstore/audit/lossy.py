"""What a lossy tier cost: inspect's report of a dataset's tier against a reference.

Per stored layer: the tier's error bound (``|x̂ - x| <= r |x| + a s``, `hsstore.codec.tiers`)
and, when a reference dataset holding the same samples at full precision is given, the error
measured on the values a trainer reads (bf16, dequantized) against the reference's:

- ``rms_relative_error``: ||x̂ - x|| / ||x|| over the layer's values read;
- ``max_relative_error``: max |x̂ - x| / |x| over values in the tier's relative range (where
  ``r |x| >= a s``; below it the absolute part of the bound rules);
- ``max_bound_use``: max |x̂ - x| / (r |x| + a s); at most 1 when the bound holds.

With the target's output head (``--lm-head``): how often the head's top-1 token on the stored
final state equals its top-1 on the reference's state (final norm applied to a state stored
before it), over up to ``lm_tokens`` tokens read.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from hsstore.audit.inputs import AuditSource, HsstoreSource
from hsstore.audit.lm_head import OutputHead, load_output_head
from hsstore.audit.run import AuditOptions
from hsstore.audit.run import _final_layers as final_layers
from hsstore.codec.tiers import Tier, name_of
from hsstore.dataset.dataset import Dataset
from hsstore.errors import BadInputError
from hsstore.spec.layers import verifier_position


def _bound_of(tier: Tier | None, position: int, final_position: int) -> tuple[float, float]:
    """(r, a) of the layer at ``position``; a lossless dataset is bound to no error at all."""
    if tier is None:
        return 0.0, 0.0
    rounding = tier.rounding(position, final_position)
    return rounding.max_relative_error, rounding.absolute_error


def _check_same_states(ds: Dataset, ref: Dataset) -> None:
    mine = [(s.depth, s.final_norm) for s in ds.layers]
    if mine != [(s.depth, s.final_norm) for s in ref.layers] or ds.hidden_size != ref.hidden_size:
        raise BadInputError(
            "--reference stores other states (layers or hidden size differ) than the dataset",
            path=str(ref.path),
        )


class _LayerError:
    """Running error sums of one layer."""

    def __init__(self) -> None:
        self.diff_sq = self.ref_sq = 0.0
        self.max_rel = self.max_use = 0.0
        self.values = 0

    def add(self, got: torch.Tensor, want: torch.Tensor, bound: torch.Tensor, r: float) -> None:
        diff = (got - want).abs()
        self.diff_sq += float(diff.double().pow(2).sum())
        self.ref_sq += float(want.double().pow(2).sum())
        relative = r * want.abs() >= (bound - r * want.abs())  # r|x| >= a s
        if r > 0 and bool(relative.any()):
            rel = diff[relative] / want.abs()[relative].clamp_min(torch.finfo(torch.float32).tiny)
            self.max_rel = max(self.max_rel, float(rel.max()))
        elif r == 0 and bool((want != 0).any()):
            nz = want != 0
            self.max_rel = max(self.max_rel, float((diff[nz] / want.abs()[nz]).max()))
        use = torch.where(bound > 0, diff / bound.clamp_min(1e-45), (diff > 0).float() * np.inf)
        self.max_use = max(self.max_use, float(use.max()) if use.numel() else 0.0)
        self.values += got.numel()

    def to_json(self) -> dict[str, Any]:
        rms = (self.diff_sq / self.ref_sq) ** 0.5 if self.ref_sq > 0 else 0.0
        return {
            "values": self.values,
            "rms_relative_error": rms,
            "max_relative_error": self.max_rel,
            "max_bound_use": self.max_use,
            "bound_holds": self.max_use <= 1.0,
        }


def lossy_report(
    ds: Dataset,
    reference: Dataset | None = None,
    *,
    head: OutputHead | None = None,
    sample_tokens: int | None = 16384,
    seed: int = 0,
    lm_tokens: int = 512,
) -> dict[str, Any]:
    """The ``lossy`` part of ``inspect --json``: the tier, and per layer its bound and (with
    a ``reference``) the measured error; ``sample_tokens`` None reads every sample."""
    tier = ds.manifest.tier
    final_position = verifier_position(ds.layers)
    bounds = [_bound_of(tier, i, final_position) for i in range(len(ds.layers))]
    layers = [
        {
            "index": i,
            "label": spec.label,
            "bound": {"max_relative_error": r, "absolute_error": a},
            "measured": None,
        }
        for i, (spec, (r, a)) in enumerate(zip(ds.layers, bounds, strict=True))
    ]
    report: dict[str, Any] = {
        "tier": None if tier is None else tier.to_json(),
        "reference": None,
        "layers": layers,
        "lm_head": None,
    }
    if reference is None:
        return report
    _check_same_states(ds, reference)
    report["reference"] = {"path": str(reference.path), "tier": name_of(reference.manifest.tier)}
    errors = [_LayerError() for _ in layers]
    final = final_layers(HsstoreSource(ds))
    agree = total = 0
    tokens = missing = compared = 0
    order = np.random.default_rng(seed).permutation(len(ds))
    for i in order.tolist():
        if sample_tokens is not None and tokens >= sample_tokens:
            break
        s = ds.read(i)
        if s.sample_id not in reference:
            missing += 1
            continue
        want = reference.get(s.sample_id).dequantized(torch.float32).float()
        got = s.dequantized().float()  # what a trainer reads: bf16
        bound = (
            torch.zeros_like(want) if tier is None else tier.bound(want, s.scales, final_position)
        )
        for j, err in enumerate(errors):
            err.add(got[:, j], want[:, j], bound[:, j], bounds[j][0])
        if head is not None and final and total < lm_tokens:
            j = final[-1]
            n = min(lm_tokens - total, got.shape[0])
            x, y = got[:n, j], want[:n, j]
            if not ds.layers[j].final_norm:
                x, y = head.normalize(x), head.normalize(y)
            agree += int((head.argmax(x) == head.argmax(y)).sum())
            total += n
        tokens += s.num_tokens
        compared += 1
    if tokens == 0:
        raise BadInputError(
            f"--reference holds none of the dataset's samples ({missing} looked up by id)",
            path=str(reference.path),
        )
    for entry, err in zip(layers, errors, strict=True):
        entry["measured"] = err.to_json()
    report["samples_compared"] = compared
    report["tokens_compared"] = tokens
    report["samples_missing_in_reference"] = missing
    if head is not None:
        report["lm_head"] = (
            {"layer": final[-1], "tokens": total, "top1_agreement": agree / total}
            if final and total
            else {"layer": None, "tokens": 0, "top1_agreement": None}
        )
    return report


def source_report(src: AuditSource, reference: str | None, opts: AuditOptions) -> dict | None:
    """inspect's lossy report of an audited source (None for a foreign directory):
    ``reference`` a dataset path, ``opts`` the audit's sampling and ``--lm-head``."""
    import hsstore

    if not isinstance(src, HsstoreSource):
        if reference is not None:
            raise BadInputError("--reference applies to hsstore datasets only", path=str(src.path))
        return None
    ref = hsstore.open(reference) if reference is not None else None
    head = load_output_head(opts.lm_head) if ref is not None and opts.lm_head else None
    tokens = None if opts.full else opts.sample_tokens
    return lossy_report(src.ds, ref, head=head, sample_tokens=tokens, seed=opts.seed,
                        lm_tokens=opts.lm_head_tokens)  # fmt: skip


def to_text(report: dict[str, Any]) -> list[str]:
    """The report's lines for inspect's human output."""
    tier, ref = report["tier"], report["reference"]
    if tier is None and ref is None:
        return []  # lossless, nothing compared: nothing to add to the report
    lines = ["", f"lossy tier: {'lossless' if tier is None else tier['name']}"]
    if tier is not None:
        lines.append(
            f"  stores {tier['dtype']}, scales {tier['scales']}, bound |err| <= "
            f"{tier['max_relative_error']:.3g} |x| + {tier['absolute_error']:.3g} x scale"
        )
        final = tier.get("final_state")
        if final is not None:
            lines.append(
                f"  the verifier's state keeps {final['mantissa_bits']} mantissa bits: |err| <= "
                f"{final['max_relative_error']:.3g} |x| + {final['absolute_error']:.3g}"
            )
    if ref is None:
        lines.append("  measured error: pass --reference DATASET (the same samples, lossless)")
        return lines
    lines.append(
        f"  against {ref['path']} ({ref['tier']}), {report['tokens_compared']} tokens compared"
    )
    lines.append("  layer  label               rms_rel    max_rel  bound_use  bound")
    for e in report["layers"]:
        m = e["measured"]
        lines.append(
            f"  {e['index']:>5}  {e['label']:<18} {m['rms_relative_error']:>8.4f} "
            f"{m['max_relative_error']:>10.4f} {m['max_bound_use']:>10.3f}  "
            f"{'holds' if m['bound_holds'] else 'BROKEN'}"
        )
    lm = report["lm_head"]
    if lm is not None:
        if lm["top1_agreement"] is None:
            lines.append("  lm-head top-1 agreement: no final-depth state stored")
        else:
            lines.append(
                f"  lm-head top-1 agreement on layer {lm['layer']}: "
                f"{lm['top1_agreement']:.4f} over {lm['tokens']} tokens"
            )
    return lines
