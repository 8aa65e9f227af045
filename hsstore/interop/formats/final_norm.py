"""The target model's final RMSNorm, loaded on its own from a model folder (no whole model).

SpecForge stores the final state after the norm, while vLLM/speculators and hsstore's own
extractors keep it before; exporting one to the other applies the norm. Only the norm weight
(one [H] tensor out of the safetensors files) and ``rms_norm_eps`` (config.json) are read.

The arithmetic is transformers' ``LlamaRMSNorm.forward`` (``models/llama/modeling_llama.py``):
``weight * (x.float() * rsqrt(mean(x.float()^2) + eps)).to(x.dtype)``, which the Llama, Qwen2/3
and Mistral families share. Gemma's ``(1 + weight)`` variant is refused rather than guessed.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from hsstore.errors import BadInputError
from hsstore.model_folder import ModelFolder

# Where causal LMs keep the final norm, most common first (text models, then VLM wrappers).
_NORM_KEYS = (
    "model.norm.weight",
    "model.language_model.norm.weight",
    "language_model.model.norm.weight",
)


@dataclass
class FinalNorm:
    weight: torch.Tensor  # [H]
    eps: float
    num_hidden_layers: int | None
    source: str

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """Normalise [..., H] states exactly as the model's final norm does."""
        h = x.to(torch.float32)
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight.to(x.dtype) * h.to(x.dtype)


def load_final_norm(model_dir: str | os.PathLike, *, hidden_size: int) -> FinalNorm:
    """Read the final norm of the model in ``model_dir``, or BadInputError naming what is missing."""
    folder = ModelFolder(model_dir)
    root, text = folder.root, folder.text_config
    if folder.model_type.startswith("gemma"):
        raise BadInputError(
            "Gemma's final norm scales by (1 + weight); applying it is not supported",
            path=str(root),
        )
    eps = text.get("rms_norm_eps")
    if not isinstance(eps, (int, float)):
        raise BadInputError(
            "config.json has no rms_norm_eps (not an RMSNorm model?)", path=str(root)
        )
    key = folder.first(_NORM_KEYS)
    if key is None:
        raise BadInputError(
            f"no final norm weight ({' or '.join(_NORM_KEYS)}) in the model's safetensors files",
            path=str(root),
        )
    weight, where = folder.tensor(key), folder.where(key)
    if list(weight.shape) != [hidden_size]:
        raise BadInputError(
            f"final norm weight has shape {list(weight.shape)}, but the dataset's hidden size "
            f"is {hidden_size}: is this the dataset's target model?",
            path=where,
        )
    n = text.get("num_hidden_layers")
    return FinalNorm(weight, float(eps), int(n) if isinstance(n, int) else None, where)
