"""Training while the extraction runs: two `hsstore extract --shard i/2` processes write one
s3:// dataset while the reference trainer follows it under `torchrun` (gloo, CPU), stopped
and resumed on 2, then 1, then 3 ranks; and the completion records of `extract` itself."""

from __future__ import annotations

import json
import os
import socket
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
from hsstore.demo_model import build_tiny_model
from hsstore.errors import HsstoreError
from hsstore.format.runs import completion
from hsstore.loader import Loader
from hsstore.trainers.eagle3.checkpoint import load_trainer_state

ROOT = Path(__file__).resolve().parents[1]
CLI = "from hsstore.cli import main; main()"
N_PROMPTS = 64
MAX_TOKENS = 96
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


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _train(url: str, out: Path, log: Path, ranks: int, *extra: str) -> str:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(ranks),
           "--master-addr", "127.0.0.1", "--master-port", str(_free_port()),
           "-m", "hsstore.trainers.eagle3", "--data", url, "--out", str(out), "--steps", "1000",
           "--max-tokens", str(MAX_TOKENS), "--draft-vocab-size", "64", "--ttt-steps", "1",
           "--num-threads", "1", "--log-every", "1000", "--device", "cpu", "--follow",
           "--follow-window", str(WINDOW), "--follow-timeout", "120",
           "--samples-log", str(log), *extra]  # fmt: skip
    r = subprocess.run(cmd, cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    return r.stdout


def _log(log: Path, ranks: int) -> list[list[dict]]:
    return [json.loads(Path(f"{log}.rank{r}.json").read_text()) for r in range(ranks)]


def _first_pass(runs: list[list[list[dict]]]) -> Counter:
    return Counter(s for run in runs for rank in run for h in rank
                   if h["epoch"] == 0 and not h["repeat"] for s in h["samples"])  # fmt: skip


def _uninterrupted(url: str, ranks: int, start_version: int) -> dict[int, list[int]]:
    """Global batch -> samples of a 3-rank run that followed from the same version, planned
    afresh on the finished dataset."""
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


def test_trainer_follows_two_extractions_and_resumes_on_1_then_3_ranks(tiny, s3_url, tmp_path):
    data = tmp_path / "p.jsonl"
    data.write_text(_rows(N_PROMPTS))
    first = _extract(tiny, data, s3_url, "0/2")
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:  # the trainer opens the dataset when it starts
        try:
            if len(hsstore.open(s3_url)) >= 2:
                break
        except HsstoreError:
            pass
        assert first.poll() is None or first.returncode == 0, first.stderr.read()
        time.sleep(0.2)
    run = tmp_path / "run"
    # Two steps on two ranks need 4 batches: fewer samples than shard 0 writes alone.
    said = _train(s3_url, run, tmp_path / "a", 2, "--stop-after", "2")
    assert "extraction running" in said  # shard 1 has not even started
    second = _extract(tiny, data, s3_url, "1/2")
    _train(s3_url, run, tmp_path / "b", 1, "--resume", "--stop-after", "4")
    state_b = load_trainer_state(run / "checkpoint")["loader"]
    last = json.loads(_train(s3_url, run, tmp_path / "c", 3, "--resume").strip().splitlines()[-1])
    for proc in (first, second):
        _, err = proc.communicate(timeout=120)
        assert proc.returncode == 0, err
    assert last["extraction_complete"] and last["epoch"] == 1
    a, b, c = _log(tmp_path / "a", 2), _log(tmp_path / "b", 1), _log(tmp_path / "c", 3)
    assert [len(x) for x in a] == [2, 2] and [len(x) for x in b] == [4]
    assert len({len(x) for x in c}) == 1  # every rank ran the same number of steps
    n = len(hsstore.open(s3_url))
    seen = _first_pass([a, b, c])
    assert n == N_PROMPTS and sorted(seen) == list(range(n)) and set(seen.values()) == {1}
    # The resumed runs' batches are those an uninterrupted run at their size has at the same
    # global positions: 1 rank from position 4, 3 ranks from position 8.
    start = state_b["follow"]["start_version"]
    assert state_b["position"] == 8 and state_b["world_size"] == 1
    for log, ranks, first_batch in ((b, 1, 4), (c, 3, 8)):
        whole = _uninterrupted(s3_url, ranks, start)
        got = {h["batch"]: h["samples"] for rank in log for h in rank if not h["repeat"]}
        assert min(got) == first_batch and all(whole[g] == ss for g, ss in got.items())


@pytest.fixture(autouse=True)
def _quiet_torch_threads():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
