"""Checkpoints: drafter weights in safetensors + a config.json servers understand + trainer state.

Layout of ``OUT/checkpoint/``:

    model.safetensors   drafter weights under EAGLE-3 names (fc, midlayer.*, norm, lm_head,
                        embed_tokens, d2t, t2d), loadable by SGLang and vLLM
    config.json         LlamaForCausalLMEagle3-style config (see docs/TRAINER.md for every key)
    trainer_state.pt    optimizer, loader position, step, RNG: what --resume needs, nothing else

A checkpoint is written to a temporary directory and renamed into place, so a job killed while
saving leaves the previous checkpoint intact.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from trainers.eagle3.model import DrafterConfig, Eagle3Drafter

CHECKPOINT_DIR = "checkpoint"


def framework_layer_ids(aux_layers: list, num_hidden_layers: int) -> dict[str, list[int] | None]:
    """The aux layers as vLLM and SGLang number them (None where a framework cannot name one).

    hsstore stores depths (decoder layers applied, 0 = embeddings). vLLM and speculators'
    configs capture "the residual entering layer j", i.e. depth j; SGLang adds 1 to the ids in
    ``eagle_config`` before capturing, so its id is depth - 1. The translation is the one in
    ``hsstore.format.conventions``.
    """
    from hsstore.format import conventions

    out: dict[str, list[int] | None] = {}
    for name in (conventions.VLLM, conventions.SGLANG_LLAMA):
        try:
            out[name] = conventions.from_canonical(name, aux_layers, num_hidden_layers)
        except conventions.ConventionError:
            out[name] = None
    return out


def server_config(
    cfg: DrafterConfig,
    aux_layers: list,
    verifier_layer,
    num_hidden_layers: int,
    extra: dict | None = None,
) -> dict:
    """The config.json of a drafter, in the key names SGLang, vLLM and speculators read.

    The same aux layers have different ids in vLLM and SGLang (see framework_layer_ids); each
    framework reads its own key, so both are written, and the canonical depths go under
    ``hsstore`` for anyone who wants no ambiguity.
    """
    ids = framework_layer_ids(aux_layers, num_hidden_layers)
    return {
        "architectures": ["LlamaForCausalLMEagle3"],
        "model_type": "llama",
        "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.intermediate_size,
        "num_attention_heads": cfg.num_attention_heads,
        "num_key_value_heads": cfg.num_key_value_heads,
        "head_dim": cfg.head_dim,
        "num_hidden_layers": 1,
        "hidden_act": "silu",
        "rms_norm_eps": cfg.rms_norm_eps,
        "rope_theta": cfg.rope_theta,
        "max_position_embeddings": cfg.max_position_embeddings,
        "vocab_size": cfg.vocab_size,
        "draft_vocab_size": cfg.draft_vocab_size,
        "target_hidden_size": cfg.target_hidden_size or cfg.hidden_size,
        "tie_word_embeddings": False,
        "norm_before_residual": cfg.norm_before_residual,
        "torch_dtype": "float32",
        "eagle_config": {
            "use_aux_hidden_state": True,
            "eagle_aux_hidden_state_layer_ids": ids["sglang-llama"],  # SGLang
        },
        "eagle_aux_hidden_state_layer_ids": ids["vllm"],  # vLLM / speculators
        "hsstore": {
            "drafter": cfg.to_json(),
            "num_hidden_layers": num_hidden_layers,
            "aux_layers": [spec.to_json() for spec in aux_layers],
            "verifier_layer": verifier_layer.to_json(),
            **(extra or {}),
        },
    }


def save_checkpoint(out_dir: str | Path, model: Eagle3Drafter, config: dict, state: dict) -> Path:
    """Write model + config + trainer state atomically to ``out_dir/checkpoint``."""
    out_dir = Path(out_dir)
    final = out_dir / CHECKPOINT_DIR
    tmp = out_dir / (CHECKPOINT_DIR + ".tmp")
    old = out_dir / (CHECKPOINT_DIR + ".old")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    weights = {k: v.detach().cpu().contiguous() for k, v in model.state_dict().items()}
    save_file(weights, str(tmp / "model.safetensors"), metadata={"format": "pt"})
    (tmp / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    torch.save(state, tmp / "trainer_state.pt")
    shutil.rmtree(old, ignore_errors=True)
    if final.exists():
        final.rename(old)
    tmp.rename(final)
    shutil.rmtree(old, ignore_errors=True)
    return final


def find_checkpoint(out_dir: str | Path) -> Path | None:
    """The checkpoint to resume from; falls back to ``.old`` if a crash hit between renames."""
    for name in (CHECKPOINT_DIR, CHECKPOINT_DIR + ".old"):
        path = Path(out_dir) / name
        if (path / "trainer_state.pt").exists():
            return path
    return None


def load_drafter(path: str | Path) -> tuple[Eagle3Drafter, dict]:
    """Rebuild the drafter from a checkpoint directory; returns (model, config.json dict)."""
    path = Path(path)
    config = json.loads((path / "config.json").read_text())
    model = Eagle3Drafter(DrafterConfig(**config["hsstore"]["drafter"]))
    model.load_state_dict(load_file(str(path / "model.safetensors")))
    return model, config


def load_trainer_state(path: str | Path) -> dict:
    # weights_only=False: the state holds plain Python containers, RNG byte tensors and the
    # loader's dict; it is our own file, written by save_checkpoint above.
    return torch.load(Path(path) / "trainer_state.pt", map_location="cpu", weights_only=False)
