"""Tensor parallelism on the real vLLM engine on CPU: ``--tp-size 2``, one engine start.

Both ranks run the model (each holds half of every layer's heads and MLP, its all-reduce over
gloo/shared memory) and both get hsstore's capture hook; only rank 0 hands the states over. The
hooks are watched (``ranks/sitecustomize.py``): each rank's process records that its hook was
installed and, per forward, that it captured. The stored states are transformers' to the lane's
fp32 bound at every stored depth, and every sample is stored exactly once.
"""

from __future__ import annotations

import json
import os

import tiny_models
import torch
from lane import Reference, cli, finish, rel_err, write_prompts
from vllm_lane import FP32_REL_BOUND, HERE, HIDDEN, extract_args, reference_states

import hsstore

RANKS = HERE / "ranks"
LAYERS = "0,eagle3,final-prenorm,final"


def test_two_ranks_run_and_rank_0_alone_hands_the_states_over(tmp_path):
    model = tiny_models.build("LlamaForCausalLM", tmp_path / "model", hidden=HIDDEN)
    prompts = write_prompts(tmp_path / "p.jsonl")
    watch = tmp_path / "ranks"
    watch.mkdir()
    env = {
        "PYTHONPATH": f"{RANKS}:{os.environ['PYTHONPATH']}",
        "HSSTORE_LANE_RANKS": str(watch),
    }
    args = extract_args(model, prompts, tmp_path / "ds", "--dtype", "float32", "--layers", LAYERS)
    proc = cli(*args, "--tp-size", "2", "--check-against", "transformers", "--no-progress",
               "--json", env=env)  # fmt: skip
    out, err = finish(proc, timeout=600)
    assert proc.returncode == 0, err[-4000:]
    summary = json.loads(out)

    installed = [json.loads(p.read_text()) for p in watch.glob("installed-*.json")]
    assert sorted(r["rank"] for r in installed) == [0, 1], installed
    assert len({r["pid"] for r in installed}) == 2  # one process per rank
    rank0 = next(r["pid"] for r in installed if r["rank"] == 0)
    captured = {p.name: p.read_text().splitlines() for p in watch.glob("captured-*.jsonl")}
    assert list(captured) == [f"captured-{rank0}.jsonl"], captured
    assert all(json.loads(line)["rank"] == 0 for line in captured[f"captured-{rank0}.jsonl"])

    ds = hsstore.open(tmp_path / "ds")
    assert len(ds) == summary["samples_written"] == 4
    assert len(set(ds.sample_ids)) == len(ds.sample_ids) == 4
    assert hsstore.verify(tmp_path / "ds").ok
    ref = Reference(model, torch.float32)
    for sid in ds.sample_ids:
        s = ds.get(sid)
        assert s.hidden.shape == (len(s.input_ids), len(ds.layers), HIDDEN)  # exactly T rows
        expect = reference_states(ref, s.input_ids)
        for j, spec in enumerate(ds.layers):
            assert rel_err(s.hidden[:, j], expect[spec.label]) <= FP32_REL_BOUND, (sid, spec)
    check = summary["check"]  # the CLI's own validation against transformers
    assert check["ok"], check["problems"]
    assert max(check["max_rel_err"]) <= FP32_REL_BOUND
