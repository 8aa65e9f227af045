"""A tiny Llama model and tokenizer built entirely in code.

`hsstore demo`, the tests and CPU CI need a real causal LM with a real tokenizer and chat template, but may not
download anything. This builds one from a config and a byte-level BPE trained on a few strings,
and saves both with ``save_pretrained`` (safetensors) so every code path that loads a model from
a local directory (``AutoModelForCausalLM.from_pretrained``, SGLang) can be exercised.

The byte-level alphabet means any text tokenizes (no unknown tokens), and the build is
deterministic for a given seed, so two calls produce bit-identical weights.
"""

from __future__ import annotations

from pathlib import Path

# A Llama-3-shaped chat template: header tokens around the role, an end-of-turn token after each
# message. Loss masks are derived from it the same way as from any real model's template.
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "<|start_header_id|>{{ message['role'] }}<|end_header_id|>\n\n"
    "{{ message['content'] | trim }}<|eot_id|>"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}"
)

SPECIAL_TOKENS = [
    "<|pad|>",
    "<|begin_of_text|>",
    "<|end_of_text|>",
    "<|start_header_id|>",
    "<|end_header_id|>",
    "<|eot_id|>",
]

_CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "Hidden states of a language model are stored as a dataset for training draft models.",
    "user assistant system: Hello! How are you today? I am fine, thank you.",
    "Speculative decoding drafts several tokens and the target model verifies them at once.",
    "def add(a, b):\n    return a + b\n",
    "0123456789 + - * / = ( ) [ ] { } , . ; : ! ?",
    "What is the capital of France? The capital of France is Paris.",
]


def _build_tokenizer(vocab: int):
    """Train a byte-level BPE on a few strings and wrap it with a chat template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_CORPUS * 4, trainer=trainer)
    return chat_tokenizer(tok)


def chat_tokenizer(tok):
    """A ``tokenizers.Tokenizer`` whose vocabulary holds SPECIAL_TOKENS, as a transformers
    tokenizer with those special tokens and the Llama-3-shaped CHAT_TEMPLATE."""
    from transformers import PreTrainedTokenizerFast

    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<|begin_of_text|>",
        eos_token="<|eot_id|>",
        pad_token="<|pad|>",
        additional_special_tokens=["<|start_header_id|>", "<|end_header_id|>", "<|end_of_text|>"],
    )
    fast.chat_template = CHAT_TEMPLATE
    fast.model_max_length = 2048
    return fast


def build_tiny_model(
    dir: str | Path,
    *,
    hidden: int = 64,
    layers: int = 4,
    vocab: int = 512,
    seed: int = 0,
    heads: int | None = None,
) -> Path:
    """Build and save a random-initialised LlamaForCausalLM plus tokenizer into ``dir``.

    Returns the directory. ``vocab`` bounds the tokenizer (it may come out smaller, never
    larger) and is the model's embedding size. ``heads`` defaults to ``hidden // 16``; GPU
    attention kernels want a head size of 64 or more, so GPU checks pass ``hidden // 64``.
    """
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    out = Path(dir)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = _build_tokenizer(vocab)
    if len(tokenizer) > vocab:
        raise ValueError(f"tokenizer has {len(tokenizer)} tokens, more than vocab={vocab}")
    if heads is not None and hidden % heads:
        raise ValueError(f"hidden={hidden} is not a multiple of heads={heads}")
    heads = heads or max(1, hidden // 16)
    config = LlamaConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=hidden * 2,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=max(1, heads // 2),
        max_position_embeddings=2048,
        rms_norm_eps=1e-5,
        # A larger init than the default 0.02 so residual streams differ visibly between layers.
        initializer_range=0.2,
        tie_word_embeddings=False,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        torch_dtype="float32",
    )
    generator_state = torch.random.get_rng_state()
    try:
        torch.manual_seed(seed)
        model = LlamaForCausalLM(config)
    finally:
        torch.random.set_rng_state(generator_state)
    model.eval()
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    return out


if __name__ == "__main__":  # pragma: no cover - convenience for building one by hand
    import sys

    print(build_tiny_model(sys.argv[1] if len(sys.argv) > 1 else "tiny-model"))
