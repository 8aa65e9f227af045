"""Stopped vLLM extractions and their reruns: Ctrl-C, a killed worker, ``--shard``, resume.

One dataset of 12 rows in batches of 2, each committed on its own (``--commit-every 2``), so
each of the two ranks (row ``r`` belongs to rank ``r % 2``) owns three batches. The runs that
are stopped have the stall (``stalled/sitecustomize.py``) on their PYTHONPATH: a worker's engine
computes its first batch, then the worker records the batch it holds and waits, so the signal or
the kill lands at a known point, after a commit, with a known batch in the model. Five engine
starts in all, in this order:

1. ``--workers 2`` (two engines): both commit their first batch; Ctrl-C. The CLI exits 130
   with the one interrupted line; the 4 committed samples stay, the held ones are not stored.
2. ``--shard 1/2`` (rank 1's rows): its first batch, already there, is skipped, the second
   committed; the worker is killed (SIGKILL) with the third in the model. Its engine's
   processes end with it; the CLI names worker 1 and the third batch's samples in one line.
3. ``--shard 1/2`` again: resumes, storing only rank 1's third batch.
4. ``--shard 0/2``: rank 0's rows, its first batch skipped. Then step 1's command, run again,
   finds every sample there and starts no engine. The union is the whole set, each sample
   once, each state transformers' to the fp32 bound.

On one family (Llama): what is checked is hsstore's process handling around the engine.
"""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path
from types import SimpleNamespace

import psutil
import pytest
import tiny_models
import torch
from lane import Reference, cli, finish, group_members, rel_err, run_cli, write_prompts
from vllm_lane import ENGINE_ARGS, FP32_REL_BOUND, HERE, HIDDEN, reference_states

import hsstore
from hsstore.errors import HsstoreError

ROWS = [
    {"text": f"Sample number {i}: the quick brown fox jumps over {i} lazy dogs."} for i in range(12)
]
STALL = HERE / "stalled"
START_S = 600  # engine starts on two shared cores, two at once in the first run


def stalled_env(folder: Path) -> dict[str, str]:
    folder.mkdir()
    return {"PYTHONPATH": f"{STALL}:{os.environ['PYTHONPATH']}", "HSSTORE_LANE_STALL": str(folder)}


def stalls(folder: Path) -> list[dict]:
    """What each stalled worker holds: ``{"pid", "samples"}``."""
    return [json.loads(p.read_text()) for p in sorted(folder.glob("stalled-*.json"))]


def committed(out: Path) -> list[str]:
    try:
        return list(hsstore.open(out).sample_ids)
    except (HsstoreError, OSError):  # not created yet
        return []


def wait_until(ready, proc, what: str) -> None:
    """Until ``ready()``; the command's stderr if it ends first or takes too long."""
    deadline = time.monotonic() + START_S
    while not ready():
        if proc.poll() is not None or time.monotonic() > deadline:
            err = finish(proc, timeout=60)[1]
            raise AssertionError(f"{what}: not reached (exit {proc.returncode}): {err[-3000:]}")
        time.sleep(0.2)


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("runs")
    model = tiny_models.build("LlamaForCausalLM", root / "model", hidden=HIDDEN)
    data = write_prompts(root / "p.jsonl", ROWS)
    out = root / "ds"
    args = ["extract", "--model", str(model), "--data", str(data), "--out", str(out),
            *ENGINE_ARGS, "--dtype", "float32", "--batch-size", "2", "--commit-every", "2",
            "--no-progress"]  # fmt: skip
    return SimpleNamespace(root=root, model=model, out=out, args=args)


@pytest.fixture(scope="module")
def interrupted(setup):
    """Step 1: two workers, Ctrl-C once each has committed its first batch."""
    folder = setup.root / "stall-interrupted"
    proc = cli(*setup.args, "--workers", "2", env=stalled_env(folder))
    try:
        wait_until(
            lambda: len(stalls(folder)) == 2 and len(committed(setup.out)) == 4,
            proc,
            "both workers committed a batch and hold the next",
        )
        held = stalls(folder)
        proc.send_signal(signal.SIGINT)  # to the CLI alone, as a terminal's Ctrl-C
        _, err = finish(proc, timeout=300)
    finally:
        if proc.poll() is None:
            proc.kill()
    return SimpleNamespace(code=proc.returncode, err=err, held=held)


@pytest.fixture(scope="module")
def killed(setup, interrupted):
    """Step 2: ``--shard 1/2``, its worker killed with its second batch to compute committed
    and the third in the model."""
    folder = setup.root / "stall-killed"
    proc = cli(*setup.args, "--shard", "1/2", env=stalled_env(folder), start_new_session=True)
    try:
        wait_until(
            lambda: stalls(folder) and len(committed(setup.out)) == 6,
            proc,
            "the worker committed a batch and holds the next",
        )
        (held,) = stalls(folder)
        victim = psutil.Process(held["pid"])
        engine = victim.children(recursive=True)  # the engine core and its model worker
        victim.send_signal(signal.SIGKILL)
        _, alive = psutil.wait_procs(engine, timeout=30)
        _, err = finish(proc, timeout=300)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    return SimpleNamespace(code=proc.returncode, err=err, held=held, engine=engine, alive=alive)


@pytest.fixture(scope="module")
def finished(setup, killed):
    """Steps 3 and 4, and step 1's command again."""
    return SimpleNamespace(
        shard1=run_cli(*setup.args, "--shard", "1/2", timeout=600),
        shard0=run_cli(*setup.args, "--shard", "0/2", timeout=600),
        again=run_cli(*setup.args, "--workers", "2", timeout=600),
    )


@pytest.mark.timeout(1200)
def test_ctrl_c_says_what_is_kept_in_one_line_and_keeps_it(setup, interrupted):
    assert interrupted.code == 128 + signal.SIGINT, interrupted.err[-3000:]
    lines = [x for x in interrupted.err.splitlines() if x.strip()]
    assert lines[-1] == (
        f"interrupted (SIGINT): 4 samples committed in {setup.out} are kept; "
        "rerun the same command to resume"
    ), interrupted.err[-3000:]
    assert [x for x in lines if x.startswith("interrupted (")] == lines[-1:]
    ids = committed(setup.out)
    assert len(ids) == 4 and hsstore.verify(setup.out).ok
    held = [s for w in interrupted.held for s in w["samples"]]
    assert len(held) == 4 and not set(held) & set(ids)
    for w in interrupted.held:  # each worker and its engine ended
        assert group_members(w["pid"]) == [], w


@pytest.mark.timeout(1200)
def test_a_killed_worker_is_named_with_its_samples_in_one_line(setup, killed):
    assert killed.code == 2, killed.err[-3000:]
    assert len(killed.engine) >= 2, killed.engine  # it was killed with its engine running
    assert killed.alive == [], [(p.pid, p.name()) for p in killed.alive]
    assert group_members(killed.held["pid"]) == []
    lines = [x for x in killed.err.splitlines() if "died" in x]
    assert len(lines) == 1, killed.err[-3000:]
    samples = ", ".join(killed.held["samples"])
    expect = f"worker 1 died (exit code -9) while extracting samples {samples} (not stored)"
    assert expect in lines[0], lines[0]
    assert str(setup.out) in lines[0] and "re-run to resume" in lines[0]
    ids = committed(setup.out)
    assert len(ids) == 6 and not set(killed.held["samples"]) & set(ids)
    assert hsstore.verify(setup.out).ok


def stored(summary: dict) -> tuple[int, int]:
    return summary["samples_already_present"], summary["samples_written"]


@pytest.mark.timeout(1800)
def test_reruns_and_shards_complete_the_set_once_each(setup, finished):
    assert stored(finished.shard1) == (4, 2)  # the killed worker's rows, resumed
    assert stored(finished.shard0) == (2, 4)
    assert stored(finished.again) == (12, 0)  # the interrupted command: nothing left to do
    ds = hsstore.open(setup.out)
    assert len(ds) == len(ds.sample_ids) == len(set(ds.sample_ids)) == len(ROWS)
    assert sorted(int(s[1:9]) for s in ds.sample_ids) == list(range(len(ROWS)))
    assert hsstore.verify(setup.out).ok
    ref = Reference(setup.model, torch.float32)
    for sid in ds.sample_ids:
        s = ds.get(sid)
        expect = reference_states(ref, s.input_ids)
        for j, spec in enumerate(ds.layers):
            assert rel_err(s.hidden[:, j], expect[spec.label]) <= FP32_REL_BOUND, (sid, spec)
