"""What the vLLM lane's tests share beyond the SGLang lane's helpers (tests/sglang_engine/lane.py).

vLLM's CPU attention needs a head dim of at least 32, so the tiny models are built twice as wide
as the SGLang lane's. In fp32 vLLM's kernels (its CPU attention and GEMMs) sum in another order
than transformers', so the states agree to float32 rounding, not bit for bit:
:data:`FP32_REL_BOUND` is the bound, measured at 2.5e-6 (six layers) on these models.
"""

from __future__ import annotations

from pathlib import Path

HERE = Path(__file__).resolve().parent
HIDDEN = 128  # four heads of 32
FP32_REL_BOUND = 1e-5
ENGINE_ARGS = ["--backend", "vllm", "--device", "cpu"]
PLANTED = HERE / "planted"  # a sitecustomize that shifts every aux capture one layer deeper
OTHER_RELEASE = HERE / "other_release"  # the metadata of a vllm 0.31.0, found before the real one


def extract_args(model: Path, prompts: Path, out: Path, *args: str) -> list[str]:
    return ["extract", "--model", str(model), "--data", str(prompts), "--out", str(out),
            *ENGINE_ARGS, *args]  # fmt: skip


def reference_states(ref, input_ids) -> dict:
    """transformers' states for one sample by stored label, from the SGLang lane's
    ``Reference``: ``after d`` is ``hidden_states[d]`` (at N the final norm's input) and
    ``after N +final_norm`` the LM head's input."""
    hidden, head_input = ref.states(input_ids)
    out = {f"after {d}": h for d, h in enumerate(hidden)}
    out[f"after {ref.n} +final_norm"] = head_input
    return out
