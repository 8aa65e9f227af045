"""Two worker processes, each with its own engine; one killed, and the command run again.

On one architecture (Llama): the runs are what an engine start costs most, and what is checked
here is hsstore's process handling around the engine, which no model family changes.
"""

from __future__ import annotations

import os
import signal
import time

import psutil
import pytest
import tiny_models
import torch
from lane import (
    ENGINE_ARGS,
    Reference,
    cli,
    compare,
    finish,
    group_members,
    run_cli,
    write_prompts,
)

import hsstore
from hsstore.extractors.backends.sglang.memory import engine_start_lock_path

ROWS = [
    {"text": f"Sample number {i}: the quick brown fox jumps over {i} lazy dogs."} for i in range(8)
]


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("workers")
    model = tiny_models.build("LlamaForCausalLM", root / "model")
    data = write_prompts(root / "p.jsonl", ROWS)
    args = ["extract", "--model", str(model), "--data", str(data), *ENGINE_ARGS]
    args += ["--dtype", "float32", "--workers", "2", "--batch-size", "2"]
    return root, model, args


def workers_of(proc: psutil.Process) -> list[psutil.Process]:
    """The runner's spawned worker processes (not multiprocessing's resource tracker)."""
    out = []
    for child in proc.children():
        try:
            cmd = " ".join(child.cmdline())
        except psutil.NoSuchProcess:
            continue
        if "spawn_main" in cmd:
            out.append(child)
    return out


def running(proc: psutil.Process) -> bool:
    """Whether ``proc`` still runs (a zombie, ended but not yet reaped, does not)."""
    try:
        return proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def start_lock_holders() -> list[tuple[int, str]]:
    """The processes that have the file of the engine start lock open (`engine_start_lock`)."""
    path, out = os.path.realpath(engine_start_lock_path()), []
    for p in psutil.process_iter():
        try:
            if any(f.path == path for f in p.open_files()):
                out.append((p.pid, " ".join(p.cmdline())[:120]))
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
    return out


@pytest.fixture(scope="module")
def two_workers(setup):
    """An uninterrupted run with two workers, each with its own engine."""
    root, _, args = setup
    return root / "two", run_cli(*args, "--out", str(root / "two"), timeout=900)


@pytest.mark.timeout(1200)  # two engines, started one after the other
def test_two_workers_store_every_sample_bit_for_bit(setup, two_workers):
    root, model, _ = setup
    _, summary = two_workers
    assert summary["workers"] == 2
    assert summary["samples_written"] == len(ROWS)
    rows = compare(root / "two", Reference(model, torch.float32))
    assert [r for r in rows if not r["equal"]] == []
    assert hsstore.verify(root / "two").ok


@pytest.mark.timeout(1200)  # a killed run and a rerun, each starting engines
def test_one_worker_killed_then_the_rerun_completes_the_set(setup, two_workers):
    root, _, args = setup
    out = root / "killed"
    proc = cli(*args, "--out", str(out), "--no-progress", "--json", start_new_session=True)
    try:
        parent = psutil.Process(proc.pid)
        deadline = time.monotonic() + 120
        while len(workers_of(parent)) < 2 and time.monotonic() < deadline:
            time.sleep(0.2)
        workers = workers_of(parent)
        assert len(workers) == 2, finish(proc, timeout=60)[1][-2000:]
        victim = workers[0]
        # kill it once its engine's processes exist: the other worker goes on meanwhile
        # (engines on CPU start one after the other: the victim may wait for the other's)
        while (
            not victim.children(recursive=True)
            and running(victim)
            and time.monotonic() < deadline + 480
        ):
            time.sleep(0.2)
        engine_procs = victim.children(recursive=True)
        if not engine_procs:  # it ended or waited first: the clues, before the CLI ends
            alive, holders = running(victim), start_lock_holders()
            stderr = finish(proc, timeout=300)[1]
            raise AssertionError(
                f"the worker started no engine process (still running: {alive}; the engine "
                f"start lock open in {holders}); the command's stderr ends: {stderr[-3000:]}"
            )
        victim.send_signal(signal.SIGKILL)
        # the runner ends the killed worker's process group at once, its engine's processes
        # with it, whether or not they had set their parent-death signal yet
        _, alive = psutil.wait_procs(engine_procs, timeout=20)
        assert alive == [], [(p.pid, p.name()) for p in alive]
        assert group_members(victim.pid) == []
        # nothing of it holds the CLI's pipes: the CLI returns once the other worker is done
        stdout, stderr = finish(proc, timeout=300)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == 2, stderr[-2000:]  # a worker failed; committed samples kept
    assert "died (exit code -9)" in stderr and "re-run to resume" in stderr, stderr[-2000:]
    assert hsstore.verify(out).ok
    kept = len(hsstore.open(out))
    assert 0 < kept < len(ROWS)  # the other worker's share was committed

    summary = run_cli(*args, "--out", str(out))
    assert summary["samples_already_present"] == kept
    assert summary["samples_written"] == len(ROWS) - kept
    ref, got = hsstore.open(two_workers[0]), hsstore.open(out)
    assert sorted(got.sample_ids) == sorted(ref.sample_ids)
    for sid in ref.sample_ids:
        a, b = ref.get(sid), got.get(sid)
        assert a.input_ids.equal(b.input_ids) and a.hidden.equal(b.hidden), sid
    assert hsstore.verify(out).ok
