"""Hidden states from SGLang's offline ``Engine``, on GPU or CPU (``pip install '.[sglang]'``).

How SGLang is driven (sglang 0.5.23; paths below are inside its ``sglang/srt/``):

* **One engine, one forward per batch.** The engine runs with
  ``enable_return_aux_hidden_states=True`` + ``speculative_algorithm="EAGLE3"`` (capture only,
  no draft: ``arg_groups/validation_hook.py`` ``handle_aux_hidden_state_capture``) and explicit
  ``return_aux_hidden_state_layer_ids``. With aux capture on, every forward captures in FULL
  mode (``arg_groups/serving_hook.py`` ``handle_return_hidden_states_mode``) and the logits
  processor keeps the state it feeds the LM head as ``last_hidden_states`` next to the aux
  states (``layers/logits_processor.py`` ``_get_last_hidden_states_to_store``).
* **States travel as tensors.** A forward hook, attached through SGLang's own
  ``forward_hooks`` server argument (``model_executor/hook_manager.py``), copies each hsstore
  request's rows, aux captures and final state, from the logits processor's output into a
  slot of a reused pool in shared memory that this worker owns (:mod:`hsstore.extractors.
  sglang_hook`, :mod:`hsstore.extractors.backends.sglang.capture`), named after the request id hsstore
  chose. Requests ask for no hidden states, so the response is a small receipt (token counts,
  finish reason) and the scheduler builds no Python lists. The worker hands the slot's pages
  (mapped once) to the writer as a ``[T, L, H]`` tensor in the engine's dtype, and the slot is
  free again when that tensor is: one copy of a sample's states in host memory, none on the
  way. With tensor parallelism only TP rank 0 writes (every rank holds the
  full residual stream). ``capture="lists"`` (or ``HSSTORE_SGLANG_CAPTURE=lists``) keeps
  SGLang's own ``return_hidden_states`` path as a fallback, with a warning: the scheduler turns
  every value into a Python float (``managers/scheduler_components/batch_result_processor.py``
  ``_append_prefill_hidden_states``), which bounds extraction by one host core.
  Hooks only run on the eager path, so prefill (and decode) CUDA graphs are disabled;
  ``max_new_tokens=1`` never decodes.
* **Layer ids right by construction.** Model classes disagree on what an id means
  (``models/llama.py`` captures layer ``id + 1``; ``models/deepseek_v2.py``, which Kimi-K2.5,
  GLM-5 and Mistral Large 3 inherit, adds 1 only when the first id is 1; ``models/gpt_oss.py``
  keeps ids whose maximum is N). Every rule shifts every id by one when the list starts with
  1 and stays below N, so the ids sent are always ``[1, ...]`` (depth 2 first) and a capture
  that was not asked for is dropped. At least two aux layers are always captured so that a
  model which returns its pre-norm state in place of the aux states (``_get_hidden_states_to_
  store`` prefers ``hidden_states_before_norm``) gives states of the wrong width, which are
  refused, never stored. tests/test_extract_sglang_contract.py checks this for every model
  class of the wheel.
* **Norm semantics.** ``final`` is the tensor the model hands its logits processor to project
  with the LM head (after the final norm). ``final-prenorm`` is the final norm's input: a second
  forward hook on the model's final norm module (``hook.FINAL_NORM_MODULES``) keeps the residual
  stream that goes into it (``layers/layer_boundary/residual/access.py`` ``final_norm_pair``:
  the fused ``norm(hidden, residual)`` returns the updated residual, hidden + residual, as its
  second output; an unfused norm's input is the state itself), and the logits-processor hook
  stores it with the rest. A forward in which that hook did not run exactly once (a fused
  terminal norm that bypasses the module, ``residual/batch.py`` ``final_norm`` with
  ``finalize_norm``) is refused, naming the sample. Depth 0 has no SGLang capture and is
  refused up front.
* Radix cache off and ``chunked_prefill_size=-1``: a prefix-cache hit or a chunked prefill
  computes fewer rows than prompt tokens in a forward. Every request is checked (prompt_tokens,
  cached_tokens == 0, T rows of the expected width from one forward with no prefix) and
  anything else raises, naming the sample (:mod:`hsstore.extractors.backends.sglang.checks`).
* **One engine per process.** ``Engine.shutdown`` kills every child of its process
  (``entrypoints/engine.py``), so the runner always runs this backend in a spawned worker
  process and never in the parent (see :mod:`hsstore.extractors.runner`).
* **CPU.** ``device="cpu"`` runs SGLang's CPU engine (set ``SGLANG_USE_CPU_ENGINE=1`` and use
  ``attention_backend="torch_native"``): the cheap way to validate a model family before renting
  GPUs. SGLang's default memory fraction is negative there, so hsstore computes one
  (:mod:`hsstore.extractors.backends.sglang.memory`).

The engine is created through ``engine_factory`` so tests can pass a fake that answers in
SGLang's response shapes; by default it is ``sglang.Engine``.
"""

from __future__ import annotations

import itertools
import os
import shutil
import uuid
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from hsstore import settings
from hsstore.errors import BadInputError
from hsstore.extractors.backends.sglang.capture import SlotReader, make_capture_dir
from hsstore.extractors.backends.sglang.checks import (
    SGLangResponseError,
    check_meta,
    rows_from_response,
    states_from_captures,
)
from hsstore.extractors.backends.sglang.hook import FINAL_NORM_MODULES
from hsstore.extractors.backends.sglang.memory import cpu_mem_fraction, engine_start_lock
from hsstore.extractors.backends.sglang.models import refuse_wrong_capture
from hsstore.extractors.chat_tokens import TokenizedPrompt
from hsstore.spec.conventions import sglang_ids
from hsstore.spec.layers import LayerSpec

__all__ = [
    "SGLangBackend",
    "SGLangResponseError",
    "check_sglang_version",
    "engine_kwargs",
    "plan_capture",
    "rows_from_response",
]

# Versions whose sources this adapter was checked against (docs/EXTRACT.md). Others are refused
# unless HSSTORE_SGLANG_UNTESTED=1, after validating with --check-against transformers.
TESTED_SGLANG_VERSIONS = ("0.5.23",)
UNTESTED_ENV = "HSSTORE_SGLANG_UNTESTED"
CAPTURE_MODES = ("shm", "lists")
HOOK_FACTORY = "hsstore.extractors.backends.sglang.hook:capture_hook"
FINAL_NORM_HOOK_FACTORY = "hsstore.extractors.backends.sglang.hook:final_norm_hook"
# The id every capture list starts with: under each rule in the wheel, a list that starts with 1
# (and stays below N) captures the residual entering layer id + 1.
ANCHOR_ID = 1


@dataclass(frozen=True)
class CapturePlan:
    """What to ask SGLang for and where each returned block goes.

    ``aux_ids`` is sent as ``return_aux_hidden_state_layer_ids``; SGLang returns one block per
    captured depth in ascending order (``captured_depths``), then the final state, then (with
    ``prenorm``) the final norm's input. ``slots[j]`` is the stored layer position of block j,
    or None for a block captured only to make the ids rule-independent.
    """

    aux_ids: list[int]
    captured_depths: list[int]
    slots: list[int | None]
    layout: list[int]  # for each stored layer position, the block it comes from
    prenorm: bool = False  # whether the final norm's input is captured

    @property
    def blocks(self) -> int:
        return len(self.captured_depths) + 1 + int(self.prenorm)


def plan_capture(layers: Sequence[LayerSpec], num_hidden_layers: int) -> CapturePlan:
    """Choose SGLang ids that capture exactly the requested depths under every model's rule."""
    n = num_hidden_layers
    wanted: dict[int, int] = {}
    final_slot: int | None = None
    prenorm_slot: int | None = None
    for pos, spec in enumerate(layers):
        if spec.final_norm and spec.depth == n:
            final_slot = pos
        elif spec.depth == n:
            prenorm_slot = pos
        elif spec.depth == 0:
            raise BadInputError(
                "the sglang backend cannot return depth 0 (embeddings): SGLang aux layer ids "
                "must be >= 0, which starts at depth 1; use the transformers backend"
            )
        else:
            wanted[spec.depth] = pos
    if n < 3:
        raise BadInputError(
            f"the sglang backend needs a model with at least 3 decoder layers (this one has {n}):"
            " its layer ids are made rule-independent by always capturing depth 2"
        )
    depths = set(wanted) | {ANCHOR_ID + 1}
    if len(depths) < 2:  # see module docstring: a pre-norm substitution must change the width
        depths.add(1)
    captured = sorted(depths)
    aux_ids = sglang_ids(captured, n)  # starts with ANCHOR_ID: depth 2 is always captured
    prenorm = prenorm_slot is not None
    slots = [wanted.get(d) for d in captured] + [final_slot] + ([prenorm_slot] if prenorm else [])
    final_block = {True: len(captured), False: len(captured) + 1}  # by spec.final_norm
    layout = [
        final_block[s.final_norm] if s.depth == n else captured.index(s.depth) for s in layers
    ]
    return CapturePlan(
        aux_ids=aux_ids, captured_depths=captured, slots=slots, layout=layout, prenorm=prenorm
    )


def engine_kwargs(
    model_dir: str,
    plan: CapturePlan,
    *,
    hidden_size: int,
    tp_size: int,
    mem_fraction_static: float | None,
    dtype: str,
    trust_remote_code: bool = False,
    capture: str = "shm",
    capture_dir: str | None = None,
    rid_prefix: str = "",
    device: str | None = None,
    extra: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """Server arguments of the one engine (every name is a field of sglang 0.5.23's
    ServerArgs, ``arg_groups/fields/*.py``; the contract test checks them against the wheel)."""
    aux_width = len(plan.captured_depths) * hidden_size
    if capture == "shm":
        hook_config: dict[str, Any] = {
            "mode": "shm",
            "aux_width": aux_width,
            "hidden_size": hidden_size,
            "layout": plan.layout,
            "dir": capture_dir,
            "rid_prefix": rid_prefix,
        }
    else:
        hook_config = {"mode": "append", "aux_width": aux_width}
    hook_config["prenorm"] = plan.prenorm
    hooks = [
        {
            "name": "hsstore-capture",
            "target_modules": ["logits_processor", "*.logits_processor"],
            "hook_factory": HOOK_FACTORY,
            "config": hook_config,
        }
    ]
    if plan.prenorm:
        hooks.append(
            {
                "name": "hsstore-final-norm",
                "target_modules": list(FINAL_NORM_MODULES),
                "hook_factory": FINAL_NORM_HOOK_FACTORY,
                "config": {},
            }
        )
    kwargs: dict[str, Any] = {
        "model_path": model_dir,
        "skip_tokenizer_init": True,
        "trust_remote_code": trust_remote_code,
        "disable_radix_cache": True,
        "chunked_prefill_size": -1,
        "disable_prefill_cuda_graph": True,  # forward hooks do not run inside a CUDA graph
        "disable_decode_cuda_graph": True,
        "tp_size": tp_size,
        "dtype": dtype,
        "random_seed": 0,
        "log_level": "error",
        "enable_return_aux_hidden_states": True,
        "speculative_algorithm": "EAGLE3",
        "return_aux_hidden_state_layer_ids": list(plan.aux_ids),
        "forward_hooks": hooks,
    }
    if device == "cpu":  # SGLang's CPU path runs with its torch-native attention
        kwargs["device"] = "cpu"
        kwargs["attention_backend"] = "torch_native"
    if mem_fraction_static is not None:
        kwargs["mem_fraction_static"] = mem_fraction_static
    kwargs.update(extra or {})
    return kwargs


def check_sglang_version(version: str) -> None:
    """Refuse SGLang releases this adapter was not checked against (override: env var)."""
    if version in TESTED_SGLANG_VERSIONS or settings.current().sglang_untested:
        return
    raise BadInputError(
        f"SGLang {version} is not a version hsstore's sglang backend was checked against "
        f"({', '.join(TESTED_SGLANG_VERSIONS)}): its layer-id rules, aux capture and forward "
        f"hooks may differ. Install sglang=={TESTED_SGLANG_VERSIONS[-1]}, or validate this one "
        f"with `hsstore extract --backend sglang --check-against transformers --limit 8` and "
        f"set {UNTESTED_ENV}=1"
    )


def _default_engine_factory(**kwargs: Any) -> Any:
    if kwargs.get("device") == "cpu":  # read by sglang at import (platforms/__init__.py)
        os.environ.setdefault("SGLANG_USE_CPU_ENGINE", "1")
    try:
        import sglang
    except ImportError as exc:
        raise BadInputError("the sglang backend needs SGLang: pip install '.[sglang]'") from exc
    check_sglang_version(str(getattr(sglang, "__version__", "unknown")))
    if kwargs.get("device") != "cpu":
        return sglang.Engine(**kwargs)
    with engine_start_lock():  # engines on one host's memory start in turn
        return sglang.Engine(**kwargs)


def _capture_mode(capture: str | None) -> str:
    mode = capture or settings.current().sglang_capture or "shm"
    if mode not in CAPTURE_MODES:
        raise BadInputError(
            f"unknown sglang capture {mode!r}; use one of {', '.join(CAPTURE_MODES)}"
        )
    if mode == "lists":
        warnings.warn(
            "sglang capture 'lists': hidden states travel as Python lists through SGLang's "
            "return_hidden_states, one Python float per value; extraction is bound by one host "
            "core and host memory grows with the batch (the default 'shm' capture has neither)",
            stacklevel=3,
        )
    return mode


class SGLangBackend:
    """Runs prompts through one SGLang engine; returns ``[T, L, H]`` per prompt."""

    name = "sglang"

    def __init__(
        self,
        model_dir: str,
        layers: Sequence[LayerSpec],
        *,
        engine_factory: Callable[..., Any] | None = None,
        tp_size: int = 1,
        mem_fraction_static: float | None = None,
        dtype: str | None = "auto",
        device: str | None = None,
        capture: str | None = None,
        trust_remote_code: bool = False,
        extra_engine_args: dict[str, Any] | None = None,
    ):
        from transformers import AutoConfig

        try:
            config = AutoConfig.from_pretrained(model_dir, trust_remote_code=trust_remote_code)
        except (OSError, ValueError) as exc:
            raise BadInputError(f"cannot load a model config: {exc}", path=model_dir) from exc
        refuse_wrong_capture(config, model_dir)
        text_config = getattr(config, "text_config", None) or config
        self.num_hidden_layers = int(text_config.num_hidden_layers)
        self.hidden_size = int(text_config.hidden_size)
        cfg_dtype = getattr(config, "dtype", None) or getattr(config, "torch_dtype", None)
        dtype_name = resolve_dtype(dtype, cfg_dtype)
        self.dtype = _DTYPES[dtype_name]
        self.layers = list(layers)
        self.plan = plan_capture(self.layers, self.num_hidden_layers)
        self.capture = _capture_mode(capture)
        device = str(device).split(":")[0] if device else None
        if device == "cpu" and mem_fraction_static is None:
            checkpoint = str(cfg_dtype).replace("torch.", "") if cfg_dtype is not None else ""
            mem_fraction_static = cpu_mem_fraction(
                model_dir, text_config, checkpoint_dtype=checkpoint, dtype=dtype_name
            )
        self.capture_dir = make_capture_dir() if self.capture == "shm" else None
        self._slots = SlotReader(self.capture_dir) if self.capture_dir else None
        self._rid_prefix = f"hsstore-{uuid.uuid4().hex[:12]}-"
        self._rids = itertools.count()
        # bytes captured, the scheduler's write_s and this worker's read_s (tools/bench_sglang.py)
        self.capture_stats: dict[str, float] = {}
        self.engine = None
        factory = engine_factory or _default_engine_factory
        try:
            self.engine = factory(
                **engine_kwargs(
                    model_dir,
                    self.plan,
                    hidden_size=self.hidden_size,
                    tp_size=tp_size,
                    mem_fraction_static=mem_fraction_static,
                    dtype=dtype_name,
                    trust_remote_code=trust_remote_code,
                    capture=self.capture,
                    capture_dir=self.capture_dir,
                    rid_prefix=self._rid_prefix,
                    device=device,
                    extra=extra_engine_args,
                )
            )
        except BaseException:
            self._remove_capture_dir()
            raise

    def close(self) -> None:
        engine, self.engine = self.engine, None
        try:
            if engine is not None:
                engine.shutdown()
        finally:
            self._remove_capture_dir()

    def _remove_capture_dir(self) -> None:
        if self.capture_dir is not None:
            shutil.rmtree(self.capture_dir, ignore_errors=True)

    def _generate(self, batch: Sequence[TokenizedPrompt], rids: list[str]) -> list[Any]:
        responses = self.engine.generate(
            input_ids=[p.input_ids.tolist() for p in batch],
            sampling_params={"max_new_tokens": 1, "temperature": 0.0},
            return_hidden_states=self.capture == "lists",
            rid=rids,
        )
        if isinstance(responses, dict):
            responses = [responses]
        if not isinstance(responses, list) or len(responses) != len(batch):
            got = len(responses) if isinstance(responses, list) else type(responses).__name__
            raise SGLangResponseError(f"sglang returned {got} responses for {len(batch)} prompts")
        return responses

    def run(self, batch: Sequence[TokenizedPrompt]) -> list[torch.Tensor]:
        """Hidden states for each prompt, ``[T, L, H]`` in the stored dtype, on CPU."""
        if not batch:
            return []
        rids = [f"{self._rid_prefix}{next(self._rids)}" for _ in batch]
        responses = self._generate(batch, rids)
        if self.capture == "lists":
            return [self._from_lists(r, p) for r, p in zip(responses, batch)]
        out = []
        for response, p, rid in zip(responses, batch, rids):
            check_meta(response, num_tokens=p.num_tokens, sample_id=p.sample_id, rid=rid)
            out.append(
                states_from_captures(
                    self._slots,
                    rid,
                    num_tokens=p.num_tokens,
                    layers=len(self.layers),
                    hidden_size=self.hidden_size,
                    dtype=self.dtype,
                    sample_id=p.sample_id,
                    stats=self.capture_stats,
                )
            )
        return out

    def _from_lists(self, response: Any, p: TokenizedPrompt) -> torch.Tensor:
        h, t = self.hidden_size, p.num_tokens
        rows = rows_from_response(
            response, num_tokens=t, width=self.plan.blocks * h, sample_id=p.sample_id, hidden_size=h
        )
        blocks = rows.view(t, self.plan.blocks, h)
        return blocks[:, self.plan.layout].to(self.dtype)


_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def resolve_dtype(name: str | None, cfg_dtype: Any) -> str:
    """The dtype the engine runs in, always passed explicitly so SGLang's own "auto" (which
    turns float32 checkpoints into float16) never decides what gets stored."""
    if name and name != "auto":
        if name not in _DTYPES:
            raise BadInputError(f"unknown dtype {name!r}; use one of {', '.join(_DTYPES)}")
        return name
    cfg = str(cfg_dtype).replace("torch.", "") if cfg_dtype is not None else ""
    return cfg if cfg in ("bfloat16", "float16") else "bfloat16"
