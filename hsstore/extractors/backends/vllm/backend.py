"""Hidden states from vLLM's offline engine, on GPU or CPU (``pip install '.[vllm]'``).

How vLLM is driven (vllm 0.32.0; paths below are inside its package):

* **One engine, prefill only.** ``LLMEngine`` (``v1/engine/llm_engine.py``) with hsstore's
  request ids, ``max_tokens=1``: the prompt is computed in one forward and the request ends
  with the token sampled from it, so no decode step runs.
* **States travel as tensors.** The engine starts with ``worker_extension_cls`` naming
  :class:`hsstore.extractors.backends.vllm.hook.CaptureExtension`, whose one method, called on
  every worker through ``collective_rpc``, turns on the model's own EAGLE-3 aux capture for the
  requested depths and hooks the model's forward. The hook copies each hsstore request's rows
  into a slot of a reused pool in shared memory that this worker owns (the slots of the
  SGLang backend, :mod:`hsstore.extractors.backends.sglang.capture`); the worker maps them
  and hands the writer a ``[T, L, H]`` tensor over the slot's pages, freed back to the pool
  with that tensor. Requests ask for no output but the one sampled token: vLLM builds no Python
  object per state. Why a hook and not vLLM's ``extract_hidden_states`` method with a KV
  connector: that path writes the states into a KV cache first (``v1/spec_decode/
  extract_hidden_states.py:130-160``) and a connector copies them out again per request, which
  is one copy more, a KV cache sized for the states, and on CPU no working connector
  (the example connector pins memory, which needs an accelerator).
* **Layer ids right by construction.** vLLM's aux id ``k`` is the residual stream after ``k``
  decoder layers for every model class built on ``EagleModelMixin``, ids 0..N (N: the final
  state before the norm), so hsstore sends the canonical depths themselves; a class whose
  capture follows another rule is refused when the engine has loaded it (see the hook module).
  ``final`` is the tensor the model returns to the runner, the LM head's input.
* **Eager.** ``enforce_eager=True``: a forward hook does not run inside a captured CUDA graph,
  and a model compiled before the aux layers are set would never return them (vLLM's compiled
  forward is traced once, ``compilation/decorators.py``). Prefill-only extraction gains little
  from either (CUDA graphs serve decoding).
* **Exactly T rows.** ``enable_prefix_caching=False`` and ``enable_chunked_prefill=False``
  (``config/scheduler.py:315-325`` then needs ``max_num_batched_tokens >= max_model_len``):
  every request's prompt is computed in one forward from position 0. Each capture says how
  many prompt tokens were computed before it; anything but T rows from position 0 raises,
  naming the sample, as does ``num_cached_tokens`` > 0 in the request's output.
* **Runner.** ``VLLM_USE_V2_MODEL_RUNNER=0``: the hook reads the batch layout of the V1 model
  runner (``v1/worker/gpu_model_runner.py``), which the CPU path always uses
  (``config/vllm.py:720-728``: V2 needs Triton).
* **One engine per process.** The runner always runs this backend in a spawned worker, which
  leads its own process group: the engine core and its workers end with it.
"""

from __future__ import annotations

import itertools
import os
import shutil
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from hsstore.cores import usable_core_ids
from hsstore.errors import BadInputError, HsstoreError
from hsstore.extractors.backends.sglang.backend import resolve_dtype
from hsstore.extractors.backends.sglang.capture import SlotReader, make_capture_dir
from hsstore.extractors.backends.sglang.checks import states_from_captures
from hsstore.extractors.backends.sglang.memory import kv_bytes_per_token
from hsstore.extractors.chat_tokens import TokenizedPrompt
from hsstore.spec.layers import LayerSpec

__all__ = [
    "VLLMBackend",
    "VLLMResponseError",
    "capture_config",
    "check_vllm_version",
    "engine_kwargs",
    "plan_capture",
]

# Versions whose sources this adapter was checked against (docs/EXTRACT.md). Others are refused
# unless HSSTORE_VLLM_UNTESTED=1, after validating with --check-against transformers.
TESTED_VLLM_VERSIONS = ("0.32.0",)
UNTESTED_ENV = "HSSTORE_VLLM_UNTESTED"
EXTENSION = "hsstore.extractors.backends.vllm.hook.CaptureExtension"
MISSING_HINT = (
    "the forward hook did not run for it: vLLM scheduled it in no forward of this engine, or "
    "the model is not the one the runner calls"
)
# KV cache on CPU, where vLLM takes a fixed size (VLLM_CPU_KVCACHE_SPACE, in GiB, wins if set):
# room for two full batches.
KV_BATCHES = 2
MIN_KV_BYTES = 64 << 20
LOGGING = {"VLLM_LOGGING_STREAM": "ext://sys.stderr", "VLLM_LOGGING_LEVEL": "WARNING"}
# How long closing the engine waits for its core process to end before killing it. vLLM's own
# default is 5 s (v1/utils.py:613-616), less than its core takes on a busy CPU to let its model
# worker go (5 s of grace, v1/executor/multiproc_executor.py:483-485) and tear down; a core killed
# there leaves its shared memory to Python's resource tracker, which warns after the command's
# last line. The wait ends as soon as the core has ended.
ENGINE_SHUTDOWN_S = 30.0


class VLLMResponseError(HsstoreError):
    """vLLM answered, but not with one full row of hidden states per prompt token."""


def _fail(sample_id: str, msg: str) -> VLLMResponseError:
    return VLLMResponseError(f"vllm response: {msg}", sample_id=sample_id)


@dataclass(frozen=True)
class CapturePlan:
    """``aux_ids`` (ascending; vLLM returns the aux states in this order) are the depths
    captured; ``layout[l]`` is stored layer l's block: an index into them, or ``len(aux_ids)``
    for the final (post-norm) state."""

    aux_ids: list[int]
    layout: list[int]


def plan_capture(layers: Sequence[LayerSpec], num_hidden_layers: int) -> CapturePlan:
    """vLLM ids for the requested depths: the depths themselves (see the module docstring)."""
    n = num_hidden_layers

    def is_final(spec: LayerSpec) -> bool:
        return spec.final_norm and spec.depth == n

    ids = sorted({s.depth for s in layers if not is_final(s)})
    layout = [len(ids) if is_final(s) else ids.index(s.depth) for s in layers]
    return CapturePlan(aux_ids=ids, layout=layout)


def capture_config(
    plan: CapturePlan, *, hidden_size: int, directory: str, rid_prefix: str
) -> dict[str, Any]:
    """What :meth:`CaptureExtension.hsstore_install_capture` receives on every worker."""
    return {
        "aux_ids": list(plan.aux_ids),
        "layout": list(plan.layout),
        "hidden_size": hidden_size,
        "dir": directory,
        "rid_prefix": rid_prefix,
    }


def engine_kwargs(
    model_dir: str,
    *,
    dtype: str,
    max_tokens: int,
    tp_size: int = 1,
    trust_remote_code: bool = False,
    gpu_memory_utilization: float | None = None,
    kv_cache_bytes: int | None = None,
    extra: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """``EngineArgs`` of the one engine (every name a field of vllm 0.32's
    ``engine/arg_utils.py`` ``EngineArgs``)."""
    kwargs: dict[str, Any] = {
        "model": model_dir,
        "skip_tokenizer_init": True,  # hsstore sends token ids
        "trust_remote_code": trust_remote_code,
        "dtype": dtype,
        "seed": 0,
        "enforce_eager": True,
        "enable_prefix_caching": False,
        "enable_chunked_prefill": False,
        "max_model_len": max_tokens,
        "max_num_batched_tokens": max_tokens,
        "tensor_parallel_size": tp_size,
        "worker_extension_cls": EXTENSION,
        "disable_log_stats": True,
    }
    if gpu_memory_utilization is not None:
        kwargs["gpu_memory_utilization"] = gpu_memory_utilization
    if kv_cache_bytes is not None:
        kwargs["kv_cache_memory_bytes"] = kv_cache_bytes
    kwargs.update(extra or {})
    return kwargs


def check_vllm_version(version: str) -> None:
    """Refuse vLLM releases this adapter was not checked against (override: env var)."""
    if version in TESTED_VLLM_VERSIONS or os.environ.get(UNTESTED_ENV) == "1":
        return
    raise BadInputError(
        f"vLLM {version} is not a version hsstore's vllm backend was checked against "
        f"({', '.join(TESTED_VLLM_VERSIONS)}): its aux capture and model runner may differ. "
        f"Install vllm=={TESTED_VLLM_VERSIONS[-1]}, or validate this one with `hsstore extract "
        f"--backend vllm --check-against transformers --limit 8` and set {UNTESTED_ENV}=1"
    )


def installed_version() -> str | None:
    """The installed vLLM's version, from its metadata (``vllm`` on GPUs, ``vllm-cpu`` on CPU),
    without importing it; None if neither is installed."""
    from importlib import metadata

    for dist in ("vllm", "vllm-cpu"):
        try:
            return metadata.version(dist)
        except metadata.PackageNotFoundError:
            continue
    return None


def cpu_thread_binding(cores: Sequence[int], tp_size: int) -> str:
    """``VLLM_CPU_OMP_THREADS_BIND`` for one engine on ``cores``: one list per TP rank."""
    cores = sorted(cores)
    per_rank = max(1, len(cores) // tp_size)
    groups = [cores[r * per_rank : (r + 1) * per_rank] or cores[-1:] for r in range(tp_size)]
    return "|".join(",".join(str(c) for c in g) for g in groups)


def cpu_binding(cores: Sequence[int] | None, tp_size: int) -> str | None:
    """The binding hsstore gives one engine on CPU, or None to keep vLLM's own.

    vLLM's own binding gives every TP rank a NUMA node of its own and refuses more ranks than
    nodes (``utils/ompmultiprocessing.py:217-224``), so with TP > 1 the ranks share this
    process's cores (``cores``, the worker's share, where given)."""
    if not cores and tp_size > 1:
        cores = usable_core_ids()
    return cpu_thread_binding(cores, tp_size) if cores else None


def _model_max_len(text_config: Any) -> int | None:
    value = getattr(text_config, "max_position_embeddings", None)
    return int(value) if isinstance(value, int) and value > 0 else None


class VLLMBackend:
    """Runs prompts through one vLLM engine; returns ``[T, L, H]`` per prompt."""

    name = "vllm"

    def __init__(
        self,
        model_dir: str,
        layers: Sequence[LayerSpec],
        *,
        dtype: str | None = "auto",
        device: str | None = None,
        tp_size: int = 1,
        mem_fraction_static: float | None = None,
        max_num_batched_tokens: int = 16384,
        cpu_cores: Sequence[int] | None = None,
        trust_remote_code: bool = False,
        extra_engine_args: dict[str, Any] | None = None,
    ):
        from transformers import AutoConfig

        try:
            config = AutoConfig.from_pretrained(model_dir, trust_remote_code=trust_remote_code)
        except (OSError, ValueError) as exc:
            raise BadInputError(f"cannot load a model config: {exc}", path=model_dir) from exc
        text_config = getattr(config, "text_config", None) or config
        self.num_hidden_layers = int(text_config.num_hidden_layers)
        self.hidden_size = int(text_config.hidden_size)
        cfg_dtype = getattr(config, "dtype", None) or getattr(config, "torch_dtype", None)
        dtype_name = resolve_dtype(dtype, cfg_dtype)
        self.dtype = getattr(torch, dtype_name)
        self.layers = list(layers)
        self.plan = plan_capture(self.layers, self.num_hidden_layers)
        limit = _model_max_len(text_config)
        max_tokens = min(max_num_batched_tokens, limit) if limit else max_num_batched_tokens
        self.max_tokens = max_tokens
        on_cpu = str(device or "cpu").split(":")[0] == "cpu"
        kv_bytes = None
        if on_cpu and not os.environ.get("VLLM_CPU_KVCACHE_SPACE"):
            per_token = kv_bytes_per_token(text_config, dtype_name)
            kv_bytes = max(MIN_KV_BYTES, KV_BATCHES * max_tokens * per_token)
        # the hook reads the V1 runner's batch layout (module docstring)
        os.environ["VLLM_USE_V2_MODEL_RUNNER"] = "0"
        # vLLM logs to stdout by default (envs.py VLLM_LOGGING_STREAM), where `--json` prints
        for name, value in LOGGING.items():
            os.environ.setdefault(name, value)
        binding = cpu_binding(cpu_cores, tp_size)
        if on_cpu and binding and "VLLM_CPU_OMP_THREADS_BIND" not in os.environ:
            os.environ["VLLM_CPU_OMP_THREADS_BIND"] = binding
        self.capture_dir = make_capture_dir()
        self._slots = SlotReader(self.capture_dir)
        self._rid_prefix = f"hsstore-{uuid.uuid4().hex[:12]}-"
        self._rids = itertools.count()
        self.capture_stats: dict[str, float] = {}  # bytes, write_s, read_s (tools/bench_vllm.py)
        self.engine: Any = None
        try:
            self.engine = _start_engine(
                engine_kwargs(
                    model_dir,
                    dtype=dtype_name,
                    max_tokens=max_tokens,
                    tp_size=tp_size,
                    trust_remote_code=trust_remote_code,
                    gpu_memory_utilization=mem_fraction_static,
                    kv_cache_bytes=kv_bytes,
                    extra=extra_engine_args,
                )
            )
            config = capture_config(
                self.plan,
                hidden_size=self.hidden_size,
                directory=self.capture_dir,
                rid_prefix=self._rid_prefix,
            )
            problems = [p for p in self.engine.collective_rpc(
                "hsstore_install_capture", args=(config,)
            ) if p]  # fmt: skip
            if problems:
                raise BadInputError(
                    f"--backend vllm cannot extract this model: {problems[0]}; use --backend "
                    "transformers",
                    path=model_dir,
                )
        except BaseException:
            self.close()
            raise

    def close(self) -> None:
        engine, self.engine = self.engine, None
        try:
            if engine is not None:
                engine.engine_core.shutdown(timeout=ENGINE_SHUTDOWN_S)
        finally:
            shutil.rmtree(self.capture_dir, ignore_errors=True)

    def run(self, batch: Sequence[TokenizedPrompt]) -> list[torch.Tensor]:
        """Hidden states for each prompt, ``[T, L, H]`` in the stored dtype, on CPU."""
        from vllm import SamplingParams

        if not batch:
            return []
        params = SamplingParams(max_tokens=1, temperature=0.0, detokenize=False)
        rids = [f"{self._rid_prefix}{next(self._rids)}" for _ in batch]
        for rid, p in zip(rids, batch):
            if p.num_tokens > self.max_tokens:
                raise _fail(
                    p.sample_id,
                    f"{p.num_tokens} prompt tokens, more than the engine's max_model_len "
                    f"{self.max_tokens} (raise --max-batch-tokens or pass --max-length)",
                )
            self.engine.add_request(rid, {"prompt_token_ids": p.input_ids.tolist()}, params)
        finished: dict[str, Any] = {}
        while self.engine.has_unfinished_requests():
            for out in self.engine.step():
                if out.finished:
                    finished[out.request_id] = out
        states = []
        for rid, p in zip(rids, batch):
            self._check_output(finished.get(rid), p)
            states.append(
                states_from_captures(
                    self._slots,
                    rid,
                    num_tokens=p.num_tokens,
                    layers=len(self.layers),
                    hidden_size=self.hidden_size,
                    dtype=self.dtype,
                    sample_id=p.sample_id,
                    stats=self.capture_stats,
                    fail=_fail,
                    missing_hint=MISSING_HINT,
                )
            )
        return states

    @staticmethod
    def _check_output(out: Any, p: TokenizedPrompt) -> None:
        if out is None:
            raise _fail(p.sample_id, "the engine finished without answering this request")
        if out.prompt_token_ids is not None and len(out.prompt_token_ids) != p.num_tokens:
            raise _fail(p.sample_id, f"{len(out.prompt_token_ids)} prompt tokens != {p.num_tokens}")
        if out.num_cached_tokens:
            raise _fail(
                p.sample_id,
                f"{out.num_cached_tokens} prompt tokens came from the prefix cache, so their "
                "rows are missing; start the engine with enable_prefix_caching=False",
            )


def _start_engine(kwargs: dict[str, Any]) -> Any:
    try:
        import vllm
        from vllm import EngineArgs
        from vllm.v1.engine.llm_engine import LLMEngine
    except ImportError as exc:
        raise BadInputError("the vllm backend needs vLLM: pip install '.[vllm]'") from exc
    check_vllm_version(str(getattr(vllm, "__version__", "unknown")))
    return LLMEngine.from_engine_args(EngineArgs(**kwargs))
