"""The layer-id traps users of speculators and SpecForge fall into each end in correct output or
one line naming the fix (the forgotten final id of speculators 0.9 is in
tests/test_interop_speculators.py)."""

from __future__ import annotations

import json

import torch
from click.testing import CliRunner

import hsstore
from hsstore.cli import main
from hsstore.interop.convert import convert
from tools.convert_fixtures import write_specforge_dir, write_v1_dir


def test_v1_export_says_the_vllm_ids_speculators_07_expects(tmp_path):
    write_v1_dir(tmp_path / "v1", [3, 4], layer_ids=[1, 3, 5, 7], hidden_size=16)
    convert(tmp_path / "v1", tmp_path / "ds", progress=False)
    ds = hsstore.open(tmp_path / "ds")
    r = CliRunner().invoke(main, ["convert", str(tmp_path / "ds"), str(tmp_path / "out")])
    assert r.exit_code == 0, r.output
    vllm = [s.depth for s in ds.layers]  # a vLLM id is the depth
    assert f"--target-layer-ids takes vLLM ids: {','.join(map(str, vllm))}" in r.output
    assert vllm == [2, 4, 6, 8]


def test_fresh_v1_data_config_records_both_conventions(tmp_path):
    from hsstore.spec.layers import LayerSpec

    layers = [LayerSpec(3), LayerSpec(5), LayerSpec(8)]
    ds = hsstore.create(tmp_path / "ds", layers=layers, hidden_size=8, dtype=torch.bfloat16,
                        model={"num_hidden_layers": 8})  # fmt: skip
    with ds.writer() as w:
        w.add("a", torch.arange(4), torch.ones(4, dtype=torch.int64),
              torch.randn(4, 3, 8).to(torch.bfloat16))  # fmt: skip
        w.commit()
    convert(tmp_path / "ds", tmp_path / "out", progress=False)
    cfg = json.loads((tmp_path / "out" / "data_config.json").read_text())
    assert cfg["hidden_states"]["layer_ids"] == [2, 4, 7]
    assert cfg["hidden_states"]["vllm_layer_ids"] == [3, 5, 8]


def test_inspect_catches_a_final_state_deeper_than_the_model(tmp_path):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(hidden_size=16, intermediate_size=32, num_hidden_layers=8,
                      num_attention_heads=2, num_key_value_heads=2, vocab_size=32000)  # fmt: skip
    LlamaForCausalLM(cfg).save_pretrained(tmp_path / "model", safe_serialization=True)
    write_specforge_dir(tmp_path / "sf", [6, 5, 7], hidden_size=16)
    # The trap: SpecForge files do not record the depth, and 32 is typed for an 8-layer model.
    convert(tmp_path / "sf", tmp_path / "ds", layer_ids=[1, 3, 5], num_hidden_layers=32,
            progress=False)  # fmt: skip
    assert hsstore.open(tmp_path / "ds").layers[-1].label == "after 32 +final_norm"
    r = CliRunner().invoke(
        main, ["inspect", str(tmp_path / "ds"), "--lm-head", str(tmp_path / "model"), "--json"]
    )
    doc = json.loads(r.stdout)
    check = next(c for c in doc["checks"] if c["name"] == "model_depth")
    assert check["verdict"] == "FAIL" and r.exit_code != 0
    assert "re-convert with --num-hidden-layers 8" in check["reason"]

    convert(tmp_path / "sf", tmp_path / "good", layer_ids=[1, 3, 5], num_hidden_layers=8,
            progress=False)  # fmt: skip
    r = CliRunner().invoke(
        main, ["inspect", str(tmp_path / "good"), "--lm-head", str(tmp_path / "model"), "--json"]
    )
    check = next(c for c in json.loads(r.stdout)["checks"] if c["name"] == "model_depth")
    assert check["verdict"] == "OK"


def test_export_only_options_are_refused_on_import(tmp_path):
    write_v1_dir(tmp_path / "v1", [3], layer_ids=[1, 3], hidden_size=16)
    for extra in (["--fp8"], ["--target", str(tmp_path)]):
        r = CliRunner().invoke(
            main, ["convert", str(tmp_path / "v1"), str(tmp_path / "ds"), *extra]
        )
        assert r.exit_code == 2 and extra[0] in r.stderr, r.output
        assert len(r.stderr.strip().splitlines()) == 1
    assert not (tmp_path / "ds").exists()
