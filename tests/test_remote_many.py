"""Many machines on one dataset on s3://, gs:// and az://: `extract --shard i/N` processes
standing in for nodes, and the trainer under `torchrun --nproc-per-node 2` (gloo, CPU). They
spend their time in extraction and training, not in storage, so on gs:// and az:// they run
with fewer prompts and samples (the same code paths: several writers' commits, a killed
writer, readers on two ranks, a resume)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import pytest
import torch

import hsstore
from hsstore import LayerSpec
from hsstore.demo_model import build_tiny_model
from hsstore.errors import HsstoreError
from hsstore.loader import Loader
from tools.ports import free_port

ROOT = Path(__file__).resolve().parents[1]
CLI = "from hsstore.cli import main; main()"
N_PROMPTS = 12


def _rows(n: int) -> str:
    rows = [
        {
            "messages": [
                {"role": "user", "content": f"question {i}?"},
                {"role": "assistant", "content": f"answer number {i}."},
            ]
        }  # fmt: skip
        for i in range(n)
    ]
    return "".join(json.dumps(r) + "\n" for r in rows)


def _env() -> dict[str, str]:
    return {**os.environ, "OMP_NUM_THREADS": "1"}


def _small(remote, n: int) -> int:
    """``n`` on S3; half of it on the other services (a bounded CI time)."""
    return n if remote.scheme == "s3" else n // 2


def test_extract_shards_write_every_prompt_once_even_after_a_kill(remote, tmp_path):
    url, n_prompts = remote.url, _small(remote, N_PROMPTS)
    model = build_tiny_model(tmp_path / "tiny")
    data = tmp_path / "p.jsonl"
    data.write_text(_rows(n_prompts))

    def extract(shard: str) -> subprocess.Popen[str]:
        cmd = [sys.executable, "-c", CLI, "extract", "--no-progress", "--model", str(model),
               "--data", str(data), "--out", url, "--shard", shard, "--batch-size", "1",
               "--commit-every", "1", "--device", "cpu"]  # fmt: skip
        return subprocess.Popen(cmd, cwd=ROOT, env=_env(), stderr=subprocess.PIPE, text=True)

    # Three nodes at once; node 2 is killed (-9) once it has committed, wherever it then is.
    procs = {shard: extract(f"{shard}/3") for shard in range(3)}
    deadline = time.monotonic() + 180
    while procs[2].poll() is None and time.monotonic() < deadline:
        try:
            if any(sid for sid in hsstore.open(url).sample_ids):
                break
        except HsstoreError:
            pass
        time.sleep(0.1)
    procs[2].send_signal(signal.SIGKILL)
    procs[2].wait()
    for shard in (0, 1):
        _, err = procs[shard].communicate(timeout=240)
        assert procs[shard].returncode == 0, err
    rerun = extract("2/3")
    _, err = rerun.communicate(timeout=240)
    assert rerun.returncode == 0, err
    ds = hsstore.open(url)
    ids = ds.sample_ids
    assert len(ids) == len(set(ids)) == n_prompts  # every prompt exactly once
    assert hsstore.verify(url).ok


def _dataset(url: str, n: int = 24) -> None:
    """Random states for next-token training (the trainer needs no target model for it)."""
    g = torch.Generator().manual_seed(0)
    ds = hsstore.create(
        url,
        layers=[LayerSpec(1), LayerSpec(2), LayerSpec(3), LayerSpec(4, final_norm=True)],
        hidden_size=32,
        dtype=torch.float32,
        model={"name": "toy", "num_hidden_layers": 4, "hidden_size": 32, "vocab_size": 128},
    )
    with ds.writer() as w:
        for i in range(n):
            t = int(torch.randint(12, 40, (1,), generator=g))
            mask = torch.ones(t, dtype=torch.int64)
            mask[:4] = 0
            w.add(f"s{i}", torch.randint(0, 128, (t,), generator=g), mask,
                  torch.randn(t, 4, 32, generator=g))  # fmt: skip


def _torchrun(url: str, out: Path, log: Path, steps: int, *extra: str) -> None:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
           "--master-addr", "127.0.0.1", "--master-port", str(free_port()), "-m", "hsstore.trainers.eagle3",
           "--data", url, "--out", str(out), "--steps", str(steps), "--max-tokens", "64",
           "--draft-vocab-size", "64", "--ttt-steps", "2", "--num-threads", "1",
           "--log-every", "100", "--device", "cpu", "--samples-log", str(log), *extra]  # fmt: skip
    r = subprocess.run(cmd, cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]


def _steps(log: Path, rank: int) -> list[list[int]]:
    lines = Path(f"{log}.rank{rank}.jsonl").read_text().splitlines()
    return [json.loads(line)["samples"] for line in lines]


def test_torchrun_two_ranks_cover_each_sample_once_and_resume_exactly(remote, tmp_path):
    url, n = remote.url, _small(remote, 24)
    _dataset(url, n)
    per_rank = []
    for rank in range(2):
        loader = Loader(url, max_tokens=64, shuffle=True, seed=0, rank=rank, world_size=2,
                        num_threads=1)  # fmt: skip
        per_rank.append(sum(1 for _ in loader))
        loader.close()
    steps = min(per_rank) + 2  # into the second epoch
    _torchrun(url, tmp_path / "full", tmp_path / "full-log", steps)
    first_epoch = Counter()
    for rank in range(2):
        for batch in _steps(tmp_path / "full-log", rank)[: per_rank[rank]]:
            first_epoch.update(batch)
    assert sorted(first_epoch) == list(range(n)) and set(first_epoch.values()) == {1}

    _torchrun(url, tmp_path / "cut", tmp_path / "cut-a", steps, "--stop-after", "3")
    _torchrun(url, tmp_path / "cut", tmp_path / "cut-b", steps, "--resume")
    for rank in range(2):
        full = _steps(tmp_path / "full-log", rank)
        assert _steps(tmp_path / "cut-a", rank) == full[:3]
        assert _steps(tmp_path / "cut-b", rank) == full[3:]


@pytest.fixture(autouse=True)
def _quiet_torch_threads():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
