"""SGLang's own EAGLE-3 pieces run on the reference trainer's checkpoints, for the lane's tests.

    python sglang_drafter.py REQUEST.json

Runs in the lane's environment (``SGLANG_USE_CPU_ENGINE=1``, the sgl_kernel stand-in first on
PYTHONPATH; conftest.py sets both for child processes), in a process of its own: SGLang's
``Engine.shutdown`` kills every child of its process, and its model classes need SGLang's
process-wide parallel state. It only runs SGLang and saves what SGLang made of the inputs; the
tests judge it.

REQUEST.json: ``{"checkpoints": [DIR, ...], "out": FILE}``, and for the aux capture also
``"target": DIR`` and ``"samples": [[token ids], ...]``. FILE (``torch.save``) holds:

* ``drafters``: per checkpoint, SGLang's ``LlamaForCausalLMEagle3`` (the ``EntryClass`` of
  ``models/llama_eagle3.py`` named by config.json's ``architectures``), built from the
  checkpoint's config.json as SGLang reads a draft model's config (``ModelConfig`` with
  ``is_draft_model``), then its ``load_weights`` fed ``model.safetensors`` by SGLang's own
  iterator: every parameter before and after loading, the ``hot_token_id`` it derived, whether
  it takes the target's LM head, and whether anything stands between the aux states and ``fc``
  (``input_norm``, ``fc_norm``); with samples, ``fc`` applied to the captured aux states.
* ``aux``: with a target, the engine's aux states of each sample as SGLang packs them for the
  drafter (``[T, K*H]``), captured with the first checkpoint's
  ``eagle_config.eagle_aux_hidden_state_layer_ids``. The capture-only mode
  (``enable_return_aux_hidden_states``) hands those ids to the target's
  ``set_eagle3_layers_to_capture`` as serving does (sglang 0.5.23
  ``model_executor/model_runner_components/spec_aux_hidden_state.py:104`` and ``:192``, both
  read by ``attention_backend_setup.py:61``), and returns the tensor serving passes to the
  drafter (``layers/logits_processor.py:869``, ``pack_aux_hidden_states``).
"""

from __future__ import annotations

import json
import socket
import sys
from pathlib import Path

import torch


def capture_aux(target: str, layer_ids: list[int], samples: list[list[int]]) -> list:
    """The target's packed aux states for each sample, from SGLang's CPU engine in float32."""
    import sglang
    from transformers import AutoConfig

    from hsstore.extractors.backends.sglang.checks import rows_from_response
    from hsstore.extractors.backends.sglang.memory import cpu_mem_fraction, engine_start_lock

    text_config = AutoConfig.from_pretrained(target)
    hidden = int(text_config.hidden_size)
    fraction = cpu_mem_fraction(target, text_config, checkpoint_dtype="float32", dtype="float32")
    with engine_start_lock():
        engine = sglang.Engine(
            model_path=target,
            skip_tokenizer_init=True,
            dtype="float32",
            device="cpu",
            attention_backend="torch_native",
            disable_radix_cache=True,
            chunked_prefill_size=-1,
            mem_fraction_static=fraction,
            random_seed=0,
            log_level="error",
            enable_return_aux_hidden_states=True,
            speculative_algorithm="EAGLE3",
            return_aux_hidden_state_layer_ids=list(layer_ids),
        )
    try:
        responses = engine.generate(
            input_ids=samples,
            sampling_params={"max_new_tokens": 1, "temperature": 0.0},
            return_hidden_states=True,
        )
    finally:
        engine.shutdown()
    return [
        rows_from_response(
            r, num_tokens=len(ids), width=len(layer_ids) * hidden, sample_id=str(i),
            hidden_size=hidden,
        )
        for i, (r, ids) in enumerate(zip(responses, samples, strict=True))
    ]  # fmt: skip


def one_rank_parallel_state() -> None:
    """The world of one rank and its model-parallel groups that SGLang's layers read, set up
    as SGLang's own layer tests do (``sglang/test/layer_ut_utils.py``
    ``init_single_process_dist``, whose module needs SGLang's benchmark extras): a published
    topology of width 1, then a gloo world on a free local port."""
    from sglang.srt.distributed.parallel_state import (
        init_distributed_environment,
        initialize_model_parallel,
    )
    from sglang.srt.runtime_context import SpawnRanks, publish, reset_context
    from sglang.srt.server_args import ServerArgs

    reset_context()
    publish(
        ServerArgs(model_path="dummy", tp_size=1, ep_size=1, pp_size=1),
        role="test",
        ranks=SpawnRanks(world_rank=0),
    )
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    init_distributed_environment(
        world_size=1, rank=0, local_rank=0, backend="gloo",
        distributed_init_method=f"tcp://127.0.0.1:{port}",
    )  # fmt: skip
    initialize_model_parallel(backend="gloo")


def load_drafter(checkpoint: str, aux: list | None) -> dict:
    """SGLang's drafter class built from the checkpoint and loaded by its own load_weights."""
    from sglang.srt.configs.model_config import ModelConfig
    from sglang.srt.model_loader.weight_utils import safetensors_weights_iterator
    from sglang.srt.models import llama_eagle3

    config = ModelConfig(checkpoint, is_draft_model=True, dtype="float32").hf_config
    classes = {cls.__name__: cls for cls in llama_eagle3.EntryClass}
    model = classes[config.architectures[0]](config).eval()
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    files = sorted(str(p) for p in Path(checkpoint).glob("*.safetensors"))
    model.load_weights(safetensors_weights_iterator(files))
    out = {
        "class": type(model).__name__,
        "before": before,
        "after": {name: p.detach().clone() for name, p in model.named_parameters()},
        "hot_token_id": model.get_hot_token_id(),
        "load_lm_head_from_target": model.load_lm_head_from_target,
        "input_norm": model.model.input_norm is not None,
        "fc_norm": model.model.fc_norm is not None,
    }
    if aux is not None:
        with torch.no_grad():
            out["fc"] = [model.model.fc(a) for a in aux]
    return out


def main(path: str) -> None:
    request = json.loads(Path(path).read_text())
    checkpoints = request["checkpoints"]
    aux = None
    if request.get("target"):
        config = json.loads((Path(checkpoints[0]) / "config.json").read_text())
        ids = config["eagle_config"]["eagle_aux_hidden_state_layer_ids"]
        # the engine first: its scheduler process must not inherit the parallel state below
        aux = capture_aux(request["target"], ids, request["samples"])

    one_rank_parallel_state()
    drafters = {c: load_drafter(c, aux) for c in checkpoints}
    torch.save({"drafters": drafters, "aux": aux}, request["out"])


if __name__ == "__main__":
    main(sys.argv[1])
