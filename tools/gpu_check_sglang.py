"""GPU check: SGLang's hidden states equal the transformers backend's on the same model.

Run on a machine with a CUDA GPU and SGLang installed (``pip install '.[sglang]'``)::

    python -m tools.gpu_check_sglang [--model DIR] [--out DIR] [--rows 24]

Without ``--model`` it builds three small random models in code, so it needs no download: a
Llama (SGLang's "+1 per id" capture rule), a Qwen3, and a DeepseekV3-style model with MLA
attention and MoE layers (the DeepSeek rule that Kimi-K2.5, GLM-5 and Mistral Large 3 inherit).
Head sizes are ones SGLang's kernels support (64; MLA with kv_lora_rank 512 and rope dim 64).
For each model it extracts the same prompts three times with ``hsstore extract``'s own code:

1. transformers backend, float32 (the reference);
2. transformers backend, bfloat16 (how far bf16 alone moves the states);
3. SGLang backend, bfloat16 (one engine, aux + final state from one forward).

and checks, for every sample and stored layer (default: the extractor's, ``eagle3,final-prenorm``), that SGLang agrees
with the float32 reference about as well as transformers in bf16 does: relative error at most
``--tolerance-factor`` times the bf16 transformers error (plus a small floor), and less than
half the distance between the reference's own stored layers. A wrong layer id would be off by
a whole layer, so this separates "right layer, different kernels" from "wrong layer".

Then it times the capture path alone (:func:`capture_copy_check`): bf16 states of the seed's
width on the GPU through the forward hook's sink, a device-to-host copy into a pinned buffer
that the forward does not wait for, then into a shared-memory slot the worker maps. It reports
how long the forward is held per capture, the rate end to end, and fails unless the bytes
arrive unchanged.

Then (informational, not part of the verdict) it starts an engine with chunked prefill left on
(chunks of 128 tokens) and a prompt several chunks long that still fits the model's context,
to show whether the adapter's row-count assertion fires when SGLang returns fewer rows than
prompt tokens.

Prints one JSON report; exits 0 when every check passes, 1 otherwise.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

WORDS = [
    "the",
    "model",
    "reads",
    "every",
    "prompt",
    "token",
    "and",
    "the",
    "draft",
    "learns",
    "to",
    "predict",
    "what",
    "comes",
    "next",
    "from",
    "hidden",
    "states",
    "at",
    "three",
    "depths",
    "plus",
    "the",
    "last",
    "layer",
    "of",
    "the",
    "target",
    "network",
]


def write_prompts(path: Path, rows: int, seed: int = 0) -> Path:
    rng = random.Random(seed)
    with path.open("w") as f:
        for _ in range(rows):
            user = " ".join(rng.choices(WORDS, k=rng.randint(4, 40)))
            reply = " ".join(rng.choices(WORDS, k=rng.randint(4, 120)))
            messages = [{"role": "user", "content": user}, {"role": "assistant", "content": reply}]
            f.write(json.dumps({"messages": messages}) + "\n")
    return path


CHUNK = 128  # chunked_prefill_size of the informational chunked-prefill check


def chat_tokens(tokenizer: Any, reply: str) -> int:
    """Tokens of a one-turn chat with this assistant reply, as the extractor renders it."""
    messages = [{"role": "user", "content": "say it"}, {"role": "assistant", "content": reply}]
    text = tokenizer.apply_chat_template(messages, tokenize=False)
    return len(tokenizer(text, add_special_tokens=False)["input_ids"])


def chunked_prompt_text(tokenizer: Any, context: int, chunk: int = CHUNK) -> str:
    """An assistant reply whose chat rendering is several chunks long but fits ``context``.

    (Its length follows ``context``: a text longer than the model's context is rejected by
    SGLang before any chunking, and the tiny model's context is only 2,048 tokens.)
    """
    limit = min(context - 64, 6 * chunk)
    words: list[str] = []
    while chat_tokens(tokenizer, " ".join(words)) <= 3 * chunk:
        words.extend(WORDS)
    while chat_tokens(tokenizer, " ".join(words)) > limit and len(words) > 1:
        words.pop()
    return " ".join(words)


def build_check_models(work: Path, *, hidden: int = 512, layers: int = 6) -> dict[str, str]:
    """The random models the check runs: Llama, Qwen3 and DeepseekV3-style (MLA + MoE).

    All share the tiny byte-level tokenizer and chat template. ``hidden``/``layers`` stay at
    GPU-kernel-friendly defaults; tests build smaller ones on CPU.
    """
    import shutil

    import torch
    from transformers import AutoModelForCausalLM, DeepseekV3Config, Qwen3Config

    from hsstore.demo_model import build_tiny_model

    heads = max(1, hidden // 64)
    llama = build_tiny_model(work / "llama", hidden=hidden, layers=layers, vocab=512, heads=heads)
    base = json.loads((llama / "config.json").read_text())
    common = dict(
        vocab_size=base["vocab_size"],
        hidden_size=hidden,
        intermediate_size=hidden * 2,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=heads,
        max_position_embeddings=2048,
        rms_norm_eps=1e-5,
        initializer_range=0.2,
        tie_word_embeddings=False,
        bos_token_id=base.get("bos_token_id"),
        eos_token_id=base.get("eos_token_id"),
        pad_token_id=base.get("pad_token_id"),
    )
    configs = {
        "qwen3": Qwen3Config(head_dim=64, **common),
        "deepseek_v3": DeepseekV3Config(
            # MLA with the shapes SGLang's MLA kernels expect, a dense first layer, then MoE
            kv_lora_rank=512,
            q_lora_rank=None,
            qk_rope_head_dim=64,
            qk_nope_head_dim=128,
            v_head_dim=128,
            n_routed_experts=8,
            num_experts_per_tok=2,
            n_shared_experts=1,
            moe_intermediate_size=hidden,
            first_k_dense_replace=1,
            n_group=1,
            topk_group=1,
            **common,
        ),
    }
    out = {"llama": str(llama)}
    for name, config in configs.items():
        path = work / name
        state = torch.random.get_rng_state()
        try:
            torch.manual_seed(0)
            model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        finally:
            torch.random.set_rng_state(state)
        model.eval().save_pretrained(path, safe_serialization=True)
        for tokenizer_file in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
            if (llama / tokenizer_file).exists():
                shutil.copy(llama / tokenizer_file, path / tokenizer_file)
        out[name] = str(path)
    return out


def extract(model: str, data: Path, out: Path, **kw: Any) -> dict[str, Any]:
    from hsstore.extractors.runner import ExtractOptions, run_extract

    t0 = time.perf_counter()
    summary = run_extract(
        ExtractOptions(model=model, data=str(data), out=str(out), progress=False, **kw)
    )
    summary["elapsed_s"] = time.perf_counter() - t0
    return summary


def compare(ref_dir: Path, other_dir: Path) -> dict[str, Any]:
    """Per stored layer: worst relative error, worst cosine, distance to the other layers."""
    from hsstore.extractors.check import compare_datasets

    return compare_datasets(ref_dir, other_dir)


def chunked_prefill_is_caught(model: str, data_dir: Path) -> dict[str, Any]:
    """With chunked prefill on, a long prompt must make the adapter fail, not store rows."""
    from transformers import AutoConfig, AutoTokenizer

    from hsstore.extractors.backends.sglang.backend import SGLangResponseError
    from hsstore.extractors.runner import WorkerFailedError

    context = int(AutoConfig.from_pretrained(model).max_position_embeddings)
    text = chunked_prompt_text(AutoTokenizer.from_pretrained(model), context)
    long_prompt = data_dir / "long.jsonl"
    row = {
        "messages": [{"role": "user", "content": "say it"}, {"role": "assistant", "content": text}]
    }
    long_prompt.write_text(json.dumps(row) + "\n")
    try:
        extract(
            model,
            long_prompt,
            data_dir / "chunked",
            backend="sglang",
            layers="2",
            dtype="bfloat16",
            backend_options={"extra_engine_args": {"chunked_prefill_size": CHUNK}},
        )
    except (SGLangResponseError, WorkerFailedError) as exc:  # the worker names the sample
        return {"caught": "truncated" in str(exc), "message": str(exc)}
    except Exception as exc:  # report, do not hide: a different failure is also information
        return {"caught": False, "error": f"{type(exc).__name__}: {exc}"}
    return {"caught": False, "note": "sglang returned every row even with chunked prefill on"}


def capture_copy_check(device: str = "cuda", rows: int = 4096, hidden: int = 7168) -> dict:
    """The capture path alone: four ``[rows, hidden]`` bf16 blocks on ``device`` through the
    hook's sink (on a GPU: device -> pinned buffer asynchronously -> slot) to the worker's
    tensor. Reports how long the forward is held per capture, the rate end to end, and whether
    the bytes arrived unchanged."""
    import shutil

    import torch

    from hsstore.extractors.backends.sglang.capture import SlotReader, make_capture_dir
    from hsstore.extractors.backends.sglang.checks import states_from_captures
    from hsstore.extractors.backends.sglang.hook import sink_for

    layers = 4
    x = torch.randn(rows, layers * hidden, device=device).to(torch.bfloat16)
    blocks = [x[:, j * hidden : (j + 1) * hidden] for j in range(layers)]
    want = torch.stack(blocks, dim=1).cpu()
    directory = make_capture_dir()
    try:
        sink, reader = sink_for(x, directory), SlotReader(directory)
        held = total = 0.0
        rounds, equal = 5, True
        for i in range(rounds + 1):  # the first round faults the slot in and is not timed
            t0 = time.perf_counter()
            sink.write(f"hs-{i}", 0, blocks)
            t1 = time.perf_counter()
            got = states_from_captures(
                reader, f"hs-{i}", num_tokens=rows, layers=layers, hidden_size=hidden,
                dtype=torch.bfloat16, sample_id=f"copy-{i}",
            )  # fmt: skip
            equal = equal and torch.equal(got, want)
            del got
            if i:
                held, total = held + t1 - t0, total + time.perf_counter() - t0
    finally:
        shutil.rmtree(directory, ignore_errors=True)
    nbytes = want.numel() * want.element_size() * rounds
    return {
        "device": device,
        "sink": type(sink).__name__,
        "gb_s": nbytes / total / 1e9,
        "forward_held_us": held / rounds * 1e6,
        "equal": equal,
        "ok": equal,
    }


def check_model(
    model: str, work: Path, data: Path, args: argparse.Namespace, backend: str = "sglang"
) -> dict[str, Any]:
    """The three extractions of one model and the verdict on the engine's (``backend``'s)
    states; tools/gpu_check_vllm.py runs it with ``backend="vllm"``."""
    work.mkdir(parents=True, exist_ok=True)
    common = {"layers": args.layers, "batch_size": 8}
    runs = {
        "hf_fp32": extract(model, data, work / "hf_fp32", dtype="float32", **common),
        "hf_bf16": extract(model, data, work / "hf_bf16", dtype="bfloat16", **common),
        f"{backend}_bf16": extract(
            model, data, work / "sg_bf16", backend=backend, dtype="bfloat16", **common
        ),
    }
    report: dict[str, Any] = {"model": model}
    report["runs"] = {
        k: {
            key: v[key]
            for key in ("samples_written", "tokens_written", "elapsed_s", "extract_tokens_per_s")
        }
        for k, v in runs.items()
    }
    bf16 = compare(work / "hf_fp32", work / "hf_bf16")
    sg = compare(work / "hf_fp32", work / "sg_bf16")
    report["hf_bf16_vs_fp32"], report[f"{backend}_vs_fp32"] = bf16, sg
    report[f"{backend}_vs_hf_bf16"] = compare(work / "hf_bf16", work / "sg_bf16")
    ok = sg["samples"] == args.rows and sg["tokens_and_masks_equal"]
    if ok:
        limits = [args.tolerance_factor * e + 2e-3 for e in bf16["max_rel_err"]]
        report["rel_err_limits"] = limits
        ok = all(e <= lim for e, lim in zip(sg["max_rel_err"], limits))
        # and far closer to the right layer than to any other stored one
        ok = ok and all(
            e < 0.5 * sep
            for e, sep in zip(sg["max_rel_err"], sg["min_rel_distance_to_other_layers"])
        )
    report["ok"] = bool(ok)
    return report


def main(argv: list[str] | None = None) -> int:
    from hsstore.extractors.layer_select import DEFAULT_LAYERS

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", help="model directory (default: build the three random ones)")
    parser.add_argument("--out", help="working directory (default: a temporary one)")
    parser.add_argument("--rows", type=int, default=24)
    parser.add_argument("--layers", default=DEFAULT_LAYERS)
    parser.add_argument("--tolerance-factor", type=float, default=4.0)
    parser.add_argument("--skip-chunked-check", action="store_true")
    args = parser.parse_args(argv)

    import torch

    if not torch.cuda.is_available():
        print(json.dumps({"ok": False, "error": "no CUDA device"}))
        return 1
    import sglang

    work = Path(args.out or tempfile.mkdtemp(prefix="hsstore-sglang-check-"))
    work.mkdir(parents=True, exist_ok=True)
    models = {"model": args.model} if args.model else build_check_models(work / "models")
    data = write_prompts(work / "prompts.jsonl", args.rows)
    report: dict[str, Any] = {
        "sglang": sglang.__version__,
        "torch": torch.__version__,
        "gpu": torch.cuda.get_device_name(0),
        "models": {},
    }
    for name, model in models.items():
        try:
            report["models"][name] = check_model(model, work / name, data, args)
        except Exception as exc:  # one model's failure is reported, the others still run
            report["models"][name] = {"model": model, "ok": False, "error": f"{exc!r}"}
    report["capture_copy"] = capture_copy_check("cuda")
    if not args.skip_chunked_check:
        # informational: shows what the row-count assertion does when SGLang drops rows
        first = next(iter(models.values()))
        report["chunked_prefill"] = chunked_prefill_is_caught(first, work)
    report["ok"] = report["capture_copy"]["ok"] and all(r["ok"] for r in report["models"].values())
    print(json.dumps(report, indent=2))
    return 0 if report["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
