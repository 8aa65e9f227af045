"""Training while the extraction runs: two `hsstore extract --shard i/2` processes write one
s3:// dataset while the reference trainer follows it under `torchrun` (gloo, CPU) on 2 ranks,
is killed (SIGKILL) mid-way and resumed from its last checkpoint on 1 and on 3 ranks; and the
completion records of `extract` itself."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

import hsstore
from hsstore.cli import main
from hsstore.commits.runs import completion
from hsstore.demo_model import build_tiny_model
from hsstore.loader import Loader
from hsstore.trainers.eagle3.checkpoint import find_checkpoint, load_trainer_state
from tests.faults import sitecustomize_env
from tools.ports import free_port

ROOT = Path(__file__).resolve().parents[1]
CLI = "from hsstore.cli import main; main()"
N_PROMPTS = 32
MAX_TOKENS = 48
WINDOW = 4


def _rows(n: int) -> str:
    rows = [
        {"messages": [{"role": "user", "content": f"q{i}?"},
                      {"role": "assistant", "content": f"a{i}."}]}
        for i in range(n)
    ]  # fmt: skip
    return "".join(json.dumps(r) + "\n" for r in rows)


def _env() -> dict[str, str]:
    return {**os.environ, "OMP_NUM_THREADS": "1"}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("tiny"), hidden=32, layers=4)


def test_extract_records_when_every_shard_has_finished(tiny, tmp_path):
    data = tmp_path / "p.jsonl"
    data.write_text(_rows(4))
    out = tmp_path / "ds"
    base = ["extract", "--no-progress", "--model", str(tiny), "--data", str(data),
            "--out", str(out), "--device", "cpu"]  # fmt: skip
    assert CliRunner().invoke(main, [*base, "--shard", "0/2"]).exit_code == 0
    state = completion(hsstore.open(out).manifest.provenance)
    assert not state.complete and state.pending == ["1/2 of p.jsonl"]
    report = CliRunner().invoke(main, ["inspect", str(out), "--json"])
    assert json.loads(report.output)["summary"]["extraction"] == {
        "complete": False,
        "pending": ["1/2 of p.jsonl"],
    }
    assert CliRunner().invoke(main, [*base, "--shard", "1/2"]).exit_code == 0
    man = hsstore.open(out).manifest
    assert completion(man.provenance).complete
    finished = [r for r in man.provenance["runs"] if r["event"] == "finished"]
    assert sorted(r["shard"] for r in finished) == ["0/2", "1/2"]
    assert sum(r["samples"] for r in finished) == 4 == len(hsstore.open(out))
    assert "extraction  complete" in CliRunner().invoke(main, ["inspect", str(out)]).output
    # Another job into the same dataset keeps it incomplete until that job has finished too.
    more = tmp_path / "q.jsonl"
    more.write_text(_rows(6))
    again = ["extract", "--no-progress", "--model", str(tiny), "--data", str(more),
             "--out", str(out), "--device", "cpu"]  # fmt: skip
    assert CliRunner().invoke(main, again).exit_code == 0
    assert completion(hsstore.open(out).manifest.provenance).complete


def _extract(model: Path, data: Path, url: str, shard: str) -> subprocess.Popen[str]:
    cmd = [sys.executable, "-c", CLI, "extract", "--no-progress", "--model", str(model),
           "--data", str(data), "--out", url, "--shard", shard, "--batch-size", "1",
           "--commit-every", "2", "--device", "cpu"]  # fmt: skip
    return subprocess.Popen(cmd, cwd=ROOT, env=_env(), stderr=subprocess.PIPE, text=True)


# The killed run holds at its second checkpoint, before writing it: its log then has steps
# past the first checkpoint however fast the steps go, and however little data there is.
HOLD_AT_SECOND_CHECKPOINT = """
import threading

import hsstore.trainers.eagle3.train as train

_saved = [0]
_save = train.save_checkpoint


def _save_then_hold(*args, **kwargs):
    if _saved[0]:
        threading.Event().wait()
    _save(*args, **kwargs)
    _saved[0] += 1


train.save_checkpoint = _save_then_hold
"""


def _train(
    url: str, out: Path, log: Path, ranks: int, *extra: str, env: dict[str, str] | None = None
) -> subprocess.Popen[str]:
    """The trainer following ``url``: under torchrun for several ranks, plain for one."""
    launch = [sys.executable]
    if ranks > 1:
        launch += ["-m", "torch.distributed.run", "--nproc-per-node", str(ranks),
                   "--master-addr", "127.0.0.1", "--master-port", str(free_port())]  # fmt: skip
    cmd = [*launch, "-m", "hsstore.trainers.eagle3", "--data", url, "--out", str(out),
           "--steps", "1000", "--max-tokens", str(MAX_TOKENS), "--draft-vocab-size", "64",
           "--ttt-steps", "1", "--num-threads", "1", "--log-every", "1000", "--device", "cpu",
           "--follow", "--follow-window", str(WINDOW), "--follow-timeout", "120",
           "--samples-log", str(log), *extra]  # fmt: skip
    return subprocess.Popen(cmd, cwd=ROOT, env=env or _env(), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)  # fmt: skip


def _finished(proc: subprocess.Popen[str]) -> str:
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == 0, err[-3000:]
    return out


def _log(log: Path, ranks: int) -> list[list[dict]]:
    return [[json.loads(line) for line in Path(f"{log}.rank{r}.jsonl").read_text().splitlines()]
            for r in range(ranks)]  # fmt: skip


def _process_tree(pid: int) -> list[int]:
    """``pid`` and its descendants (torchrun starts its ranks in sessions of their own)."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        children.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    tree, todo = [], [pid]
    while todo:
        tree.append(todo.pop())
        todo += children.get(tree[-1], [])
    return tree


def _lines(log: Path) -> int:
    path = Path(f"{log}.rank0.jsonl")
    return len(path.read_text().splitlines()) if path.exists() else 0


def _kill_after_checkpoint(proc: subprocess.Popen[str], run: Path, log: Path) -> str:
    """SIGKILL the trainer and every rank once rank 0 has trained a step past its last
    checkpoint (frozen with SIGSTOP to look, so the kill lands where it was seen; a run
    holding at its second checkpoint is always seen so); its output."""
    deadline = time.monotonic() + 240
    while True:
        assert proc.poll() is None, proc.stderr.read()[-3000:] if proc.stderr else ""
        assert time.monotonic() < deadline, "the trainer never trained past a checkpoint"
        if _lines(log) >= 2:
            tree = _process_tree(proc.pid)
            for pid in tree:
                os.kill(pid, signal.SIGSTOP)
            ckpt = find_checkpoint(run)
            if ckpt is not None and _lines(log) > load_trainer_state(ckpt)["step"]:
                for pid in tree:
                    os.kill(pid, signal.SIGKILL)
                return proc.communicate()[0]
            for pid in tree:
                os.kill(pid, signal.SIGCONT)
        time.sleep(0.05)


def _first_pass(runs: list[list[list[dict]]]) -> Counter:
    return Counter(s for run in runs for rank in run for h in rank
                   if h["epoch"] == 0 and not h["repeat"] for s in h["samples"])  # fmt: skip


def _uninterrupted(url: str, ranks: int, start_version: int) -> dict[int, list[int]]:
    """Global batch -> samples of a run at ``ranks`` ranks that followed from the same
    version, planned afresh on the finished dataset."""
    loaders = [Loader(url, max_tokens=MAX_TOKENS, seed=0, rank=r, world_size=ranks,
                      num_threads=1, follow=True, follow_window=WINDOW,
                      follow_from=start_version) for r in range(ranks)]  # fmt: skip
    out = {}
    for ld in loaders:
        for batch in ld:
            epoch, g, repeat = ld.last_batch
            if not repeat:
                out[g] = batch["sample_index"].tolist()
        ld.close()
    return out


def test_trainer_follows_two_extractions_killed_and_resumed_on_1_and_3_ranks(
    tiny, s3_url, tmp_path
):
    """What a SIGKILL'd run has trained on counts up to its last checkpoint: the steps after
    it are trained again by the resumed run, from the checkpoint's global position. So the
    checkpointed steps of the killed run and the resumed run's steps together see each sample
    exactly once in the first pass, whatever the number of ranks the resumed run has."""
    data = tmp_path / "p.jsonl"
    data.write_text(_rows(N_PROMPTS))
    first = _extract(tiny, data, s3_url, "0/2")
    run = tmp_path / "run"
    hold = sitecustomize_env(tmp_path / "hook", HOLD_AT_SECOND_CHECKPOINT, _env())
    # Started with the extraction: the trainer waits for the dataset to exist, then follows.
    killed = _train(s3_url, run, tmp_path / "a", 2, "--save-every", "2", env=hold)
    # Shard 1 starts only after the kill: the extraction cannot be complete before it.
    assert "extraction running" in _kill_after_checkpoint(killed, run, tmp_path / "a")
    second = _extract(tiny, data, s3_url, "1/2")
    for ranks in (1, 3):
        shutil.copytree(run, tmp_path / f"run{ranks}")
    resumed = {r: _train(s3_url, tmp_path / f"run{r}", tmp_path / f"r{r}", r, "--resume")
               for r in (1, 3)}  # fmt: skip
    summaries = {r: json.loads(_finished(p).strip().splitlines()[-1]) for r, p in resumed.items()}
    for proc in (first, second):
        _, err = proc.communicate(timeout=120)
        assert proc.returncode == 0, err
    n = len(hsstore.open(s3_url))
    assert n == N_PROMPTS
    state = load_trainer_state(find_checkpoint(run))  # .old if the kill fell between renames
    k, loader_state = state["step"], state["loader"]
    assert loader_state["world_size"] == 2 and loader_state["position"] == 2 * k
    a = _log(tmp_path / "a", 2)
    assert len(a[0]) > k >= 1  # it was killed after steps the checkpoint does not hold
    kept = [[h for h in rank if h["step"] <= k] for rank in a]
    assert [len(x) for x in kept] == [k, k]
    start = loader_state["follow"]["start_version"]
    for ranks in (1, 3):
        assert summaries[ranks]["extraction_complete"] and summaries[ranks]["first_step"] == k + 1
        log = _log(tmp_path / f"r{ranks}", ranks)
        assert len({len(x) for x in log}) == 1  # every rank ran the same number of steps
        seen = _first_pass([kept, log])
        assert sorted(seen) == list(range(n)) and set(seen.values()) == {1}, ranks
        # The resumed batches are those an uninterrupted run at the new size has at the
        # same global positions, from the checkpoint's on.
        whole = _uninterrupted(s3_url, ranks, start)
        got = {h["batch"]: h["samples"] for rank in log for h in rank if not h["repeat"]}
        assert min(got) == 2 * k and all(whole[g] == ss for g, ss in got.items())


@pytest.fixture(autouse=True)
def _quiet_torch_threads():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
