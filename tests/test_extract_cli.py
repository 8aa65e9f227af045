"""`hsstore extract` end to end on CPU: 2 workers, loader, resume, and kill -9 + restart."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time

import pytest
import torch

import hsstore
from hsstore.demo_model import build_tiny_model
from tests.faults import sitecustomize_env

N_ROWS = 24
WORDS = [
    "the",
    "quick",
    "brown",
    "fox",
    "jumps",
    "over",
    "a",
    "lazy",
    "dog",
    "while",
    "hidden",
    "states",
    "flow",
    "into",
    "drafts",
]


def cli(*args: str, env: dict | None = None, **popen) -> subprocess.Popen:
    """`hsstore ...` in a real child process."""
    cmd = [sys.executable, "-c", "from hsstore.cli import main; main()", *args]
    return subprocess.Popen(
        cmd,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, **(env or {})},
        **popen,
    )


def finish(proc: subprocess.Popen) -> tuple[int, str, str]:
    out, err = proc.communicate(timeout=240)
    return proc.returncode, out, err


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("extract")
    model = build_tiny_model(root / "model")
    rng = random.Random(0)
    rows = []
    for i in range(N_ROWS):
        user = " ".join(rng.choices(WORDS, k=rng.randint(2, 12)))
        reply = " ".join(rng.choices(WORDS, k=rng.randint(1, 25)))
        if i % 3 == 0:
            rows.append(
                {
                    "conversations": [
                        {"from": "human", "value": user},
                        {"from": "gpt", "value": reply},
                    ]
                }
            )
        else:
            rows.append(
                {
                    "messages": [
                        {"role": "user", "content": user},
                        {"role": "assistant", "content": reply},
                    ]
                }
            )
    rows[5] = {"messages": []}  # unusable: skipped and counted
    data = root / "prompts.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return root, model, data


def extract_args(model, data, out) -> list[str]:
    return [
        "extract",
        "--model", str(model),
        "--data", str(data),
        "--out", str(out),
        "--workers", "2",
        "--batch-size", "2",
        "--commit-every", "3",
        "--no-progress",
        "--json",
    ]  # fmt: skip


@pytest.fixture(scope="module")
def reference(setup):
    """An uninterrupted 2-worker run."""
    root, model, data = setup
    out = root / "ref"
    code, stdout, stderr = finish(cli(*extract_args(model, data, out)))
    assert code == 0, stderr
    return out, json.loads(stdout)


def test_two_workers_store_every_sample(setup, reference):
    _, _, data = setup
    out, summary = reference
    assert summary["samples_written"] == N_ROWS - 1
    assert summary["skipped"] == {"empty conversation": 1}
    assert summary["workers"] == 2
    assert 0.0 <= summary["writer_busy_share"] <= 1.0
    assert summary["tokens_per_s"] > 0 and summary["extract_tokens_per_s"] > 0
    # start-up left out of both, each within the run
    assert 0.0 < summary["tokenize_s"] < summary["seconds"]
    assert 0.0 < summary["batches_s"] < summary["seconds"]
    ds = hsstore.open(out)
    assert len(ds) == N_ROWS - 1
    assert ds.num_tokens == summary["tokens_written"]
    # ids are row index + content hash: every usable row, once
    rows = sorted(int(sid[1:9]) for sid in ds.sample_ids)
    assert rows == [i for i in range(N_ROWS) if i != 5]
    assert hsstore.verify(out).ok
    assert [s["reason"] for s in ds.manifest.provenance["skipped"]] == ["empty conversation"]
    # both workers committed segments of their own
    assert len({int(x) for x in ds.index.column("segment").to_pylist()}) >= 2
    for s in ds:
        assert s.loss_mask.sum() > 0
        assert torch.isfinite(s.hidden).all()


def test_loader_yields_every_sample(reference):
    from hsstore.loader import Loader

    out, _ = reference
    ds = hsstore.open(out)
    seen = []
    for batch in Loader(str(out), max_tokens=512, shuffle=False):
        seen.extend(int(i) for i in batch["sample_index"].tolist())
    assert sorted(seen) == list(range(len(ds)))


def test_inspect_passes(reference):
    out, _ = reference
    code, stdout, stderr = finish(cli("inspect", str(out)))
    assert code == 0, stderr


def test_rerun_redoes_nothing(setup, reference):
    """A re-run (here with another worker count: ownership differs, ids do not) adds no sample;
    what it commits is only its own start and finish records."""
    from click.testing import CliRunner

    from hsstore.cli import main

    root, model, data = setup
    out, _ = reference
    before = hsstore.open(out).manifest
    args = extract_args(model, data, out)
    args[args.index("--workers") + 1] = "1"
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 0, result.output
    summary = json.loads(result.output)
    assert summary["samples_written"] == 0
    assert summary["samples_already_present"] == N_ROWS - 1
    after = hsstore.open(out).manifest
    assert after.segments == before.segments
    added = after.provenance.get("runs", [])[len(before.provenance.get("runs", [])) :]
    assert [r["event"] for r in added] == ["started", "finished"]


# Imported at the start of every process of the stalled run (the CLI and its spawned workers):
# a writer that has committed once hangs after its next sample.
STALL_AFTER_FIRST_COMMIT = """
import threading

from hsstore.dataset.writer import Writer

_commits = [0]
_commit, _add = Writer.commit, Writer.add


def _counted_commit(self, *args, **kwargs):
    published = _commit(self, *args, **kwargs)
    _commits[0] += 1
    return published


def _add_then_hang(self, *args, **kwargs):
    _add(self, *args, **kwargs)
    if _commits[0]:
        threading.Event().wait()


Writer.commit, Writer.add = _counted_commit, _add_then_hang
"""


def test_kill_9_then_restart_equals_uninterrupted_run(setup, reference):
    root, model, data = setup
    ref_out, _ = reference
    out = root / "crashed"
    # Each worker stalls (forever) after its first commit plus one uncommitted sample, so the
    # kill lands mid-run with committed and uncommitted work on disk. A short lease ttl, so the
    # killed workers' segments can be judged dead soon after.
    env = sitecustomize_env(root / "stall-hook", STALL_AFTER_FIRST_COMMIT)
    proc = cli(*extract_args(model, data, out), env={**env, "HSSTORE_LEASE_TTL": "1"},
               start_new_session=True)  # fmt: skip
    deadline = time.monotonic() + 180
    committed = 0
    while time.monotonic() < deadline and proc.poll() is None:
        try:
            ds = hsstore.open(out)
            if len(ds.manifest.segments) == 2:  # each worker's first commit, then its stall
                committed = len(ds)
                break
        except (FileNotFoundError, hsstore.HsstoreError):
            pass
        time.sleep(0.2)
    assert proc.poll() is None, proc.communicate()[1]
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait(timeout=60)
    assert proc.returncode == -signal.SIGKILL
    assert 0 < committed < N_ROWS - 1
    assert hsstore.verify(out).ok

    code, stdout, stderr = finish(cli(*extract_args(model, data, out)))
    assert code == 0, stderr
    summary = json.loads(stdout)
    assert summary["samples_already_present"] == committed
    assert summary["samples_written"] == N_ROWS - 1 - committed
    # each stalled worker had started a segment it never committed: debris once its lease
    # lapsed, removed by the rerun's own gc when older than its grace (a slow machine), else here
    time.sleep(1.2)
    removed = len(hsstore.gc(out, grace_s=0).removed_segments)
    assert summary["debris_segments_removed"] + removed >= 1

    ref, got = hsstore.open(ref_out), hsstore.open(out)
    assert sorted(got.sample_ids) == sorted(ref.sample_ids)
    for sid in ref.sample_ids:
        a, b = ref.get(sid), got.get(sid)
        assert torch.equal(a.input_ids, b.input_ids)
        assert torch.equal(a.loss_mask, b.loss_mask)
        assert torch.equal(a.hidden, b.hidden), f"{sid}: states differ after resume"
    assert hsstore.verify(out).ok
