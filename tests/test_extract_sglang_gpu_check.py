"""The parts of tools/gpu_check_sglang.py that do not need a GPU."""

from __future__ import annotations

import json

import torch
from transformers import AutoConfig, AutoTokenizer

from hsstore.extractors.backends.transformers import TransformersBackend
from hsstore.spec.layers import LayerSpec
from tools.gpu_check_sglang import (
    CHUNK,
    build_check_models,
    capture_copy_check,
    chat_tokens,
    chunked_prompt_text,
)


def test_capture_copy_check_runs_on_the_host_sink():
    report = capture_copy_check("cpu", rows=64, hidden=256)
    assert report["sink"] == "HostSink" and report["equal"] and report["ok"]
    assert report["gb_s"] > 0 and report["forward_held_us"] > 0


def test_chunked_prefill_prompt_is_several_chunks_and_fits_the_context(tmp_path):
    from hsstore.demo_model import build_tiny_model

    model = build_tiny_model(tmp_path / "m")
    tokenizer = AutoTokenizer.from_pretrained(model)
    context = int(AutoConfig.from_pretrained(model).max_position_embeddings)
    n = chat_tokens(tokenizer, chunked_prompt_text(tokenizer, context))
    assert 3 * CHUNK < n <= context - 64


def test_check_models_are_the_architectures_sglang_runs(tmp_path):
    models = build_check_models(tmp_path, hidden=128, layers=4)
    archs = {
        name: json.loads((tmp_path / name / "config.json").read_text())["architectures"]
        for name in models
    }
    assert archs == {
        "llama": ["LlamaForCausalLM"],
        "qwen3": ["Qwen3ForCausalLM"],
        "deepseek_v3": ["DeepseekV3ForCausalLM"],
    }
    config = AutoConfig.from_pretrained(models["deepseek_v3"])
    assert config.kv_lora_rank == 512 and config.qk_rope_head_dim == 64  # MLA
    assert config.n_routed_experts == 8 and config.first_k_dense_replace == 1  # MoE after layer 0
    layers = [LayerSpec(d) for d in (1, 2, 3)] + [LayerSpec(4, final_norm=True)]
    for name, path in models.items():
        tokenizer = AutoTokenizer.from_pretrained(path)
        ids = torch.tensor(tokenizer("the model reads every prompt")["input_ids"])
        from hsstore.extractors.chat_tokens import TokenizedPrompt

        prompt = TokenizedPrompt("s", 0, ids, torch.ones_like(ids), "x", False)
        backend = TransformersBackend(path, layers, torch_dtype="float32")
        try:
            (states,) = backend.run([prompt])
        finally:
            backend.close()
        assert states.shape == (len(ids), 4, 128) and torch.isfinite(states).all(), name
        # distinct layers: the check's wrong-layer test needs them apart
        for j in range(3):
            assert not torch.allclose(states[:, j], states[:, j + 1]), (name, j)
