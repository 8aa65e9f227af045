"""Serve a target with an EAGLE-3 drafter in vLLM (CPU or GPU), greedily, and print what the
engine generated and its speculative-decoding counters.

    python tools/vllm_spec_decode.py REQUEST.json

Runs with a python that has vllm (e.g. scripts/vllm_env.sh's environment); imports nothing of
hsstore. REQUEST.json: ``{"target": DIR, "drafter": DIR, "k": draft tokens, "max_tokens": N,
"prompts": [[token ids], ...]}``. The last line of stdout is ``RESULT {json}`` with
``outputs`` (generated ids per prompt) and ``counters`` (``vllm:spec_decode_*`` from
``LLM.get_metrics()``, which vLLM fills only with ``disable_log_stats=False``).
"""

from __future__ import annotations

import json
import os
import sys


def serve(request: dict) -> dict:
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB; the default wants far more
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    llm = LLM(
        model=request["target"],
        speculative_config={
            "method": "eagle3",
            "model": request["drafter"],
            "num_speculative_tokens": request["k"],
        },
        dtype="float32",
        enforce_eager=True,
        disable_log_stats=False,
        max_model_len=request.get("max_model_len", 512),
        max_num_seqs=request.get("max_num_seqs", 16),
        seed=0,
    )
    params = SamplingParams(temperature=0.0, max_tokens=request["max_tokens"], ignore_eos=True)
    prompts = [TokensPrompt(prompt_token_ids=p) for p in request["prompts"]]
    outputs = llm.generate(prompts, params, use_tqdm=False)
    counters = {}
    for metric in llm.get_metrics():
        if metric.name.startswith("vllm:spec_decode"):
            values = getattr(metric, "values", None)
            counters[metric.name] = values if values is not None else metric.value
    return {"outputs": [list(o.outputs[0].token_ids) for o in outputs], "counters": counters}


if __name__ == "__main__":  # vLLM's engine starts its workers by spawning this module again
    with open(sys.argv[1]) as f:
        result = serve(json.load(f))
    print("RESULT " + json.dumps(result), flush=True)
