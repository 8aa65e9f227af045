"""How fast hidden states travel from a real vLLM engine to hsstore, against the engine alone.

Run inside the vLLM lane's environment (scripts/vllm_env.sh: vllm 0.32.0 on CPU), from the
repository root: ``python tools/bench_vllm.py``. The setting of tools/bench_sglang.py: a random
Llama of the seed's width (hidden size 7168, 4 layers so that four states are stored: depths
1-3 and the final state; a small MLP and vocabulary keep the forward cheap), bf16, 512-token
prompts in batches of 2. Each phase runs its engine in its own process (one engine per
process):

1. ``capture``: hsstore's backend (forward hook -> shared-memory slots -> tensors), each batch
   paired with the same prompts under request ids the hook ignores, in the same engine; the
   hook's copy and the worker's receipt and check are timed on their own threads (wall and
   CPU seconds), and the pair's peak private memory (RssAnon) compared;
2. ``plain``: the engine as hsstore starts it (eager, no prefix cache, no chunked prefill) but
   with no capture installed, its forward alone, run before and after the extractions;
3. ``hsstore extract --backend vllm`` on 2 and on ``--extract-rows`` prompts: the wall
   difference over the extra prompts' tokens, so engine start-up is not counted.

Last line:

* ``extract_vs_forward``: ``hsstore extract``'s tokens/s over the plain forward's (mean of its
  two runs);
* ``capture_gb_s``: state bytes / CPU seconds of the hook's copy plus the worker's check (each
  on one thread: the rate on one host core);
* ``host_us_per_token``: the capture's CPU microseconds per token;
* ``peak_rss_per_sample``: memory the capture adds per in-flight sample (its slot pool plus
  the median private-memory difference), over the sample's state bytes.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script from anywhere

from tools.bench_sglang import (  # noqa: E402
    BATCH,
    FEW,
    LAYER_SPEC,
    LAYERS,
    TOKENS,
    build_model,
    paired_capture,
    phase_extract,
    prompts,
)
from tools.process_meter import phase  # noqa: E402

ENV = {
    "VLLM_LOGGING_STREAM": "ext://sys.stderr",
    "VLLM_LOGGING_LEVEL": "WARNING",
    "VLLM_USE_V2_MODEL_RUNNER": "0",
    "HF_HUB_OFFLINE": "1",
    "VLLM_NO_USAGE_STATS": "1",
}


def _generate(engine: Any, batch: list[Any], tag: str) -> None:
    """The batch's prompts through ``engine`` under ids no capture claims, to the end."""
    from vllm import SamplingParams

    params = SamplingParams(max_tokens=1, temperature=0.0, detokenize=False)
    for p in batch:
        rid = f"{tag}-{p.sample_id}-{time.monotonic_ns()}"
        engine.add_request(rid, {"prompt_token_ids": p.input_ids.tolist()}, params)
    while engine.has_unfinished_requests():
        engine.step()


def _kv_bytes(model: str) -> int:
    from transformers import AutoConfig

    from hsstore.extractors.backends.sglang.memory import kv_bytes_per_token

    return 4 * BATCH * TOKENS * kv_bytes_per_token(AutoConfig.from_pretrained(model), "bfloat16")


def phase_plain(model: str, batches: int, vocab: int) -> dict[str, Any]:
    from vllm import EngineArgs
    from vllm.v1.engine.llm_engine import LLMEngine

    from hsstore.extractors.backends.vllm.backend import engine_kwargs

    kwargs = engine_kwargs(
        model, dtype="bfloat16", max_tokens=2 * TOKENS * BATCH, kv_cache_bytes=_kv_bytes(model)
    )
    del kwargs["worker_extension_cls"]  # the engine alone
    engine = LLMEngine.from_engine_args(EngineArgs(**kwargs))
    try:
        data = prompts(BATCH * (batches + 1), vocab)
        _generate(engine, data[:BATCH], "warm")
        t0 = time.perf_counter()
        for b in range(1, batches + 1):
            _generate(engine, data[b * BATCH : (b + 1) * BATCH], "plain")
        wall = time.perf_counter() - t0
    finally:
        engine.engine_core.shutdown()
    return {"tokens": batches * BATCH * TOKENS, "wall_s": wall}


def phase_capture(model: str, batches: int, vocab: int) -> dict[str, Any]:
    """Batches through hsstore's backend, each paired with the same prompts under ids the
    capture ignores, in one engine."""
    from hsstore.extractors.backends.vllm.backend import VLLMBackend
    from hsstore.extractors.layer_select import parse_layers

    backend = VLLMBackend(
        model,
        parse_layers(LAYER_SPEC, LAYERS),
        dtype="bfloat16",
        device="cpu",
        max_num_batched_tokens=2 * TOKENS * BATCH,
    )
    try:
        data = prompts(BATCH * (batches + 1), vocab)
        _generate(backend.engine, data[:BATCH], "warm")
        return paired_capture(
            backend, data, batches, lambda batch: _generate(backend.engine, batch, "nocap")
        )
    finally:
        backend.close()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batches", type=int, default=7)
    parser.add_argument("--extract-rows", type=int, default=18)
    parser.add_argument("--out", help="working directory (default: a temporary one)")
    args = parser.parse_args(argv)
    for name, value in ENV.items():
        os.environ.setdefault(name, value)
    work = Path(args.out or tempfile.mkdtemp(prefix="hsstore-bench-vllm-"))
    work.mkdir(parents=True, exist_ok=True)
    model = str(build_model(work))
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(max(1, -(-_kv_bytes(model) >> 30))))
    vocab = json.loads((Path(model) / "config.json").read_text())["vocab_size"]
    extra_batches = (args.extract_rows - FEW) // BATCH

    report: dict[str, Any] = {}
    report["capture"] = phase("capture", phase_capture, model, args.batches, vocab)
    before = phase("plain_before", phase_plain, model, extra_batches, vocab)
    # max_model_len (= --max-batch-tokens) over a batch's tokens: every prompt in one forward
    batch_tokens = 2 * TOKENS * BATCH
    few = phase("extract_few", phase_extract, model, str(work), FEW, "vllm", batch_tokens)
    many = phase(
        "extract_many", phase_extract, model, str(work), args.extract_rows, "vllm", batch_tokens
    )
    after = phase("plain_after", phase_plain, model, extra_batches, vocab)
    report["plain"] = {"before": before, "after": after}
    report["extract"] = {"few": few, "many": many}
    print(json.dumps(report, indent=2))

    plain_tps = sum(r["tokens"] / r["wall_s"] for r in (before, after)) / 2
    cap = report["capture"]
    cap_bytes = cap["state_bytes_per_sample"] * cap["tokens"] / TOKENS
    host_s = cap["stats"]["write_cpu_s"] + cap["stats"]["read_cpu_s"]
    extra_tokens = many["tokens"] - few["tokens"]
    extract_tps = extra_tokens / max(many["wall_s"] - few["wall_s"], 1e-3)
    wall_s = cap["stats"]["write_s"] + cap["stats"]["read_s"]
    print(
        f"plain_tokens_s={plain_tps:.0f} extract_tokens_s={extract_tps:.0f}"
        f" capture_wall_gb_s={cap_bytes / wall_s / 1e9:.2f}"
        f" capture_cpu_diff_us_per_token={cap['cpu_diff_s'] / cap['tokens'] * 1e6:.1f}"
        f" capture_wall_diff_us_per_token={cap['wall_diff_s'] / cap['tokens'] * 1e6:.1f}"
        f" state_kib_per_token={cap['state_bytes_per_sample'] / TOKENS / 1024:.1f}"
    )
    memory = cap["memory_added_per_sample"] / cap["state_bytes_per_sample"]
    print(
        f"extract_vs_forward={extract_tps / plain_tps:.2f}"
        f" capture_gb_s={cap_bytes / host_s / 1e9:.2f}"
        f" host_us_per_token={host_s / cap['tokens'] * 1e6:.1f}"
        f" peak_rss_per_sample={memory:.2f}x"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
