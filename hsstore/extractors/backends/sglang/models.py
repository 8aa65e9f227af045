"""Model classes whose SGLang aux capture is wrong, refused before anything is stored.

EAGLE-3's aux state for layer id k is the residual stream after decoder layer k (transformers'
``hidden_states[k + 1]``): sglang 0.5.23's Llama captures it at the entry of layer k + 1, after
the residual add (``srt/models/llama.py:403``, ``srt/layers/layer_boundary/stage.py``
``_prepare_attention``). Every model class of the wheel that implements
``set_eagle3_layers_to_capture`` was read; these capture something else, and an EAGLE-3
drafter trained on them would be wrong. docs/EXTRACT.md lists the verdict for every class;
tests/test_extract_sglang_models.py checks each cited line in the wheel.
"""

from __future__ import annotations

from typing import Any

from hsstore.errors import BadInputError

# A Gemma 3 decoder layer returns its MLP branch and the residual stream apart
# (gemma3_causal.py:410); the model captures the first. The multimodal class runs the same text
# model (gemma3_mm.py:195).
_GEMMA3 = (
    "sglang 0.5.23 captures each layer's MLP branch, not the residual stream, as its aux hidden "
    "states (sglang/srt/models/gemma3_causal.py:657)"
)
# Its decoder layers drop the capture they are handed (the flag passed at qwen4_exp.py:2133
# never reaches the attention boundary), and its model returns the hyper-connection streams
# where the aux states belong.
_QWEN4_EXP = (
    "sglang 0.5.23 captures no aux hidden states for it: its decoder layers never hand the "
    "capture to their attention boundary (sglang/srt/models/qwen4_exp.py:1710) and its model "
    "returns the hyper-connection streams in their place (sglang/srt/models/qwen4_exp.py:2171)"
)
WRONG_AUX_CAPTURE = {
    "Gemma3ForCausalLM": _GEMMA3,
    "Gemma3ForConditionalGeneration": _GEMMA3,
    "Qwen4ExpForConditionalGeneration": _QWEN4_EXP,
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
