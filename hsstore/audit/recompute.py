"""Stored states against the model itself (``inspect --model``).

A few samples are run through the model (transformers, float32, on the CPU) and every stored
layer is compared with every state the model produces: the residual stream at each depth
0..N-1, the last layer's output before the final norm, and after it. A stored layer must be
closest to the state its label names. Statistics cannot tell depth 1 from depth 2 of a
well-behaved model, nor a final state's norm by its scale alone when the scale barely varies;
the recomputation can: a dataset whose aux layers are labelled one layer off, or whose final
state's norm is declared wrong, fails here.
"""

from __future__ import annotations

import os

import torch

from hsstore.audit.inputs import AuditSource
from hsstore.audit.verdict import CheckResult, fail, ok, skip
from hsstore.model_folder import ModelFolder
from hsstore.spec.layers import LayerSpec

NAME = "model_recompute"
# Largest relative error (||stored - recomputed|| / ||recomputed||) of a state that is the one
# its label names: bf16 storage alone is ~0.005, a bf16 forward against this float32 one a few
# percent; neighbouring depths of real models differ by 10% or more.
TOLERANCE = 0.1


def _candidates(n: int) -> list[LayerSpec]:
    return [LayerSpec(depth=d) for d in range(n)] + [
        LayerSpec(depth=n, final_norm=False),
        LayerSpec(depth=n, final_norm=True),
    ]


def _rel(x: torch.Tensor, ref: torch.Tensor) -> float:
    return float((x - ref).norm() / ref.norm().clamp_min(1e-12))


def check_against_model(
    src: AuditSource,
    model_dir: str | os.PathLike[str] | None,
    *,
    samples: int = 2,
    max_tokens: int = 128,
) -> CheckResult:
    """Recompute ``samples`` samples (their first ``max_tokens`` tokens) with the model."""
    if model_dir is None:
        return skip(NAME, "pass --model MODEL_DIR to recompute samples with the model")
    from hsstore.extractors.backends.transformers import TransformersBackend
    from hsstore.extractors.chat_tokens import TokenizedPrompt

    n = int(ModelFolder(model_dir).text_config["num_hidden_layers"])
    candidates = _candidates(n)
    backend = TransformersBackend(str(model_dir), candidates, torch_dtype="float32")
    if backend.hidden_size != src.hidden_size:
        return fail(NAME, f"the model's hidden size {backend.hidden_size} is not the dataset's "
                          f"{src.hidden_size}: states of another model?")  # fmt: skip
    picks = sorted({round(i * (len(src) - 1) / max(1, samples - 1)) for i in range(samples)})
    errors = torch.zeros(len(src.layers), len(candidates), dtype=torch.float64)
    try:
        for i in picks:
            s = src.read(i)
            t = min(max_tokens, int(s.input_ids.shape[0]))
            prompt = TokenizedPrompt(s.sample_id, i, s.input_ids[:t].long(), s.loss_mask[:t],
                                     "stored", False)  # fmt: skip
            (states,) = backend.run([prompt])  # [t, candidates, H]
            for j in range(len(src.layers)):
                stored = s.hidden[:t, j].float()
                errors[j] += torch.tensor(
                    [_rel(stored, states[:, c]) for c in range(len(candidates))]
                )
    finally:
        backend.close()
    errors /= len(picks)
    bad, good, details = [], [], {}
    for j, spec in enumerate(src.layers):
        label = f"layer {j} ({spec.label})"
        best = int(errors[j].argmin())
        declared = next(
            (c for c, cand in enumerate(candidates)
             if cand.depth == spec.depth and (spec.depth < n or cand.final_norm == spec.final_norm)),
            None,
        )  # fmt: skip
        details[str(j)] = {"closest": candidates[best].label, "rel_err": float(errors[j, best]),
                           "declared_rel_err": None if declared is None else float(errors[j, declared])}  # fmt: skip
        if declared is None:
            bad.append(f"{label}: the model has no such state ({n} layers)")
        elif errors[j, declared] > TOLERANCE and best != declared:
            bad.append(f"{label} is not the model's {candidates[declared].label} (relative error "
                       f"{errors[j, declared]:.3g}) but its {candidates[best].label} "
                       f"({errors[j, best]:.3g}): mislabelled")  # fmt: skip
        elif errors[j, declared] > TOLERANCE:
            bad.append(f"{label} matches no state of the model (relative error "
                       f"{errors[j, declared]:.3g} to the one its label names): another model?")  # fmt: skip
        else:
            good.append(f"{label} {errors[j, declared]:.2g}")
    how = f"{len(picks)} samples recomputed with {model_dir}"
    if bad:
        return fail(NAME, f"{'; '.join(bad)} ({how})", layers=details)
    return ok(NAME, f"every layer is the state its label names ({how}; relative error "
                    f"{', '.join(good)})", layers=details)  # fmt: skip
