"""Model classes whose SGLang aux capture is wrong are refused before anything is stored.

The reason is read from the real sglang wheel's sources (never imported), at the lines
hsstore/extract/sglang_models.py cites; the refusal itself is the CLI's, in a child process,
before SGLang is even looked for. The real engine's wrong Gemma 3 states are shown in
tests/sglang_engine/test_engine_architectures.py.
"""

from __future__ import annotations

import os
import subprocess
import sys
import zipfile

import pytest
from sglang_wheel import find_wheel

from hsstore.extract.sglang_models import WRONG_AUX_CAPTURE

GEMMA3 = "sglang/srt/models/gemma3_causal.py"


def wheel_lines(path: str) -> list[str]:
    with zipfile.ZipFile(find_wheel()) as z:
        return z.read(path).decode().splitlines()


def test_the_cited_gemma3_capture_keeps_the_residual_apart():
    lines = wheel_lines(GEMMA3)
    # the decoder layer hands back its MLP branch and the residual stream separately ...
    assert lines[410 - 1].strip() == "outputs = (hidden_states, residual)"
    assert "hidden_states = self.post_feedforward_layernorm(hidden_states)" in lines[408 - 1]
    # ... and the model captures the first, on the torch path and the AMX CPU path alike
    for line in (639, 657):
        assert lines[line - 1].strip() == "aux_hidden_states.append(hidden_states)", line
        assert lines[line - 2].strip() == "if i in self.layers_to_capture:", line
    assert f"{GEMMA3.removeprefix('sglang/')}:657" in WRONG_AUX_CAPTURE["Gemma3ForCausalLM"]
    # the multimodal class runs the same text model
    mm = wheel_lines("sglang/srt/models/gemma3_mm.py")
    assert mm[195 - 1].strip() == "self.language_model = Gemma3ForCausalLM("


def gemma3_config(kind: str, out):
    from transformers import Gemma3Config, Gemma3TextConfig

    text = dict(vocab_size=256, hidden_size=32, intermediate_size=64, num_hidden_layers=4,
                num_attention_heads=2, num_key_value_heads=1, head_dim=16)  # fmt: skip
    if kind == "Gemma3ForCausalLM":
        config = Gemma3TextConfig(**text)
    else:
        config = Gemma3Config(text_config=text)
    config.architectures = [kind]
    config.save_pretrained(out)
    return out


@pytest.mark.parametrize("kind", sorted(WRONG_AUX_CAPTURE))
def test_extract_refuses_gemma3_before_storing_anything(tmp_path, kind):
    model = gemma3_config(kind, tmp_path / "model")
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"text": "The quick brown fox."}\n')
    out = tmp_path / "ds"
    cmd = [sys.executable, "-c", "from hsstore.cli import main; main()", "extract",
           "--model", str(model), "--data", str(prompts), "--out", str(out),
           "--backend", "sglang", "--device", "cpu"]  # fmt: skip
    got = subprocess.run(cmd, capture_output=True, text=True, env=os.environ, timeout=120)
    assert got.returncode == 2, got.stderr
    lines = got.stderr.strip().splitlines()
    assert len(lines) == 1, got.stderr
    assert f"cannot extract {kind}" in lines[0] and str(model) in lines[0]
    assert "MLP branch, not the residual stream" in lines[0]
    assert "gemma3_causal.py:657" in lines[0]
    assert lines[0].endswith("use --backend transformers")
    assert not out.exists()
