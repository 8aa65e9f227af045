"""Tiny-model data for the audit tests: real states whose lm_head agreement means something.

A random-initialised Llama (hidden 64, 4 layers, vocab 256) generates its own continuations
greedily, so under the true alignment argmax(lm_head(norm(state_t))) == token_{t+1} on every
generated token, while a shift by one or the wrong norm reading agrees far less. The init
scale (0.1) makes attention matter enough that generations do not collapse into a fixed point,
and the final norm weight is randomised so that "normed or not" changes the argmax.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

import hsstore
from hsstore import LayerSpec

HIDDEN, LAYERS, VOCAB = 64, 4, 256
PROMPT, GENERATED = 12, 36


@dataclass
class GenSample:
    sample_id: str
    input_ids: torch.Tensor  # int64 [T]
    loss_mask: torch.Tensor  # int64 [T], 1 on generated tokens
    states: dict  # depth -> [T, H] float32 pre-norm residual; "post" -> after the final norm


def build_model(model_dir: Path, seed: int = 0):
    """Build, randomise and save (safetensors) the tiny model; returns it in eval mode."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(
        hidden_size=HIDDEN,
        intermediate_size=4 * HIDDEN,
        num_hidden_layers=LAYERS,
        num_attention_heads=4,
        num_key_value_heads=4,
        vocab_size=VOCAB,
        max_position_embeddings=256,
        rms_norm_eps=1e-6,
        initializer_range=0.1,
        tie_word_embeddings=False,
    )
    model = LlamaForCausalLM(cfg).eval()
    with torch.no_grad():
        model.model.norm.weight.uniform_(0.3, 2.0)
    model.save_pretrained(model_dir, safe_serialization=True)
    return model


@torch.no_grad()
def capture_states(model, ids: torch.Tensor) -> dict:
    """Residual stream after every depth (forward hooks) plus the final norm, for [N, T] ids."""
    caps: dict = {}
    hooks = [model.model.embed_tokens.register_forward_hook(lambda m, i, o: caps.__setitem__(0, o))]
    for d, layer in enumerate(model.model.layers, 1):
        hooks.append(
            layer.register_forward_hook(
                lambda m, i, o, d=d: caps.__setitem__(d, o[0] if isinstance(o, tuple) else o)
            )
        )
    try:
        model(ids)
    finally:
        for h in hooks:
            h.remove()
    out = {k: v.float() for k, v in caps.items()}
    out["post"] = model.model.norm(out[LAYERS])
    return out


@torch.no_grad()
def generate(model, n: int, seed: int = 1) -> list[GenSample]:
    """``n`` samples: a random prompt, then greedy continuation by the model itself (batched)."""
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, VOCAB, (n, PROMPT), generator=gen)
    for _ in range(GENERATED):
        nxt = model(ids).logits[:, -1].argmax(dim=-1)
        ids = torch.cat([ids, nxt[:, None]], dim=1)
    states = capture_states(model, ids)
    mask = torch.zeros_like(ids[0])
    mask[PROMPT:] = 1
    return [
        GenSample(
            f"s{k}", ids[k].clone(), mask.clone(), {d: v[k].clone() for d, v in states.items()}
        )
        for k in range(n)
    ]


CLEAN_LAYERS = [LayerSpec(1), LayerSpec(2), LayerSpec(3), LayerSpec(LAYERS, final_norm=True)]
CLEAN_SOURCES = [1, 2, 3, "post"]  # which captured state fills each stored slot


def stack(sample: GenSample, sources: list) -> torch.Tensor:
    return torch.stack([sample.states[s] for s in sources], dim=1)


def model_info(vocab_size: int = VOCAB) -> dict:
    return {"name": "tiny-llama", "num_hidden_layers": LAYERS, "hidden_size": HIDDEN,
            "vocab_size": vocab_size}  # fmt: skip


def write_dataset(
    path: Path,
    rows: list[tuple[str, torch.Tensor, torch.Tensor, torch.Tensor]],
    *,
    layers: list[LayerSpec] = CLEAN_LAYERS,
    dtype: torch.dtype = torch.float32,
    vocab_size: int = VOCAB,
) -> Path:
    """Write (sample_id, input_ids, loss_mask, hidden [T, L, H]) rows as an hsstore dataset."""
    ds = hsstore.create(path, layers=layers, hidden_size=HIDDEN, dtype=dtype,
                        model=model_info(vocab_size))  # fmt: skip
    with ds.writer() as w:
        for sid, ids, mask, hidden in rows:
            w.add(sid, ids, mask, hidden.to(dtype))
    return path


def clean_rows(samples: list[GenSample], sources: list = CLEAN_SOURCES) -> list:
    return [(s.sample_id, s.input_ids, s.loss_mask, stack(s, sources)) for s in samples]


@dataclass
class Tiny:
    model_dir: Path
    samples: list[GenSample]


def make_tiny(root: Path, n: int = 8) -> Tiny:
    model = build_model(root / "model")
    return Tiny(root / "model", generate(model, n))
