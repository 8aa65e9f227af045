"""Training while the extraction runs, against extracting first and training after.

On the tiny random Llama (``hsstore.demo_model``), in one run, each way in its own processes:

* sequential: ``hsstore extract`` over the prompt set, then, once it has finished, the
  reference trainer for one epoch over the result;
* following: the same extraction into a fresh dataset, and the trainer started with
  ``--follow`` at the same time (it waits for the dataset to be created); it ends with its
  first pass, when the extraction has recorded that it is complete.

Both are timed from the start of the extraction to the end of the trainer's first pass
(every sample trained on once), process start-up and exit included. ``first_step_s``: from
the start of the extraction to the following trainer's first batch. The two ways alternate
over ``--rounds`` rounds; the best of each is kept (a shared machine disturbs single runs).

Both ways do the same work: the same extraction (batches of 4 prompts on the CPU, a commit
every ``--commit-every`` samples), the same trainer options, one epoch. Following can only
hide what overlaps: with extraction time E and training time T, sequential takes E + T and
following about max(E, T) plus what comes after the extraction's completion record: noticing
it, the last window's steps, the checkpoint and the trainer's exit (each round prints when the
record landed; the sequential E also counts the extraction's exit, which following does not
wait for). It needs a core for each of the two processes: on a saturated machine the two
ways cost the same CPU time, and take about as long. The balance is set by the trainer's
draft steps: 7 (``--ttt-steps``, the TTT length EAGLE-3 and SpecForge train with), which
makes the tiny drafter's epoch about as long as the tiny target's extraction. That is the
balance of a real run: for an 8B target, extraction (one forward of 32 layers) and a TTT-7
step of its one-layer drafter (seven unrolled steps, forward and backward, through a 32k
draft head) take about the same arithmetic per token, some 16 GFLOP. Each round prints
E and T as the sequential way measured them.

    python tools/bench_follow.py                 # 96 prompts, 2 rounds, a minute or two idle
    python tools/bench_follow.py --rounds 3      # the figure in docs/PERFORMANCE.md
    python tools/bench_follow.py --prompts 24 --rounds 1   # smoke test

The last line is machine-readable. ``balance_bound``: max(E, T) / (E + T) of the best
sequential round, what perfect overlap would give; ``data_bound``: the same with the trainer's
steps, at their sequential pace, starting no earlier than the extraction's first window (they
train on its samples). On the 2-core machine at a load average of 0.8 to 1.1 (before the
bounds were printed), then at 25 to 40 (neither process has a core of its own):
    follow_wall_vs_sequential=0.59 first_step_s=5.0
    follow_wall_vs_sequential=1.09 first_step_s=23.9 balance_bound=0.60 data_bound=0.75
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from datetime import datetime
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script from anywhere

import hsstore  # noqa: E402
from hsstore.commits import history  # noqa: E402
from hsstore.demo_model import build_tiny_model  # noqa: E402
from hsstore.spec import paths  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
CLI = "from hsstore.cli import main; main()"


def _env() -> dict[str, str]:
    return {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}


def write_prompts(path: Path, n: int) -> None:
    rows = [
        {
            "messages": [
                {"role": "user", "content": f"question {i}: what follows {i * 7 % 97}?"},
                {"role": "assistant", "content": f"the answer is {i * 7 % 97 + 1}, then more."},
            ]
        }
        for i in range(n)
    ]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


def extract(model: Path, data: Path, out: Path, commit_every: int) -> subprocess.Popen[str]:
    cmd = [sys.executable, "-c", CLI, "extract", "--no-progress", "--model", str(model),
           "--data", str(data), "--out", str(out), "--batch-size", "4",
           "--commit-every", str(commit_every), "--device", "cpu"]  # fmt: skip
    return subprocess.Popen(cmd, cwd=ROOT, env=_env(), stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True)  # fmt: skip


def train(model: Path, data: Path, run: Path, *extra: str) -> dict:
    cmd = [sys.executable, "-m", "hsstore.trainers.eagle3", "--data", str(data),
           "--target", str(model), "--out", str(run), "--steps", "100000", "--epochs", "1",
           "--max-tokens", "256", "--ttt-steps", "7", "--draft-vocab-size", "256",
           "--num-threads", "1", "--log-every", "100000", "--device", "cpu", *extra]  # fmt: skip
    r = subprocess.run(cmd, cwd=ROOT, env=_env(), capture_output=True, text=True)
    if r.returncode != 0:
        raise SystemExit(f"trainer failed: {r.stderr[-2000:]}")
    return json.loads(r.stdout.strip().splitlines()[-1])


def finish(proc: subprocess.Popen[str]) -> None:
    _, err = proc.communicate()
    if proc.returncode != 0:
        raise SystemExit(f"extraction failed: {err[-2000:]}")


def sequential(
    model: Path, prompts: Path, work: Path, commit_every: int, window: int
) -> tuple[float, float, float, float]:
    """(wall time, of which extraction, when its first window was committed, the trainer's
    start-up to its first step)."""
    out = work / "seq"
    t0 = time.time()
    finish(extract(model, prompts, out, commit_every))
    extracted = time.time() - t0
    summary = train(model, out, work / "seq-run")
    wall = time.time() - t0
    assert summary["steps"] > 0
    startup = summary["first_batch_time"] - t0 - extracted
    return wall, extracted, first_window_at(out, window) - t0, startup


def completed_at(out: Path) -> float:
    """Wall-clock time of the extraction's "finished" run record."""
    runs = hsstore.open(out).manifest.provenance["runs"]
    at = max(r["at"] for r in runs if r["event"] == "finished")
    return datetime.fromisoformat(at).timestamp()


def first_window_at(out: Path, window: int) -> float:
    """Wall-clock time of the first version holding ``window`` samples (its file's mtime): from
    then on the follower has the samples its first step waits for."""
    storage = hsstore.open(out).storage
    for v in history.list_versions(storage):
        if history.load_manifest(storage, v).num_samples >= window:
            return os.stat(storage.path_of(paths.manifest_key(v))).st_mtime
    return float("nan")


def following(
    model: Path, prompts: Path, work: Path, commit_every: int, window: int
) -> tuple[float, float, float, float, int]:
    """(wall time, first window committed, first step, extraction recorded complete, steps),
    times from the start."""
    out = work / "follow"
    t0 = time.time()
    proc = extract(model, prompts, out, commit_every)
    # Started with the extraction: it waits for the dataset to be created, then follows it.
    summary = train(model, out, work / "follow-run", "--follow", "--follow-window", str(window))
    wall = time.time() - t0
    finish(proc)
    if not summary["extraction_complete"]:
        raise SystemExit("the following trainer ended before the extraction was complete")
    return (wall, first_window_at(out, window) - t0, summary["first_batch_time"] - t0,
            completed_at(out) - t0, summary["steps"])  # fmt: skip


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--prompts", type=int, default=96)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--commit-every", type=int, default=8, help="extraction commits")
    p.add_argument("--window", type=int, default=8, help="--follow-window of the trainer")
    args = p.parse_args()
    work = Path(tempfile.mkdtemp(prefix="hsstore-bench-follow-"))
    try:
        model = build_tiny_model(work / "tiny")
        prompts = work / "p.jsonl"
        write_prompts(prompts, args.prompts)
        seq, fol, first, bounds, data_bounds = [], [], [], [], []
        for r in range(args.rounds):
            for path in ("seq", "seq-run", "follow", "follow-run"):
                shutil.rmtree(work / path, ignore_errors=True)
            seq_wall, extracted, seq_window, startup = sequential(
                model, prompts, work, args.commit_every, args.window
            )
            seq.append(seq_wall)
            wall, window_s, first_s, done_s, steps = following(
                model, prompts, work, args.commit_every, args.window
            )
            fol.append(wall)
            first.append(first_s)
            # Perfect overlap: the longer of E and T alone, against both one after the other.
            trained = seq_wall - extracted
            bounds.append(max(extracted, trained) / seq_wall)
            # What the data allow: the trainer's steps cannot start before the first window,
            # so at best they follow it at the sequential pace (its start-up overlapped).
            data_bounds.append(max(extracted, trained, seq_window + trained - startup) / seq_wall)
            print(
                f"round {r}: sequential {seq_wall:.1f} s (extract {extracted:.1f} s, then train "
                f"{seq_wall - extracted:.1f} s, its first step after {startup:.1f} s), "
                f"following {wall:.1f} s (first window committed after {window_s:.1f} s, first "
                f"step after {first_s:.1f} s, extraction complete after {done_s:.1f} s, then "
                f"{wall - done_s:.1f} s to the trainer's exit, {steps} steps); "
                f"bound max(E, T) / (E + T) = {bounds[-1]:.2f}, with the steps after the first "
                f"window (committed after {seq_window:.1f} s) {data_bounds[-1]:.2f}",
                flush=True,
            )
        print(f"prompts {args.prompts}, best of {args.rounds}: sequential {min(seq):.1f} s, "
              f"following {min(fol):.1f} s")  # fmt: skip
        print(
            f"follow_wall_vs_sequential={min(fol) / min(seq):.2f} first_step_s={min(first):.1f} "
            f"balance_bound={bounds[seq.index(min(seq))]:.2f} "
            f"data_bound={data_bounds[seq.index(min(seq))]:.2f}"
        )
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
