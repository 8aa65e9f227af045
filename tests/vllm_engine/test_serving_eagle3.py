"""Drafters trained from hsstore data, served by vLLM 0.32's EAGLE-3 speculative decoding on CPU.

A small version of tools/bench_acceptance.py: a tiny target trained here on a synthetic chat
grammar (tools/chat_grammar.py) answers its prompts greedily, ``hsstore extract`` stores the
states, the reference trainer trains a drafter, and vLLM serves the checkpoint on held-out
prompts (tools/vllm_spec_decode.py, in a child process). The engine's own counters must be
what the trainer's prediction (the engine's walk replayed offline) says, and a checkpoint with
a draft vocabulary smaller than the target's must serve as well.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("vllm")  # the vLLM lane's environment (scripts/vllm_env.sh)

import hsstore  # noqa: E402
from hsstore.trainers.eagle3.acceptance import predict_acceptance  # noqa: E402
from hsstore.trainers.eagle3.checkpoint import load_drafter  # noqa: E402
from hsstore.trainers.eagle3.model import TargetHead, load_target_tensors  # noqa: E402
from hsstore.trainers.eagle3.train import main as train  # noqa: E402
from hsstore.trainers.eagle3.train import split_layers
from tools.chat_grammar import train_target, write_prompt_sets  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
K, MAX_TOKENS, HELD_OUT = 3, 16, 8


def extract(model: Path, prompts: Path, out: Path) -> Path:
    subprocess.run(
        [sys.executable, "-c", "from hsstore.cli import main; main()", "extract",
         "--model", str(model), "--data", str(prompts), "--out", str(out),
         "--layers", "eagle3,final-prenorm", "--dtype", "float32", "--device", "cpu",
         "--no-progress"],
        check=True, cwd=ROOT, timeout=600,
    )  # fmt: skip
    return out


def serve(target: Path, drafter: Path, prompts: list, tmp: Path) -> dict:
    request = tmp / f"{drafter.parent.name}.json"
    request.write_text(json.dumps({"target": str(target), "drafter": str(drafter), "k": K,
                                   "max_tokens": MAX_TOKENS, "prompts": prompts}))  # fmt: skip
    proc = subprocess.run(
        [sys.executable, str(ROOT / "tools" / "vllm_spec_decode.py"), str(request)],
        capture_output=True, text=True, timeout=900,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-4000:]
    line = [x for x in proc.stdout.splitlines() if x.startswith("RESULT ")][-1]
    return json.loads(line[len("RESULT ") :])


@pytest.fixture(scope="module")
def chain(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("serve")
    torch.set_num_threads(1)  # tiny models on shared cores: one thread avoids spin-waiting
    target = train_target(tmp / "target", steps=400, hidden=64, heads=2)  # head_dim 32
    sets = write_prompt_sets(target, tmp / "prompts", train=96, held_out=HELD_OUT,
                             held_out_tokens=MAX_TOKENS + K + 1)  # fmt: skip
    data = extract(target, tmp / "prompts" / "train.jsonl", tmp / "ds")
    held = extract(target, tmp / "prompts" / "held_out.jsonl", tmp / "held")
    common = ["--data", str(data), "--target", str(target), "--lr", "2e-3", "--warmup", "10",
              "--num-threads", "1", "--log-every", "50", "--eval-data", str(held)]  # fmt: skip
    full = train([*common, "--out", str(tmp / "full"), "--steps", "150",
                  "--draft-vocab-size", "256"])  # fmt: skip
    small = train([*common, "--out", str(tmp / "small"), "--steps", "20",
                   "--draft-vocab-size", "128"])  # fmt: skip
    return {"tmp": tmp, "target": target, "held": held, "sets": sets,
            "full": Path(full["checkpoint"]), "small": Path(small["checkpoint"])}  # fmt: skip


@pytest.mark.timeout(2400)
def test_engine_counts_what_the_trainer_predicts(chain):
    """The full draft vocabulary (no d2t in the checkpoint, as vLLM needs it); the engine's
    per-position acceptance is the offline walk's on the same held-out sequences."""
    served = serve(chain["target"], chain["full"], chain["sets"]["prompts"], chain["tmp"])
    assert served["outputs"] == [g[:MAX_TOKENS] for g in chain["sets"]["greedy"]]
    counters = served["counters"]
    engine_drafts = counters["vllm:spec_decode_num_drafts"]
    engine = counters["vllm:spec_decode_num_accepted_tokens_per_pos"]
    assert engine[0] > 0, counters  # a drafter that is accepted at all

    drafter, _ = load_drafter(chain["full"])
    ds = hsstore.open(chain["held"])
    aux, last = split_layers(ds.layers, ds.manifest.model.num_hidden_layers, need_last=True)
    tensors, config = load_target_tensors(chain["target"])
    head = TargetHead(tensors["norm"], tensors["head"], float(config["rms_norm_eps"]),
                      apply_norm=not ds.layers[last].final_norm)  # fmt: skip
    offline = predict_acceptance(
        drafter, chain["held"], aux_layers=aux, head=head, k=K, max_new_tokens=MAX_TOKENS
    )
    # the same drafts, counted the same way: equal up to a rare float tie between two tokens
    assert abs(offline.drafts - engine_drafts) <= max(2, engine_drafts // 20), (offline, counters)
    for p in range(K):
        assert abs(offline.accepted_per_pos[p] - engine[p]) <= max(2, engine_drafts // 20), (
            p,
            offline,
            counters,
        )


@pytest.mark.timeout(1200)
def test_checkpoint_with_a_smaller_draft_vocabulary_serves(chain):
    saved = json.loads((chain["small"] / "config.json").read_text())
    assert saved["draft_vocab_size"] == 128 < saved["vocab_size"]
    served = serve(chain["target"], chain["small"], chain["sets"]["prompts"], chain["tmp"])
    # greedy verification: whatever the drafter proposes, the engine emits the target's tokens
    assert served["outputs"] == [g[:MAX_TOKENS] for g in chain["sets"]["greedy"]]
    assert served["counters"]["vllm:spec_decode_num_drafts"] > 0
