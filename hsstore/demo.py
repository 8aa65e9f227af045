"""The built-in example: the whole hsstore pipeline on a tiny model, on CPU, in seconds.

tiny random Llama + chat prompts -> `extract` (2 parallel workers, default layers) -> `verify`
-> `inspect` -> export to speculators v1 -> one packed batch from the streaming loader. The
default layers (EAGLE-3 aux layers, the final state before the norm) export to every peer as
they are.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

_TOPICS = [
    ("What is speculative decoding?", "A small draft model proposes tokens; the target verifies them in one pass."),
    ("Why store hidden states?", "Draft models such as EAGLE-3 learn from the target's own features."),
    ("Name three prime numbers.", "2, 3 and 5."),
    ("Translate 'good morning' to French.", "Bonjour."),
    ("Write a Python function that adds two numbers.", "def add(a, b):\n    return a + b"),
    ("What is the capital of France?", "The capital of France is Paris."),
    ("Summarise: the quick brown fox jumps over the lazy dog.", "A fox jumps over a dog."),
    ("How many layers does a transformer have?", "As many as its config says; small ones have a few."),
    ("Give me a haiku about storage.", "Chunks fill the shard / checksums guard every byte / commit, and it's done."),
    ("Is bf16 lossless?", "Storing bf16 bits as they are is lossless; converting is not."),
    ("What does a loss mask do?", "It marks which tokens the model is trained to predict."),
    ("Count from one to five.", "One, two, three, four, five."),
]  # fmt: skip


def demo_prompts() -> list[dict[str, Any]]:
    """Chat rows in the OpenAI `messages` form, some with a system turn or two rounds."""
    rows = []
    for k, (question, answer) in enumerate(_TOPICS):
        messages = [{"role": "user", "content": question}, {"role": "assistant", "content": answer}]
        if k % 3 == 0:
            messages.insert(0, {"role": "system", "content": "You are a concise assistant."})
        if k % 4 == 1:
            messages += [
                {"role": "user", "content": "Say it again."},
                {"role": "assistant", "content": answer},
            ]
        rows.append({"messages": messages})
    return rows


def run_demo(out: str | Path, *, workers: int = 2, progress: bool = True) -> dict[str, Any]:
    """Run the pipeline into ``out`` (which must not exist yet); returns a summary."""
    import hsstore
    from hsstore.audit.report import to_text
    from hsstore.audit.run import AuditOptions, audit
    from hsstore.demo_model import build_tiny_model
    from hsstore.extractors.extra import require_extract_extra
    from hsstore.extractors.runner import ExtractOptions, run_extract
    from hsstore.interop.convert import export_to_v1
    from hsstore.loader import Loader

    require_extract_extra("hsstore demo")

    out = Path(out)
    if out.exists():
        raise hsstore.ConflictError(
            "demo output folder already exists; pick a new one", path=str(out)
        )
    t0 = time.perf_counter()
    out.mkdir(parents=True)
    model = build_tiny_model(out / "model", hidden=64, layers=8, vocab=512, seed=0)
    prompts = out / "prompts.jsonl"
    prompts.write_text("".join(json.dumps(r) + "\n" for r in demo_prompts()))

    dataset = out / "dataset"
    extracted = run_extract(
        ExtractOptions(
            model=str(model),
            data=str(prompts),
            out=str(dataset),
            workers=workers,
            progress=progress,
        )
    )
    report = hsstore.verify(dataset)
    # (No --lm-head here: the prompts are not the random model's own generations, so its head
    # agrees with them by chance only; the inspect tests use greedy generations for that.)
    audited = audit(dataset, AuditOptions(progress=False))
    exported = export_to_v1(dataset, out / "speculators_v1", progress=progress)
    loader = Loader(str(dataset), max_tokens=256, shuffle=True, seed=0, num_threads=1)
    batch = next(iter(loader))
    ds = hsstore.open(dataset)
    return {
        "out": str(out),
        "dataset": repr(ds),
        "layers": [layer.label for layer in ds.layers],
        "extract": {
            k: extracted[k]
            for k in ("samples_written", "tokens_written", "workers", "skipped_total")
        },
        "verify_ok": report.ok,
        "inspect_verdict": audited.verdict.value,
        "inspect_report": to_text(audited),
        "v1_files": exported.added,
        "batch": {k: list(v.shape) for k, v in batch.items() if hasattr(v, "shape")},
        "seconds": round(time.perf_counter() - t0, 1),
    }
