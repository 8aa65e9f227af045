"""Two worker processes, each with its own vLLM engine; one killed, and the command run again.

On one family (Llama): what is checked is hsstore's process handling around the engine (the
engine core and its workers end with the killed worker's process group; the dead worker is
named with its samples; the rerun finishes the set), which no model family changes.
"""

from __future__ import annotations

import os
import signal
import time

import psutil
import pytest
import tiny_models
import torch
from lane import Reference, cli, finish, rel_err, run_cli, write_prompts
from vllm_lane import ENGINE_ARGS, FP32_REL_BOUND, HIDDEN, reference_states

import hsstore

ROWS = [
    {"text": f"Sample number {i}: the quick brown fox jumps over {i} lazy dogs."} for i in range(8)
]


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("workers")
    model = tiny_models.build("LlamaForCausalLM", root / "model", hidden=HIDDEN)
    data = write_prompts(root / "p.jsonl", ROWS)
    args = ["extract", "--model", str(model), "--data", str(data), *ENGINE_ARGS]
    args += ["--dtype", "float32", "--workers", "2", "--batch-size", "2", "--commit-every", "2"]
    return root, model, args


def spawned_workers(proc: psutil.Process) -> list[psutil.Process]:
    """The runner's spawned worker processes (not multiprocessing's resource tracker)."""
    out = []
    for child in proc.children():
        try:
            if "spawn_main" in " ".join(child.cmdline()):
                out.append(child)
        except psutil.NoSuchProcess:
            continue
    return out


def assert_transformers_states(out, model) -> None:
    ds, ref = hsstore.open(out), Reference(model, torch.float32)
    for sid in ds.sample_ids:
        s = ds.get(sid)
        expect = reference_states(ref, s.input_ids)
        for j, spec in enumerate(ds.layers):
            assert rel_err(s.hidden[:, j], expect[spec.label]) <= FP32_REL_BOUND, (sid, spec)


@pytest.mark.timeout(1800)  # a killed run and a rerun, each starting engines
def test_one_worker_killed_then_the_rerun_completes_the_set(setup):
    root, model, args = setup
    out = root / "killed"
    proc = cli(*args, "--out", str(out), "--no-progress", "--json", start_new_session=True)
    try:
        parent = psutil.Process(proc.pid)
        deadline = time.monotonic() + 300
        while len(spawned_workers(parent)) < 2 and time.monotonic() < deadline:
            time.sleep(0.2)
        workers = spawned_workers(parent)
        assert len(workers) == 2, finish(proc, timeout=60)[1][-2000:]
        victim = workers[0]
        # once its engine core and the engine's worker run (grandchildren): the kill must take
        # the whole engine with it
        while len(victim.children(recursive=True)) < 2 and time.monotonic() < deadline + 300:
            time.sleep(0.2)
        engine = victim.children(recursive=True)
        assert len(engine) >= 2, finish(proc, timeout=300)[1][-3000:]
        victim.send_signal(signal.SIGKILL)
        _, alive = psutil.wait_procs(engine, timeout=30)
        assert alive == [], [(p.pid, p.name()) for p in alive]
        stdout, stderr = finish(proc, timeout=900)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == 2, stderr[-2000:]  # a worker failed; committed samples kept
    line = [x for x in stderr.splitlines() if "died (exit code -9)" in x]
    assert line and "re-run to resume" in line[0], stderr[-2000:]
    assert hsstore.verify(out).ok
    kept = len(hsstore.open(out))
    assert kept < len(ROWS)

    summary = run_cli(*args, "--out", str(out), timeout=900)
    assert summary["samples_already_present"] == kept
    assert summary["samples_written"] == len(ROWS) - kept
    assert len(hsstore.open(out)) == len(ROWS)
    assert hsstore.verify(out).ok
    assert_transformers_states(out, model)
