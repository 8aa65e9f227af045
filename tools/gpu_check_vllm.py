"""GPU check: vLLM's hidden states equal the transformers backend's on the same model.

Run on a machine with a CUDA GPU and vLLM 0.32.0 installed (``pip install '.[vllm]'``)::

    python tools/gpu_check_vllm.py [--model DIR] [--out DIR] [--rows 24]

The SGLang check's models and verdict (tools/gpu_check_sglang.py): a random Llama and Qwen3
built in code (or ``--model``), each extracted with transformers fp32 (the reference),
transformers bf16 and ``--backend vllm`` bf16; vLLM's per-layer relative error must be within
``--tolerance-factor`` times the bf16 transformers error (plus 2e-3) and under half the distance
between the reference's own layers. The DeepseekV3-style model (MLA + MoE) must be refused in
one line: vLLM's ``deepseek_v2.py`` captures by a rule of its own. Then the capture path alone
(the hook's sink on a GPU: an asynchronous copy into a pinned buffer, then into a slot) as in
the SGLang check. Prints one JSON report; exits 0 when every check passes, 1 otherwise.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script from anywhere

from tools.gpu_check_sglang import (  # noqa: E402
    build_check_models,
    capture_copy_check,
    check_model,
    extract,
    write_prompts,
)


def refused(model: str, work: Path, data: Path) -> dict[str, Any]:
    """A model whose capture rule hsstore cannot vouch for ends the run with one clear line."""
    try:
        extract(model, data, work / "refused", backend="vllm", dtype="bfloat16", limit=2)
    except Exception as exc:  # the worker's error, as the CLI reports it
        message = str(exc)
        return {"ok": "rule of its own" in message and "\n" not in message, "message": message}
    return {"ok": False, "error": "extracted although its capture rule is not EagleModelMixin's"}


def main(argv: list[str] | None = None) -> int:
    from hsstore.extractors.layer_select import DEFAULT_LAYERS

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", help="model directory (default: build the random ones)")
    parser.add_argument("--out", help="working directory (default: a temporary one)")
    parser.add_argument("--rows", type=int, default=24)
    parser.add_argument("--layers", default=DEFAULT_LAYERS)
    parser.add_argument("--tolerance-factor", type=float, default=4.0)
    args = parser.parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")

    import torch

    if not torch.cuda.is_available():
        print(json.dumps({"ok": False, "error": "no CUDA device"}))
        return 1
    import vllm

    work = Path(args.out or tempfile.mkdtemp(prefix="hsstore-vllm-check-"))
    work.mkdir(parents=True, exist_ok=True)
    models = {"model": args.model} if args.model else build_check_models(work / "models")
    deepseek = models.pop("deepseek_v3", None)
    data = write_prompts(work / "prompts.jsonl", args.rows)
    report: dict[str, Any] = {
        "vllm": vllm.__version__,
        "torch": torch.__version__,
        "gpu": torch.cuda.get_device_name(0),
        "models": {},
    }
    for name, model in models.items():
        try:
            report["models"][name] = check_model(model, work / name, data, args, backend="vllm")
        except Exception as exc:  # one model's failure is reported, the others still run
            report["models"][name] = {"model": model, "ok": False, "error": f"{exc!r}"}
    if deepseek is not None:
        report["models"]["deepseek_v3_refused"] = refused(deepseek, work / "deepseek_v3", data)
    report["capture_copy"] = capture_copy_check("cuda")
    report["ok"] = report["capture_copy"]["ok"] and all(r["ok"] for r in report["models"].values())
    print(json.dumps(report, indent=2))
    return 0 if report["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
