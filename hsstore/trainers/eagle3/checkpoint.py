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

from hsstore.errors import BadInputError
from hsstore.trainers.eagle3.model import DrafterConfig, Eagle3Drafter

CHECKPOINT_DIR = "checkpoint"
# SGLang's EAGLE-3 drafter class for a Llama-layout drafter (sglang 0.5.23
# models/llama_eagle3.py EntryClass); it serves any target. SGLang's MLA drafter for Kimi-K2.5
# (models/kimi_k25_eagle3.py Eagle3DeepseekV2ForCausalLM) and Mistral Large 3's
# (models/mistral_large_3_eagle.py) expect other weights than this trainer produces.
DRAFTER_ARCHITECTURE = "LlamaForCausalLMEagle3"
# Targets whose set_eagle3_layers_to_capture adds 1 to the ids only when the first is 1
# (sglang 0.5.23 models/deepseek_v2.py:3248 and the classes inheriting or delegating to it);
# every other target adds 1 to each id (models/llama.py). Only consulted when the trained
# aux layers do not include depth 2; tests/test_extract_sglang_contract.py derives this set from
# the wheel's sources and fails when it drifts.
SGLANG_FIRST_ID_RULE_TARGETS = frozenset(
    {
        "DeepseekV2ForCausalLM",
        "DeepseekV3ForCausalLM",
        "DeepseekV32ForCausalLM",
        "DeepseekV3ForCausalLMNextN",
        "Glm4MoeLiteForCausalLM",
        "Glm4MoeLiteForCausalLMNextN",
        "GlmMoeDsaForCausalLM",
        "GlmMoeDsaForCausalLMNextN",
        "Glm5NextForConditionalGenerationNextN",
        "KimiK25ForConditionalGeneration",
        "MistralLarge3ForCausalLM",
        "MistralLarge3ForCausalLMEagle",
    }
)


def sglang_layer_ids(
    aux_layers: list, num_hidden_layers: int, *, target_architecture: str | None = None
) -> list[int]:
    """``eagle_config.eagle_aux_hidden_state_layer_ids`` that make SGLang capture these depths.

    SGLang passes these ids to the target's ``set_eagle3_layers_to_capture``. A list that
    starts with id 1 is shifted by one under every rule in SGLang, so when depth 2 is among the
    aux layers (always true for the default EAGLE-3 choice) the ids are ``[1, ...]`` and serve
    every target. Otherwise the target's rule decides: ids are the depths themselves for
    SGLANG_FIRST_ID_RULE_TARGETS (with 1 not first), depth - 1 for the rest.
    """
    from hsstore.spec import conventions

    first_id_rule = target_architecture in SGLANG_FIRST_ID_RULE_TARGETS
    rule = conventions.SGLANG_DEEPSEEK if first_id_rule else conventions.SGLANG_LLAMA
    try:
        return conventions.sglang_ids([s.depth for s in aux_layers], num_hidden_layers, rule)
    except conventions.ConventionError as exc:
        raise conventions.ConventionError(
            f"{exc.message} ({target_architecture}); train with more aux layers (or include "
            "depth 2)"
        ) from None


def framework_layer_ids(
    aux_layers: list, num_hidden_layers: int, *, target_architecture: str | None = None
) -> dict[str, list[int] | None]:
    """The aux layers as vLLM and SGLang number them (None where a framework cannot name one).

    hsstore stores depths (decoder layers applied, 0 = embeddings). vLLM and speculators'
    configs capture "the residual entering layer j", i.e. depth j (translated by
    ``hsstore.spec.conventions``); SGLang's ids depend on the target's rule and are chosen by
    :func:`sglang_layer_ids`.
    """
    from hsstore.spec import conventions

    out: dict[str, list[int] | None] = {}
    try:
        out[conventions.VLLM] = conventions.from_canonical(
            conventions.VLLM, aux_layers, num_hidden_layers
        )
    except conventions.ConventionError:
        out[conventions.VLLM] = None
    try:
        out["sglang"] = sglang_layer_ids(
            aux_layers, num_hidden_layers, target_architecture=target_architecture
        )
    except ValueError:
        out["sglang"] = None
    return out


def server_config(
    cfg: DrafterConfig,
    aux_layers: list,
    verifier_layer,
    num_hidden_layers: int,
    extra: dict | None = None,
    *,
    target_architecture: str | None = None,
) -> dict:
    """The config.json of a drafter, in the key names SGLang, vLLM and speculators read.

    The same aux layers have different ids in vLLM and SGLang (see framework_layer_ids); each
    framework reads its own key, so both are written, and the canonical depths go under
    ``hsstore`` for anyone who wants no ambiguity.
    """
    ids = framework_layer_ids(
        aux_layers, num_hidden_layers, target_architecture=target_architecture
    )
    return {
        "architectures": [DRAFTER_ARCHITECTURE],
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
            "eagle_aux_hidden_state_layer_ids": ids["sglang"],  # SGLang
        },
        "eagle_aux_hidden_state_layer_ids": ids["vllm"],  # vLLM / speculators
        "hsstore": {
            "drafter": cfg.to_json(),
            "num_hidden_layers": num_hidden_layers,
            "aux_layers": [spec.to_json() for spec in aux_layers],
            "verifier_layer": verifier_layer.to_json(),
            "target_architecture": target_architecture,
            **(extra or {}),
        },
    }


def target_architecture_of(model: str | None) -> str | None:
    """``architectures[0]`` of a local target model directory's config.json, if there is one."""
    if not model:
        return None
    path = Path(model) / "config.json"
    try:
        archs = json.loads(path.read_text()).get("architectures") or []
    except (OSError, ValueError, AttributeError):
        return None
    return str(archs[0]) if archs else None


# The vocabulary maps, which mean nothing when the draft vocabulary is the target's.
VOCAB_MAP_KEYS = ("d2t", "t2d")


def serving_weights(model: Eagle3Drafter) -> dict[str, torch.Tensor]:
    """The drafter's tensors as the checkpoint stores them.

    With the draft vocabulary equal to the target's the maps are left out: vLLM creates its
    ``draft_id_to_target_id`` only when the two sizes differ (vllm 0.32
    ``model_executor/models/llama_eagle3.py``, ``Eagle3LlamaForCausalLM.__init__``) and refuses
    a checkpoint that carries ``d2t`` then; SGLang and speculators take the identity when they
    are absent.
    """
    weights = {k: v.detach().cpu().contiguous() for k, v in model.state_dict().items()}
    if model.config.draft_vocab_size == model.config.vocab_size:
        for key in VOCAB_MAP_KEYS:
            del weights[key]
    return weights


def save_checkpoint(out_dir: str | Path, model: Eagle3Drafter, config: dict, state: dict) -> Path:
    """Write model + config + trainer state atomically to ``out_dir/checkpoint``."""
    out_dir = Path(out_dir)
    final = out_dir / CHECKPOINT_DIR
    tmp = out_dir / (CHECKPOINT_DIR + ".tmp")
    old = out_dir / (CHECKPOINT_DIR + ".old")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    weights = serving_weights(model)
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
    weights = load_file(str(path / "model.safetensors"))
    missing = set(model.state_dict()) - set(weights)
    if model.config.draft_vocab_size == model.config.vocab_size:
        missing -= set(VOCAB_MAP_KEYS)  # the identity maps the model was built with
    if missing:
        raise BadInputError(f"no {sorted(missing)[0]} in model.safetensors", path=str(path))
    model.load_state_dict(weights, strict=False)
    return model, config


def load_trainer_state(path: str | Path) -> dict:
    # weights_only=False: the state holds plain Python containers, RNG byte tensors and the
    # loader's dict; it is our own file, written by save_checkpoint above.
    return torch.load(Path(path) / "trainer_state.pt", map_location="cpu", weights_only=False)
