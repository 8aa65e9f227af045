"""Acceptance of a drafter trained from hsstore data, counted by vLLM while serving it, beside
the trainer's offline prediction.

    python tools/bench_acceptance.py [--workdir DIR] [--json]

The chain: a target with learnable structure (tools/chat_grammar.py: a tiny Llama trained here
on a synthetic chat grammar) answers the grammar's prompts greedily -> ``hsstore extract``
(transformers, ``--layers eagle3,final-prenorm``) -> the reference trainer
(``python -m hsstore.trainers.eagle3``) -> the checkpoint served by vLLM 0.32's EAGLE-3
speculative decoding (tools/vllm_spec_decode.py, greedy, k draft tokens) on held-out prompts ->
the engine's ``vllm:spec_decode_*`` counters. Beside them, the prediction
(hsstore/trainers/eagle3/acceptance.py) on the same held-out sequences, stored by the same
extraction. The same chain runs on a dataset made deliberately wrong (the aux states labelled
one layer deeper than they are, the seed's speculators-v1 bug), and ``hsstore inspect --model``
judges both datasets.

vLLM runs in its own environment: ``--vllm-python`` (default ``$HSSTORE_VLLM_PYTHON``, else
scripts/vllm_env.sh's ``~/.cache/hsstore/vllm-0.32.0``). Last line:
``engine_accept_rate=… offline_accept_rate=… agreement=… mean_accept_len=…
wrong_layers_accept_rate=…`` (first draft position; agreement = engine / offline).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # run as a script from anywhere

from tools.chat_grammar import train_target, write_prompt_sets  # noqa: E402

CLI = [sys.executable, "-c", "from hsstore.cli import main; main()"]


def default_vllm_python() -> str:
    if os.environ.get("HSSTORE_VLLM_PYTHON"):
        return os.environ["HSSTORE_VLLM_PYTHON"]
    cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return str(cache / "hsstore" / "vllm-0.32.0" / "bin" / "python")


def extract(model: Path, prompts: Path, out: Path) -> Path:
    if not out.exists():
        subprocess.run(
            [*CLI, "extract", "--model", str(model), "--data", str(prompts), "--out", str(out),
             "--layers", "eagle3,final-prenorm", "--dtype", "float32", "--device", "cpu",
             "--no-progress"],
            check=True, cwd=REPO,
        )  # fmt: skip
    return out


def relabel_one_deeper(src: Path, out: Path) -> Path:
    """The dataset at ``src`` with its aux states labelled one layer deeper than computed (what a
    layer-id convention mixed up by one does); the last state keeps its label."""
    import hsstore

    if out.exists():
        return out
    ds = hsstore.open(src)
    last = max(ds.layers, key=lambda s: s.depth)
    layers = [s if s is last else hsstore.LayerSpec(depth=s.depth + 1) for s in ds.layers]
    info = ds.manifest.model
    wrong = hsstore.create(
        out, layers=layers, hidden_size=ds.hidden_size, dtype=ds.dtype,
        model={"name": info.name, "num_hidden_layers": info.num_hidden_layers,
               "hidden_size": info.hidden_size, "vocab_size": info.vocab_size},
    )  # fmt: skip
    with wrong.writer() as w:
        for sid in ds.sample_ids:
            s = ds.get(sid)
            w.add(sid, s.input_ids, s.loss_mask, s.hidden)
    return out


def inspect_verdict(ds: Path, model: Path) -> dict:
    """``hsstore inspect DS --model MODEL --json``: the verdict and the checks that failed."""
    proc = subprocess.run(
        [*CLI, "inspect", str(ds), "--model", str(model), "--json"],
        capture_output=True, text=True, cwd=REPO,
    )  # fmt: skip
    try:
        report = json.loads(proc.stdout)
    except ValueError:
        return {"verdict": f"exit {proc.returncode}", "failed": [proc.stderr.strip()[-300:]]}
    failed = [c["name"] for c in report.get("checks", []) if c.get("verdict") == "FAIL"]
    return {"verdict": report.get("verdict"), "failed": failed}


def train(data: Path, held_out: Path, target: Path, out: Path, args) -> dict:
    from hsstore.trainers.eagle3.train import main as trainer

    return trainer([
        "--data", str(data), "--target", str(target), "--out", str(out),
        "--steps", str(args.trainer_steps), "--draft-vocab-size", str(args.draft_vocab_size),
        "--lr", "1e-3", "--warmup", "20", "--log-every", "50", "--num-threads", "1",
        "--eval-data", str(held_out), "--eval-samples", str(args.held_out),
        "--eval-draft-tokens", str(args.k),
    ])["summary"]  # fmt: skip


def offline(checkpoint: Path, held_out: Path, target: Path, args) -> dict:
    """The prediction on the held-out sequences, stopped where the engine's requests stop."""
    import hsstore
    from hsstore.trainers.eagle3.acceptance import predict_acceptance
    from hsstore.trainers.eagle3.checkpoint import load_drafter
    from hsstore.trainers.eagle3.model import TargetHead, load_target_tensors
    from hsstore.trainers.eagle3.train import split_layers

    drafter, _ = load_drafter(checkpoint)
    ds = hsstore.open(held_out)
    aux, last = split_layers(ds.layers, ds.manifest.model.num_hidden_layers, need_last=True)
    tensors, config = load_target_tensors(target)
    head = TargetHead(tensors["norm"], tensors["head"], float(config["rms_norm_eps"]),
                      apply_norm=not ds.layers[last].final_norm)  # fmt: skip
    counts = predict_acceptance(
        drafter, held_out, aux_layers=aux, head=head, k=args.k, max_new_tokens=args.max_tokens
    )
    return counts.to_json()


def serve(target: Path, checkpoint: Path, prompts: list, workdir: Path, args) -> dict:
    request = workdir / f"serve-{checkpoint.parent.name}.json"
    request.write_text(json.dumps({"target": str(target), "drafter": str(checkpoint),
                                   "k": args.k, "max_tokens": args.max_tokens,
                                   "prompts": prompts}))  # fmt: skip
    proc = subprocess.run(
        [args.vllm_python, str(REPO / "tools" / "vllm_spec_decode.py"), str(request)],
        capture_output=True, text=True, env={**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1"},
    )  # fmt: skip
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    if proc.returncode != 0 or not lines:
        raise RuntimeError(f"vLLM failed (exit {proc.returncode}): {proc.stderr[-3000:]}")
    result = json.loads(lines[-1][len("RESULT ") :])
    c = result["counters"]
    drafts = c["vllm:spec_decode_num_drafts"]
    per_pos = c["vllm:spec_decode_num_accepted_tokens_per_pos"]
    result["engine"] = {
        "drafts": drafts,
        "accepted_per_pos": per_pos,
        "accept_rate_per_pos": [a / drafts for a in per_pos],
        "mean_accepted_length": 1 + c["vllm:spec_decode_num_accepted_tokens"] / drafts,
    }
    return result


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--workdir", help="keeps the target, datasets and checkpoints for reuse")
    p.add_argument("--target-steps", type=int, default=1200, help="target training steps")
    p.add_argument("--train", type=int, default=256, help="training prompts")
    p.add_argument("--held-out", type=int, default=16, help="held-out prompts served")
    p.add_argument("--max-tokens", type=int, default=32, help="tokens generated per prompt")
    p.add_argument("--k", type=int, default=3, help="draft tokens per engine step")
    p.add_argument("--trainer-steps", type=int, default=300)
    p.add_argument("--draft-vocab-size", type=int, default=256)
    p.add_argument("--vllm-python", default=default_vllm_python())
    p.add_argument("--skip-wrong", action="store_true", help="no wrong-layers run")
    p.add_argument("--json", action="store_true", help="print the result as one JSON line too")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    torch.set_num_threads(1)  # small models: one thread avoids spin-wait on shared cores
    work = Path(args.workdir or tempfile.mkdtemp(prefix="bench-acceptance-"))
    work.mkdir(parents=True, exist_ok=True)
    target = train_target(work / "target", steps=args.target_steps)
    sets = write_prompt_sets(target, work / "prompts", train=args.train, held_out=args.held_out,
                             held_out_tokens=args.max_tokens + args.k + 1)  # fmt: skip
    data = extract(target, work / "prompts" / "train.jsonl", work / "ds-train")
    held = extract(target, work / "prompts" / "held_out.jsonl", work / "ds-held-out")

    runs = {"correct": (data, held)}
    if not args.skip_wrong:
        runs["wrong_layers"] = (relabel_one_deeper(data, work / "ds-train-wrong"),
                                relabel_one_deeper(held, work / "ds-held-out-wrong"))  # fmt: skip
    result: dict = {"k": args.k, "max_tokens": args.max_tokens, "held_out": args.held_out,
                    "print_json": args.json}  # fmt: skip
    for name, (train_ds, held_ds) in runs.items():
        run = work / f"run-{name}"
        summary = train(train_ds, held_ds, target, run, args)
        served = serve(target, run / "checkpoint", sets["prompts"], work, args)
        result[name] = {
            "inspect": inspect_verdict(train_ds, target),
            "trainer_acc_per_step_last": summary["acc_per_step_last"],
            "trainer_prediction": summary["acceptance"],
            "offline": offline(run / "checkpoint", held_ds, target, args),
            "engine": served["engine"],
            "greedy_matches": sum(
                o == g[: args.max_tokens] for o, g in zip(served["outputs"], sets["greedy"])
            ),  # fmt: skip
        }
    report(result)
    return result


def report(result: dict) -> None:
    ok = result["correct"]
    engine, predicted = ok["engine"]["accept_rate_per_pos"], ok["offline"]["accept_rate_per_pos"]
    agreement = [e / o if o else float("nan") for e, o in zip(engine, predicted)]
    print(f"\nheld-out prompts {result['held_out']}, {result['max_tokens']} tokens each, "
          f"k={result['k']}; engine drafts {ok['engine']['drafts']}, offline drafts "
          f"{ok['offline']['drafts']}; engine output = transformers greedy for "
          f"{ok['greedy_matches']}/{result['held_out']}")  # fmt: skip
    print("position  engine  offline  agreement  trainer acc/step (training batches)")
    for p, (e, o, a) in enumerate(zip(engine, predicted, agreement)):
        acc = (
            ok["trainer_acc_per_step_last"][p] if p < len(ok["trainer_acc_per_step_last"]) else None
        )
        print(f"{p + 1:>8}  {e:6.3f}  {o:7.3f}  {a:9.3f}  {acc if acc is None else round(acc, 3)}")
    print(f"mean accepted length: engine {ok['engine']['mean_accepted_length']:.3f}, offline "
          f"{ok['offline']['mean_accepted_length']:.3f}")  # fmt: skip
    print(f"inspect --model, correct dataset: {ok['inspect']}")
    wrong_rate = float("nan")
    if "wrong_layers" in result:
        bad = result["wrong_layers"]
        wrong_rate = bad["engine"]["accept_rate_per_pos"][0]
        print(f"wrong layers (aux labelled one deeper): engine per position "
              f"{[round(r, 3) for r in bad['engine']['accept_rate_per_pos']]}, mean accepted "
              f"length {bad['engine']['mean_accepted_length']:.3f}; offline (blind to labels) "
              f"{[round(r, 3) for r in bad['offline']['accept_rate_per_pos']]}; inspect --model: "
              f"{bad['inspect']}")  # fmt: skip
    final = {
        "engine_accept_rate": engine[0],
        "offline_accept_rate": predicted[0],
        "agreement": agreement[0],
        "mean_accept_len": ok["engine"]["mean_accepted_length"],
        "wrong_layers_accept_rate": wrong_rate,
    }
    result["final"] = final
    if result.get("print_json"):
        print(json.dumps(result))
    print(" ".join(f"{k}={v:.3f}" for k, v in final.items()))


if __name__ == "__main__":
    main()
