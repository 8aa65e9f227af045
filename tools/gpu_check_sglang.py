"""GPU check: SGLang's hidden states equal the transformers backend's on the same model.

Run on a machine with a CUDA GPU and SGLang installed (``pip install '.[sglang]'``)::

    python -m tools.gpu_check_sglang [--model DIR] [--out DIR] [--rows 24]

Without ``--model`` it builds a small random Llama in code (head size 64, which SGLang's
attention kernels support), so it needs no download. It extracts the same prompts three times
with ``hsstore extract``'s own code:

1. transformers backend, float32 (the reference);
2. transformers backend, bfloat16 (how far bf16 alone moves the states);
3. SGLang backend, bfloat16 (aux capture engine + final-state engine, side by side).

and checks, for every sample and stored layer (default ``eagle3,final``), that SGLang agrees
with the float32 reference about as well as transformers in bf16 does: relative error at most
``--tolerance-factor`` times the bf16 transformers error (plus a small floor), and less than
half the distance between the reference's own stored layers. A wrong layer id would be off by
a whole layer, so this separates "right layer, different kernels" from "wrong layer".

Then (informational, not part of the verdict) it starts an engine with chunked prefill left on
(small chunks) and a long prompt, to show whether the adapter's row-count assertion fires when
SGLang returns fewer rows than prompt tokens.

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


def extract(model: str, data: Path, out: Path, **kw: Any) -> dict[str, Any]:
    from extractors.runner import ExtractOptions, run_extract

    t0 = time.perf_counter()
    summary = run_extract(
        ExtractOptions(model=model, data=str(data), out=str(out), progress=False, **kw)
    )
    summary["elapsed_s"] = time.perf_counter() - t0
    return summary


def compare(ref_dir: Path, other_dir: Path) -> dict[str, Any]:
    """Per stored layer: worst relative error and worst cosine similarity over samples, and how
    far apart the reference's own layers are (what a wrong layer id would cost)."""
    import torch

    import hsstore

    ref, other = hsstore.open(ref_dir), hsstore.open(other_dir)
    if sorted(ref.sample_ids) != sorted(other.sample_ids):
        return {"error": "different sample ids"}
    labels = [s.label for s in ref.layers]
    worst_rel = [0.0] * len(labels)
    worst_cos = [1.0] * len(labels)
    separation = [float("inf")] * len(labels)
    tokens_equal = True

    def rel(x: torch.Tensor, y: torch.Tensor) -> float:
        return ((x - y).norm() / x.norm().clamp_min(1e-12)).item()

    for sid in ref.sample_ids:
        a, b = ref.get(sid), other.get(sid)
        tokens_equal &= torch.equal(a.input_ids, b.input_ids) and torch.equal(
            a.loss_mask, b.loss_mask
        )
        for j in range(len(labels)):
            x, y = a.hidden[:, j].float(), b.hidden[:, j].float()
            worst_rel[j] = max(worst_rel[j], rel(x, y))
            cos = torch.nn.functional.cosine_similarity(x, y, dim=-1).min().item()
            worst_cos[j] = min(worst_cos[j], cos)
            for k in range(len(labels)):
                if k != j:
                    separation[j] = min(separation[j], rel(x, a.hidden[:, k].float()))
    return {
        "layers": labels,
        "max_rel_err": worst_rel,
        "min_cosine": worst_cos,
        "min_rel_distance_to_other_layers": separation,
        "tokens_and_masks_equal": bool(tokens_equal),
    }


def chunked_prefill_is_caught(model: str, data_dir: Path) -> dict[str, Any]:
    """With chunked prefill on, a long prompt must make the adapter fail, not store rows."""
    from extractors.sglang_backend import SGLangResponseError

    long_prompt = write_prompts(data_dir / "long.jsonl", 1, seed=7)
    row = json.loads(long_prompt.read_text())
    row["messages"][1]["content"] = " ".join(WORDS * 40)
    long_prompt.write_text(json.dumps(row) + "\n")
    try:
        extract(
            model,
            long_prompt,
            data_dir / "chunked",
            backend="sglang",
            layers="2",
            dtype="bfloat16",
            backend_options={"extra_engine_args": {"chunked_prefill_size": 128}},
        )
    except SGLangResponseError as exc:
        return {"caught": True, "message": str(exc)}
    except Exception as exc:  # report, do not hide: a different failure is also information
        return {"caught": False, "error": f"{type(exc).__name__}: {exc}"}
    return {"caught": False, "note": "sglang returned every row even with chunked prefill on"}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", help="model directory (default: build a small random Llama)")
    parser.add_argument("--out", help="working directory (default: a temporary one)")
    parser.add_argument("--rows", type=int, default=24)
    parser.add_argument("--layers", default="eagle3,final")
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
    if args.model:
        model = args.model
    else:
        from tools.tiny_model import build_tiny_model

        model = str(build_tiny_model(work / "model", hidden=512, layers=8, vocab=512, heads=8))
    data = write_prompts(work / "prompts.jsonl", args.rows)
    common = {"layers": args.layers, "batch_size": 8}
    report: dict[str, Any] = {
        "sglang": sglang.__version__,
        "torch": torch.__version__,
        "gpu": torch.cuda.get_device_name(0),
        "model": model,
    }
    runs = {
        "hf_fp32": extract(model, data, work / "hf_fp32", dtype="float32", **common),
        "hf_bf16": extract(model, data, work / "hf_bf16", dtype="bfloat16", **common),
        "sglang_bf16": extract(
            model, data, work / "sg_bf16", backend="sglang", dtype="bfloat16", **common
        ),
    }
    report["runs"] = {
        k: {
            key: v[key]
            for key in ("samples_written", "tokens_written", "elapsed_s", "extract_tokens_per_s")
        }
        for k, v in runs.items()
    }
    bf16 = compare(work / "hf_fp32", work / "hf_bf16")
    sg = compare(work / "hf_fp32", work / "sg_bf16")
    report["hf_bf16_vs_fp32"], report["sglang_vs_fp32"] = bf16, sg
    report["sglang_vs_hf_bf16"] = compare(work / "hf_bf16", work / "sg_bf16")
    ok = "error" not in sg and sg["tokens_and_masks_equal"]
    if ok:
        limits = [args.tolerance_factor * e + 2e-3 for e in bf16["max_rel_err"]]
        report["rel_err_limits"] = limits
        ok = all(e <= lim for e, lim in zip(sg["max_rel_err"], limits))
        # and far closer to the right layer than to any other stored one
        ok = ok and all(
            e < 0.5 * sep
            for e, sep in zip(sg["max_rel_err"], sg["min_rel_distance_to_other_layers"])
        )
    if not args.skip_chunked_check:
        # informational: shows what the row-count assertion does when SGLang drops rows
        report["chunked_prefill"] = chunked_prefill_is_caught(model, work)
    report["ok"] = bool(ok)
    print(json.dumps(report, indent=2))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
