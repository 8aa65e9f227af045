"""Llama and Qwen3 on the real vLLM engine against transformers, and what the backend refuses.

Per family one CLI run (one engine start) in fp32 storing depth 0, the default aux layers
(``eagle3``), the final state before the norm and after it, with ``--check-against
transformers``; the stored states are then compared here with transformers' own on the stored
token ids. docs/EXTRACT.md says which other families run on vLLM's CPU path and why not.
"""

from __future__ import annotations

import json
import os

import pytest
import tiny_models
import torch
from lane import Reference, cli, finish, rel_err, run_cli, write_prompts
from vllm_lane import (
    FP32_REL_BOUND,
    HIDDEN,
    OTHER_RELEASE,
    PLANTED,
    extract_args,
    reference_states,
)

import hsstore
from hsstore.extractors.layer_select import eagle3_aux_layers
from hsstore.spec.layers import LayerSpec

N = tiny_models.N_LAYERS
FAMILIES = ["LlamaForCausalLM", "Qwen3ForCausalLM"]
LAYERS = "0,eagle3,final-prenorm,final"


@pytest.fixture(scope="module")
def prompts(tmp_path_factory):
    return write_prompts(tmp_path_factory.mktemp("prompts") / "p.jsonl")


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    return tiny_models.build("LlamaForCausalLM", tmp_path_factory.mktemp("llama"), hidden=HIDDEN)


@pytest.fixture(scope="module", params=FAMILIES)
def fp32(request, tmp_path_factory, prompts, llama):
    arch = request.param
    root = tmp_path_factory.mktemp(arch)
    model = (
        llama if arch == "LlamaForCausalLM" else tiny_models.build(arch, root / "m", hidden=HIDDEN)
    )
    args = extract_args(model, prompts, root / "ds", "--dtype", "float32", "--layers", LAYERS)
    summary = run_cli(*args, "--check-against", "transformers")
    return arch, model, root / "ds", summary


def test_fp32_states_are_transformers_to_float32_rounding(fp32):
    arch, model, out, summary = fp32
    ds = hsstore.open(out)
    assert ds.layers == [
        LayerSpec(0),
        *eagle3_aux_layers(N),
        LayerSpec(N),
        LayerSpec(N, final_norm=True),
    ]
    assert len(ds) == summary["samples_written"] == 4
    ref = Reference(model, torch.float32)
    worst = 0.0
    for sid in ds.sample_ids:
        s = ds.get(sid)
        assert s.hidden.shape == (len(s.input_ids), len(ds.layers), HIDDEN)  # exactly T rows
        expect = reference_states(ref, s.input_ids)
        for j, spec in enumerate(ds.layers):
            err = rel_err(s.hidden[:, j], expect[spec.label])
            worst = max(worst, err)
            # never as far as any other layer of the same sample
            others = [rel_err(v, expect[spec.label]) for k, v in expect.items() if k != spec.label]
            assert err < 0.01 * min(others), (arch, spec.label, err, min(others))
            if spec.depth == 0:  # the embeddings are looked up, not computed
                assert torch.equal(s.hidden[:, j], expect[spec.label]), arch
    assert worst <= FP32_REL_BOUND, (arch, worst)
    check = summary["check"]  # the CLI's own validation, in another process
    assert check["ok"], check["problems"]
    assert max(check["max_rel_err"]) <= FP32_REL_BOUND


def test_check_against_catches_a_planted_wrong_layer(tmp_path, prompts, llama):
    """With every aux capture moved one layer deeper (planted/sitecustomize.py), the run (default
    layers) stores states under the wrong labels and --check-against transformers refuses them,
    naming the aux layers, while the final state, untouched, agrees."""
    args = extract_args(llama, prompts, tmp_path / "ds", "--dtype", "float32")
    env = {"PYTHONPATH": f"{PLANTED}:{os.environ['PYTHONPATH']}"}
    proc = cli(*args, "--check-against", "transformers", "--no-progress", "--json", env=env)
    out, err = finish(proc, timeout=600)
    assert proc.returncode == 1, err[-3000:]
    check = json.loads(out)["check"]
    assert not check["ok"]
    worst = dict(zip(check["layers"], check["max_rel_err"]))
    for spec in eagle3_aux_layers(N):
        assert worst[spec.label] > 0.1, worst
        assert any(p.startswith(f"{spec.label}:") for p in check["problems"]), check["problems"]
    assert worst[f"after {N}"] <= FP32_REL_BOUND  # the default's final state, before the norm


def test_another_vllm_release_is_refused_in_one_line(tmp_path, prompts, llama):
    env = {"PYTHONPATH": f"{OTHER_RELEASE}:{os.environ['PYTHONPATH']}"}
    proc = cli(*extract_args(llama, prompts, tmp_path / "ds"), "--no-progress", env=env)
    _, err = finish(proc, timeout=120)
    assert proc.returncode == 2, err[-3000:]
    lines = err.strip().splitlines()
    assert len(lines) == 1, err[-3000:]
    assert "vLLM 0.31.0 is not a version" in lines[0] and "HSSTORE_VLLM_UNTESTED=1" in lines[0]
    assert not (tmp_path / "ds").exists()
