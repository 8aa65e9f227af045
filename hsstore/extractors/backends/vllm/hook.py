"""The capture hsstore installs inside vLLM's workers, where the model runs.

vLLM 0.32 runs the model in worker processes of its engine core, itself a child of the hsstore
worker (on CPU always: ``platforms/cpu.py:335-341`` turns the ``uni`` executor into ``mp``).
The engine is started with ``worker_extension_cls`` naming :class:`CaptureExtension`
(``v1/worker/worker_base.py:296-319`` mixes it into the worker class), and the backend calls
its one method on every worker through ``collective_rpc``. That method:

* asks the model for its aux hidden states with vLLM's own EAGLE-3 switch,
  ``set_aux_hidden_state_layers`` (``model_executor/models/interfaces.py:1689``). Every model
  class built on ``EagleModelMixin`` captures id ``k`` as the residual stream after ``k``
  decoder layers: ``_maybe_add_hidden_state`` (``interfaces.py:1601-1611``) stores
  ``hidden_states + residual`` and each model calls it with ``start_layer`` (0) before the first
  layer and ``idx + 1`` after layer ``idx`` (``models/llama.py:429-441``,
  ``models/qwen2.py:424-434``). So id = canonical depth, 0..N, N being the pre-norm final
  state; the model then returns ``(normed final state, [aux ...])`` (``llama.py:452-456``).
  Classes with a rule of their own (``deepseek_v2.py:1561-1587``, ``cohere2_moe.py:441-449``,
  ``qwen3_5.py``, ...) are refused, never guessed;
* registers a forward hook on the model the runner calls (``v1/worker/gpu_model_runner.py:3644``
  ``_model_forward``). The hook reads the batch's layout from the runner: request ids in batch
  order (``input_batch.req_ids``), token offsets (``query_start_loc``, filled at
  ``gpu_model_runner.py:2029-2034``) and prompt tokens already computed
  (``input_batch.num_computed_tokens_cpu``, the positions' start at ``:1953-1956``). It copies
  each hsstore request's rows, in stored layer order, into a shared-memory slot named after the
  request (the SGLang capture's slots and sinks, :mod:`hsstore.extractors.backends.sglang.
  capture`), and returns the final state alone, which is what the runner expects of a model
  that runs without a drafter.

Under tensor parallelism every rank holds the full residual stream after each all-reduce, so
only TP rank 0 writes; every rank returns the final state alone. This module must import
nothing heavier than torch and numpy at import time: vLLM's workers import it.
"""

from __future__ import annotations

from typing import Any

from hsstore.extractors.backends.sglang.hook import sink_for

# vLLM appends "-<8 characters>" to every request id it is given
# (v1/engine/input_processor.py:354-371 assign_request_id); the slot is named after the id
# hsstore chose.
INTERNAL_SUFFIX_SEP = "-"


def hsstore_request(internal_id: str, prefix: str) -> str | None:
    """The id hsstore gave the request vLLM calls ``internal_id``, or None for another's."""
    if not internal_id.startswith(prefix):
        return None
    return prefix + internal_id[len(prefix) :].split(INTERNAL_SUFFIX_SEP, 1)[0]


def aux_rule_problem(model: Any, aux_ids: list[int]) -> str | None:
    """Why this model's aux capture would not be the residual stream at each id, or None."""
    if not aux_ids:
        return None
    name = type(model).__name__
    if not callable(getattr(model, "set_aux_hidden_state_layers", None)):
        return f"vLLM 0.32's {name} captures no aux hidden states (it is no SupportsEagle3 model)"
    from vllm.model_executor.models.interfaces import EagleModelMixin

    model.set_aux_hidden_state_layers(tuple(aux_ids))
    owners = [m for m in model.modules() if tuple(getattr(m, "aux_hidden_state_layers", ())) != ()]
    if not owners or not all(isinstance(m, EagleModelMixin) for m in owners):
        kinds = ", ".join(sorted({type(m).__name__ for m in owners})) or name
        return (
            f"vLLM 0.32's {kinds} captures aux hidden states by a rule of its own, not "
            "EagleModelMixin's (model_executor/models/interfaces.py:1601), so hsstore cannot "
            "choose its ids by construction"
        )
    return None


def _tp_rank() -> int:
    from vllm.distributed import get_tensor_model_parallel_rank

    return int(get_tensor_model_parallel_rank())


class CaptureExtension:
    """Mixed into vLLM's worker class (``worker_extension_cls``); only adds the method below."""

    def hsstore_install_capture(self, config: dict[str, Any]) -> str | None:
        """Install the capture described by ``config`` (see :func:`capture_config`); returns
        None, or why this model cannot be captured (then nothing is installed)."""
        model = self.get_model()
        problem = aux_rule_problem(model, list(config["aux_ids"]))
        if problem:
            return problem
        hook = CaptureHook(config, self.model_runner, _tp_rank())
        model.register_forward_hook(hook, with_kwargs=True)
        return None


class CaptureHook:
    """The forward hook on the runner's model: capture, then hand on the final state alone."""

    def __init__(self, config: dict[str, Any], runner: Any, rank: int):
        self.prefix = str(config["rid_prefix"])
        self.layout = [int(j) for j in config["layout"]]
        self.aux_count = len(config["aux_ids"])
        self.hidden = int(config["hidden_size"])
        self.directory = str(config["dir"])
        self.runner = runner
        self.rank = rank
        self.sink: Any = None

    def __call__(self, module: Any, args: Any, kwargs: Any, output: Any) -> Any:
        if isinstance(output, tuple) and len(output) == 2 and isinstance(output[1], list):
            final, aux = output
        else:
            final, aux = output, []
        if self.rank == 0:
            self.capture(final, aux)
        return final

    def capture(self, final: Any, aux: list) -> None:
        import torch

        batch = self.runner.input_batch
        n = int(batch.num_reqs)
        ours = []
        for i, internal in enumerate(batch.req_ids[:n]):
            rid = hsstore_request(str(internal), self.prefix)
            if rid is not None:
                ours.append((i, rid))
        if not ours or not isinstance(final, torch.Tensor):
            return
        starts = self.runner.query_start_loc.cpu[: n + 1].tolist()
        computed = batch.num_computed_tokens_cpu[:n].tolist()
        if self.sink is None:
            self.sink = sink_for(final, self.directory)
        problem = None
        if len(aux) != self.aux_count:
            problem = f"the model returned {len(aux)} aux hidden states, expected {self.aux_count}"
        elif any(a.shape[-1] != self.hidden or a.shape[0] != final.shape[0] for a in aux):
            problem = "aux hidden states of another shape than the final state's"
        elif final.shape[0] < starts[n]:
            problem = f"{final.shape[0]} rows of states for the forward's {starts[n]} tokens"
        for i, rid in ours:
            prefix = int(computed[i])
            if problem:
                self.sink.problem(rid, prefix, problem)
                continue
            a, b = starts[i], starts[i + 1]
            blocks = [(final if j == self.aux_count else aux[j])[a:b] for j in self.layout]
            try:
                self.sink.write(rid, prefix, blocks)
            except Exception as exc:  # never the engine's crash: the worker names the sample
                self.sink.problem(rid, prefix, f"the capture failed: {type(exc).__name__}: {exc}")
