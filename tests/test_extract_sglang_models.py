"""Model classes whose SGLang aux capture is wrong are refused before anything is stored.

The reasons are read from the real sglang wheel's sources (never imported), at the lines
hsstore/extractors/backends/sglang/models.py cites and docs/EXTRACT.md lists; the refusal itself is the
CLI's, in a child process, before SGLang is even looked for. The real engine's wrong Gemma 3
states are shown in tests/sglang_engine/test_engine_architectures.py.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import zipfile

import pytest
from sglang_wheel import MODELS, find_wheel

from hsstore.extractors.backends.sglang.models import WRONG_AUX_CAPTURE

# (file under sglang/srt/, line, the line's stripped text): what each verdict rests on.
CITED = [
    # Llama, the right capture: layer id k is captured at the entry of layer k + 1, after the
    # residual add (the attention boundary's capture gets the updated residual stream)
    ("models/llama.py", 941, "self.model.layers_to_capture = [val + 1 for val in layer_ids]"),
    ("models/llama.py", 403, "hidden_states, forward_batch, capture=capture_output"),
    ("layers/layer_boundary/stage.py", 447, "value = stream.residual"),
    # Gemma 3: a decoder layer hands back its MLP branch and the residual stream apart ...
    ("models/gemma3_causal.py", 408, "hidden_states = self.post_feedforward_layernorm(hidden_states)"),
    ("models/gemma3_causal.py", 410, "outputs = (hidden_states, residual)"),
    # ... and the model captures the first, on the torch path and the AMX CPU path alike
    ("models/gemma3_causal.py", 638, "if i in self.layers_to_capture:"),
    ("models/gemma3_causal.py", 639, "aux_hidden_states.append(hidden_states)"),
    ("models/gemma3_causal.py", 656, "if i in self.layers_to_capture:"),
    ("models/gemma3_causal.py", 657, "aux_hidden_states.append(hidden_states)"),
    # the multimodal class runs the same text model
    ("models/gemma3_mm.py", 195, "self.language_model = Gemma3ForCausalLM("),
    # Qwen4Exp: the model hands a layer the capture flag ...
    ("models/qwen4_exp.py", 2133, "captured_last_layer_outputs=("),
    # ... both layer kinds pass only the PLE batch on, and the attention boundary gets no capture
    ("models/qwen4_exp.py", 1783, 'hidden_states, forward_batch, kwargs.get("ple_batch")'),
    ("models/qwen4_exp.py", 1984, 'hidden_states, forward_batch, kwargs.get("ple_batch")'),
    ("models/qwen4_exp.py", 1710, "return self.attn_boundary.prepare(hidden_states, forward_batch)"),
    ("models/qwen4_exp.py", 1713, "return self.attn_boundary.prepare(hidden_states, forward_batch)"),
    # ... and a forward returns the hyper-connection streams where the aux states belong
    ("models/qwen4_exp.py", 2171, "return hidden_states, hc_hidden_states"),
]  # fmt: skip
# model_type of each refused class, for a config.json transformers parses
MODEL_TYPE = {
    "Gemma3ForCausalLM": "gemma3_text",
    "Gemma3ForConditionalGeneration": "gemma3",
    "Qwen4ExpForConditionalGeneration": "qwen4_exp",
}


@pytest.fixture(scope="module")
def wheel():
    with zipfile.ZipFile(find_wheel()) as z:
        yield z


@pytest.mark.parametrize(("path", "line", "text"), CITED, ids=[f"{p}:{n}" for p, n, _ in CITED])
def test_the_cited_line_is_in_the_wheel(wheel, path, line, text):
    lines = wheel.read(f"sglang/srt/{path}").decode().splitlines()
    assert lines[line - 1].strip() == text


def test_every_refusal_cites_lines_that_are_checked():
    checked = {(p.removeprefix("models/"), n) for p, n, _ in CITED}
    for kind, reason in WRONG_AUX_CAPTURE.items():
        cited = re.findall(rf"{MODELS}(\w+\.py):(\d+)", reason)
        assert cited, kind
        assert {(f, int(n)) for f, n in cited} <= checked, kind


@pytest.mark.parametrize("kind", sorted(WRONG_AUX_CAPTURE))
def test_extract_refuses_before_storing_anything(tmp_path, kind):
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(
        json.dumps({"architectures": [kind], "model_type": MODEL_TYPE[kind]})
    )
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
    assert f"cannot extract {kind}: {WRONG_AUX_CAPTURE[kind]}" in lines[0]
    assert str(model) in lines[0]
    assert lines[0].endswith("use --backend transformers")
    assert not out.exists()
