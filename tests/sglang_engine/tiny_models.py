"""Tiny random checkpoints of the model families drafters are trained for, built in code.

``ARCHITECTURES`` is every family tried on SGLang's CPU path (docs/EXTRACT.md says which run).

Each has the demo tokenizer (hsstore/demo_model.py) and a transformers config of its family,
small enough that SGLang's CPU engine starts in seconds of model work. The name is the
config's ``architectures[0]``, the class SGLang looks up.
"""

from __future__ import annotations

from pathlib import Path

N_LAYERS = 6
HIDDEN = 64
HEADS = 4
KV_HEADS = 2
VOCAB = 512


def _common(tok, hidden: int) -> dict:
    return dict(
        vocab_size=VOCAB,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=N_LAYERS,
        num_attention_heads=HEADS,
        num_key_value_heads=KV_HEADS,
        max_position_embeddings=2048,
        rms_norm_eps=1e-5,
        initializer_range=0.2,  # residual streams that differ visibly between layers
        tie_word_embeddings=False,
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
    )


def _moe(hidden: int) -> dict:
    return dict(moe_intermediate_size=hidden, num_experts_per_tok=2)


def _config(arch: str, tok, hidden: int = HIDDEN):
    import transformers as tf

    c = _common(tok, hidden)
    head_dim = hidden // HEADS
    if arch == "LlamaForCausalLM":
        return tf.LlamaConfig(**c)
    if arch == "Qwen2ForCausalLM":
        return tf.Qwen2Config(**c)
    if arch == "Qwen3ForCausalLM":
        return tf.Qwen3Config(**c, head_dim=head_dim)
    if arch == "Qwen3MoeForCausalLM":
        return tf.Qwen3MoeConfig(**c, **_moe(hidden), num_experts=4, head_dim=head_dim)
    if arch == "MistralForCausalLM":
        return tf.MistralConfig(**c, head_dim=head_dim, sliding_window=None)
    if arch == "MixtralForCausalLM":
        return tf.MixtralConfig(**c, num_local_experts=4, num_experts_per_tok=2)
    if arch == "Gemma2ForCausalLM":
        return tf.Gemma2Config(**c, head_dim=head_dim, query_pre_attn_scalar=head_dim)
    if arch == "Gemma3ForCausalLM":
        return tf.Gemma3TextConfig(**c, head_dim=head_dim, query_pre_attn_scalar=head_dim)
    if arch == "Phi3ForCausalLM":
        return tf.Phi3Config(**c)
    if arch == "GptOssForCausalLM":
        return tf.GptOssConfig(**c, head_dim=head_dim, num_local_experts=4, num_experts_per_tok=2)
    if arch == "Llama4ForCausalLM":
        return tf.Llama4TextConfig(
            **c,
            head_dim=head_dim,
            intermediate_size_mlp=2 * hidden,
            num_local_experts=4,
            num_experts_per_tok=1,
            interleave_moe_layer_step=2,
            attention_chunk_size=8192,
        )
    if arch == "Glm4ForCausalLM":
        return tf.Glm4Config(**c, head_dim=head_dim)
    if arch == "Glm4MoeForCausalLM":
        return tf.Glm4MoeConfig(
            **c,
            **_moe(hidden),
            n_routed_experts=4,
            n_shared_experts=1,
            n_group=1,
            topk_group=1,
            first_k_dense_replace=1,
        )
    raise KeyError(arch)


ARCHITECTURES = [
    "LlamaForCausalLM",
    "Qwen2ForCausalLM",
    "Qwen3ForCausalLM",
    "Qwen3MoeForCausalLM",
    "MistralForCausalLM",
    "MixtralForCausalLM",
    "Gemma2ForCausalLM",
    "Gemma3ForCausalLM",
    "Phi3ForCausalLM",
    "GptOssForCausalLM",
    "Llama4ForCausalLM",
    "Glm4ForCausalLM",
    "Glm4MoeForCausalLM",
]


def build(arch: str, out: str | Path, *, seed: int = 0, hidden: int = HIDDEN) -> Path:
    """Save a random ``arch`` checkpoint (float32) and the demo tokenizer into ``out``; ``hidden``
    sets the width (head dim ``hidden // HEADS``: vLLM's CPU attention needs at least 32)."""
    import torch
    import transformers as tf

    from hsstore.demo_model import _build_tokenizer

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    tok = _build_tokenizer(VOCAB)
    config = _config(arch, tok, hidden)
    config.architectures = [arch]
    config.dtype = "float32"
    model_class = getattr(tf, arch)
    state = torch.random.get_rng_state()
    try:
        torch.manual_seed(seed)
        model = model_class(config).to(torch.float32).eval()
    finally:
        torch.random.set_rng_state(state)
    model.save_pretrained(out)
    tok.save_pretrained(out)
    return out
