"""Models that ship their own code (Kimi-K2.x style): --trust-remote-code and slow tokenizers.

The fixture turns the tiny model into one whose config, model class and tokenizer are custom
code loaded through ``auto_map``, with a slow (pure Python) tokenizer that has no offset
mapping, like Kimi-K2.x's tiktoken tokenizer.
"""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from click.testing import CliRunner

import hsstore
from hsstore.cli import main
from hsstore.demo_model import build_tiny_model

CONFIG_CODE = """from transformers import LlamaConfig


class TinyCustomConfig(LlamaConfig):
    model_type = "tiny_custom"
"""
MODEL_CODE = """from transformers import LlamaForCausalLM

from .configuration_tiny import TinyCustomConfig


class TinyCustomForCausalLM(LlamaForCausalLM):
    config_class = TinyCustomConfig
"""
TOKENIZER_CODE = '"""A slow (pure Python) tokenizer over the tiny model\'s BPE: no offset mapping, like tiktoken\'s."""\n\nimport os\n\nfrom tokenizers import Tokenizer\nfrom transformers import PreTrainedTokenizer\n\n\nclass TinySlowTokenizer(PreTrainedTokenizer):\n    vocab_files_names = {"vocab_file": "tokenizer.json"}\n\n    def __init__(self, vocab_file=None, **kwargs):\n        self._bpe = Tokenizer.from_file(vocab_file)\n        self._vocab = self._bpe.get_vocab(with_added_tokens=True)\n        self._inv = {i: t for t, i in self._vocab.items()}\n        super().__init__(**kwargs)\n\n    @property\n    def vocab_size(self):\n        return len(self._vocab)\n\n    def get_vocab(self):\n        return dict(self._vocab)\n\n    def _tokenize(self, text, **kwargs):\n        return self._bpe.encode(text, add_special_tokens=False).tokens\n\n    def _convert_token_to_id(self, token):\n        return self._vocab[token]\n\n    def _convert_id_to_token(self, index):\n        return self._inv[index]\n\n    def convert_tokens_to_string(self, tokens):\n        return self._bpe.decode([self._vocab[t] for t in tokens])\n\n    def save_vocabulary(self, save_directory, filename_prefix=None):\n        return (os.path.join(save_directory, "tokenizer.json"),)\n'


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("remote")
    plain = build_tiny_model(root / "plain", layers=4)
    custom = root / "custom"
    shutil.copytree(plain, custom)
    (custom / "configuration_tiny.py").write_text(CONFIG_CODE)
    (custom / "modeling_tiny.py").write_text(MODEL_CODE)
    (custom / "tokenization_tiny.py").write_text(TOKENIZER_CODE)
    config = json.loads((custom / "config.json").read_text())
    config["model_type"] = "tiny_custom"
    config["architectures"] = ["TinyCustomForCausalLM"]
    config["auto_map"] = {
        "AutoConfig": "configuration_tiny.TinyCustomConfig",
        "AutoModelForCausalLM": "modeling_tiny.TinyCustomForCausalLM",
    }
    (custom / "config.json").write_text(json.dumps(config))
    tok = json.loads((custom / "tokenizer_config.json").read_text())
    tok.pop("backend", None)
    tok["tokenizer_class"] = "TinySlowTokenizer"
    tok["auto_map"] = {"AutoTokenizer": ["tokenization_tiny.TinySlowTokenizer", None]}
    (custom / "tokenizer_config.json").write_text(json.dumps(tok))
    return plain, custom


@pytest.fixture(scope="module")
def prompts(tmp_path_factory):
    path = tmp_path_factory.mktemp("p") / "p.jsonl"
    rows = [
        [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello there!"}],
        [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": "Add 2 and 2."},
            {"role": "assistant", "content": "4."},
            {"role": "user", "content": "And 3 and 3?"},
            {"role": "assistant", "content": "That is 6, of course."},
        ],
    ]
    path.write_text("".join(json.dumps({"messages": m}) + "\n" for m in rows))
    return path


def extract(model, prompts, out, *extra):
    args = ["extract", "--model", str(model), "--data", str(prompts), "--out", str(out)]
    return CliRunner().invoke(main, [*args, "--dtype", "float32", "--no-progress", *extra])


def test_custom_code_needs_the_flag(models, prompts, tmp_path):
    _, custom = models
    out = tmp_path / "ds"
    result = extract(custom, prompts, out)
    assert result.exit_code == 2, result.output
    lines = [line for line in result.output.splitlines() if line.strip()]
    assert len(lines) == 1 and "--trust-remote-code" in lines[0], result.output
    assert "Traceback" not in result.output
    assert not out.exists()


def test_custom_code_and_slow_tokenizer_store_what_the_plain_model_does(models, prompts, tmp_path):
    plain, custom = models
    from transformers import AutoTokenizer

    assert not AutoTokenizer.from_pretrained(custom, trust_remote_code=True).is_fast
    assert extract(plain, prompts, tmp_path / "plain").exit_code == 0
    result = extract(custom, prompts, tmp_path / "custom", "--trust-remote-code")
    assert result.exit_code == 0, result.output
    a, b = hsstore.open(tmp_path / "plain"), hsstore.open(tmp_path / "custom")
    assert sorted(a.sample_ids) == sorted(b.sample_ids) and len(a) == 2
    for sid in a.sample_ids:
        x, y = a.get(sid), b.get(sid)
        assert torch.equal(x.input_ids, y.input_ids)
        assert torch.equal(x.loss_mask, y.loss_mask)  # offsets (fast) == pieces (slow)
        assert 0 < int(y.loss_mask.sum()) < len(y.loss_mask)
        torch.testing.assert_close(y.hidden, x.hidden, rtol=0, atol=0)
