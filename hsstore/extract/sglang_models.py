"""Model classes whose SGLang aux capture is wrong, refused before anything is stored.

sglang 0.5.23's Gemma 3 keeps the residual stream apart from each layer's output (a decoder
layer returns ``(mlp branch, residual)``: ``srt/models/gemma3_causal.py:410``) and captures only
the first (``aux_hidden_states.append(hidden_states)``, ``gemma3_causal.py:657``, and ``:639`` on
AMX CPUs), so its aux states are the MLP branch, not the residual stream transformers'
``hidden_states`` hold; the multimodal class runs the same text model
(``gemma3_mm.py:195``). The final state, taken after the model's own norm, is right; the aux
states are not, and an EAGLE-3 drafter trained on them would be wrong. tests/
test_extract_sglang_models.py checks the cited lines in the wheel.
"""

from __future__ import annotations

from typing import Any

from hsstore.errors import BadInputError

_GEMMA3 = (
    "sglang 0.5.23 captures each layer's MLP branch, not the residual stream, as its aux hidden "
    "states (sglang/srt/models/gemma3_causal.py:657)"
)
WRONG_AUX_CAPTURE = {
    "Gemma3ForCausalLM": _GEMMA3,
    "Gemma3ForConditionalGeneration": _GEMMA3,
}


def refuse_wrong_capture(config: Any, model: str) -> None:
    """Refuse a model whose class (``config.architectures``) SGLang captures wrongly."""
    for arch in getattr(config, "architectures", None) or []:
        if arch in WRONG_AUX_CAPTURE:
            raise BadInputError(
                f"--backend sglang cannot extract {arch}: {WRONG_AUX_CAPTURE[arch]}; "
                "use --backend transformers",
                path=model,
            )
