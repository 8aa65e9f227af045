"""Hidden states from SGLang's offline ``Engine`` (GPU only; ``pip install '.[sglang]'``).

How SGLang is driven (sglang 0.5.23; paths below are inside its ``sglang/srt/``):

* **One engine, one forward per batch.** The engine runs with
  ``enable_return_aux_hidden_states=True`` + ``speculative_algorithm="EAGLE3"`` (capture only,
  no draft: ``arg_groups/validation_hook.py`` ``handle_aux_hidden_state_capture``) and explicit
  ``return_aux_hidden_state_layer_ids``. With aux capture on, the logits processor keeps the
  state it feeds the LM head as ``last_hidden_states`` next to the aux states
  (``layers/logits_processor.py`` ``_get_last_hidden_states_to_store``), but the response only
  carries ``hidden_states``. A forward hook, attached through SGLang's own ``forward_hooks``
  server argument (``model_executor/hook_manager.py``), appends that final state to the aux
  rows (:mod:`hsstore.extract.sglang_hook`), so one response holds ``[T, (K+1)*H]``: the K aux
  captures in ascending layer order, then the final state. Hooks only run on the eager path,
  so prefill (and decode) CUDA graphs are disabled; ``max_new_tokens=1`` never decodes.
* **Layer ids right by construction.** Model classes disagree on what an id means
  (``models/llama.py`` captures layer ``id + 1``; ``models/deepseek_v2.py``, which Kimi-K2.5,
  GLM-5 and Mistral Large 3 inherit, adds 1 only when the first id is 1; ``models/gpt_oss.py``
  keeps ids whose maximum is N). Every rule shifts every id by one when the list starts with
  1 and stays below N, so the ids sent are always ``[1, ...]`` (depth 2 first) and a capture
  that was not asked for is dropped. At least two aux layers are always captured so that a
  model which returns its pre-norm state in place of the aux states (``_get_hidden_states_to_
  store`` prefers ``hidden_states_before_norm``) gives a response of the wrong width, which is
  refused, never stored. tests/test_extract_sglang_contract.py checks this for every model
  class of the wheel.
* **Norm semantics.** ``final`` is the tensor the model hands its logits processor to project
  with the LM head (after the final norm); ``final-prenorm`` and depth 0 have no SGLang capture
  and are refused up front.
* Radix cache off and ``chunked_prefill_size=-1``: a prefix-cache hit or a chunked prefill
  returns fewer rows than prompt tokens. Every response is checked (prompt_tokens,
  cached_tokens == 0, T rows of the expected width) and anything else raises, naming the sample.
* **One engine per process.** ``Engine.shutdown`` kills every child of its process
  (``entrypoints/engine.py``), so the runner always runs this backend in a spawned worker
  process and never in the parent (see :mod:`hsstore.extract.runner`).

The engine is created through ``engine_factory`` so tests can pass a fake that answers in
SGLang's response shapes; by default it is ``sglang.Engine``.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from hsstore.errors import BadInputError, HsstoreError
from hsstore.extract.chat_tokens import TokenizedPrompt
from hsstore.format.layers import LayerSpec

# Versions whose sources this adapter was checked against (docs/EXTRACT.md). Others are refused
# unless HSSTORE_SGLANG_UNTESTED=1, after validating with --check-against transformers.
TESTED_SGLANG_VERSIONS = ("0.5.23",)
UNTESTED_ENV = "HSSTORE_SGLANG_UNTESTED"
HOOK_FACTORY = "hsstore.extract.sglang_hook:final_state_hook"
# The id every capture list starts with: under each rule in the wheel, a list that starts with 1
# (and stays below N) captures the residual entering layer id + 1.
ANCHOR_ID = 1


class SGLangResponseError(HsstoreError):
    """SGLang answered, but not with one full row of hidden states per prompt token."""


@dataclass(frozen=True)
class CapturePlan:
    """What to ask SGLang for and where each returned block goes.

    ``aux_ids`` is sent as ``return_aux_hidden_state_layer_ids``; SGLang returns one block per
    captured depth in ascending order (``captured_depths``), then the hook's final state.
    ``slots[j]`` is the stored layer position of block j (the last block is the final state),
    or None for a block captured only to make the ids rule-independent.
    """

    aux_ids: list[int]
    captured_depths: list[int]
    slots: list[int | None]

    @property
    def blocks(self) -> int:
        return len(self.captured_depths) + 1


def plan_capture(layers: Sequence[LayerSpec], num_hidden_layers: int) -> CapturePlan:
    """Choose SGLang ids that capture exactly the requested depths under every model's rule."""
    n = num_hidden_layers
    wanted: dict[int, int] = {}
    final_slot: int | None = None
    for pos, spec in enumerate(layers):
        if spec.final_norm and spec.depth == n:
            final_slot = pos
        elif spec.depth == n:
            raise BadInputError(
                "the sglang backend cannot return final-prenorm (the residual after the last "
                "layer, before the final norm): SGLang captures aux states at the input of a "
                "decoder layer and none follows the last; use 'final' or the transformers backend"
            )
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
    aux_ids = [ANCHOR_ID] + [d - 1 for d in captured if d - 1 != ANCHOR_ID]
    slots = [wanted.get(d) for d in captured] + [final_slot]
    return CapturePlan(aux_ids=aux_ids, captured_depths=captured, slots=slots)


def rows_from_response(
    response: Any, *, num_tokens: int, width: int, sample_id: str, hidden_size: int | None = None
) -> torch.Tensor:
    """One SGLang response -> a float32 ``[num_tokens, width]`` tensor, or a loud error.

    ``meta_info["hidden_states"]`` is a list with one entry per forward the request took part
    in: the prefill entry is ``[T][width]`` nested lists; with ``max_new_tokens=1`` no decode
    entry follows, and any that do are ignored.
    """

    def fail(msg: str) -> SGLangResponseError:
        return SGLangResponseError(f"sglang response: {msg}", sample_id=sample_id)

    if not isinstance(response, dict) or not isinstance(response.get("meta_info"), dict):
        raise fail("no meta_info")
    meta = response["meta_info"]
    finish = meta.get("finish_reason")
    if isinstance(finish, dict) and finish.get("type") == "abort":
        raise fail(f"request aborted: {finish.get('message', finish)}")
    if meta.get("prompt_tokens") not in (None, num_tokens):
        raise fail(f"prompt_tokens {meta.get('prompt_tokens')} != {num_tokens} sent")
    if meta.get("cached_tokens"):
        raise fail(
            f"{meta['cached_tokens']} prompt tokens came from the prefix cache, so their rows "
            "are missing; start the engine with disable_radix_cache=True"
        )
    hidden = meta.get("hidden_states")
    if not isinstance(hidden, list) or not hidden:
        raise fail("no hidden_states (engine started without return-hidden-states support?)")
    try:
        rows = np.asarray(hidden[0], dtype=np.float32)
    except (ValueError, TypeError) as exc:
        raise fail(f"ragged or non-numeric hidden_states ({exc})") from None
    if rows.ndim != 2:
        raise fail(f"prefill hidden_states has shape {rows.shape}, expected [T, {width}]")
    if rows.shape[0] != num_tokens:
        raise fail(
            f"truncated: {rows.shape[0]} rows of hidden states for {num_tokens} prompt tokens "
            "(chunked prefill or prefix caching enabled?)"
        )
    if rows.shape[1] != width:
        why = ""
        if hidden_size and rows.shape[1] == width - hidden_size:
            why = (
                " (the final state was not appended: the forward hook did not run, e.g. a "
                "CUDA graph replayed the prefill, or this SGLang keeps no last_hidden_states)"
            )
        elif hidden_size and rows.shape[1] in (hidden_size, 2 * hidden_size):
            why = " (the model returned its pre-norm final state instead of the aux captures)"
        raise fail(f"rows have width {rows.shape[1]}, expected {width}{why}")
    if not np.isfinite(rows).all():
        raise fail("non-finite values in hidden_states")
    return torch.from_numpy(rows)


def engine_kwargs(
    model_dir: str,
    plan: CapturePlan,
    *,
    hidden_size: int,
    tp_size: int,
    mem_fraction_static: float | None,
    dtype: str,
    trust_remote_code: bool = False,
    extra: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """Server arguments of the one engine (every name is a field of sglang 0.5.23's
    ServerArgs, ``arg_groups/fields/*.py``; the contract test checks them against the wheel)."""
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
        "forward_hooks": [
            {
                "name": "hsstore-final-state",
                "target_modules": ["logits_processor", "*.logits_processor"],
                "hook_factory": HOOK_FACTORY,
                "config": {"aux_width": len(plan.captured_depths) * hidden_size},
            }
        ],
    }
    if mem_fraction_static is not None:
        kwargs["mem_fraction_static"] = mem_fraction_static
    kwargs.update(extra or {})
    return kwargs


def check_sglang_version(version: str) -> None:
    """Refuse SGLang releases this adapter was not checked against (override: env var)."""
    if version in TESTED_SGLANG_VERSIONS or os.environ.get(UNTESTED_ENV) == "1":
        return
    raise BadInputError(
        f"SGLang {version} is not a version hsstore's sglang backend was checked against "
        f"({', '.join(TESTED_SGLANG_VERSIONS)}): its layer-id rules, aux capture and forward "
        f"hooks may differ. Install sglang=={TESTED_SGLANG_VERSIONS[-1]}, or validate this one "
        f"with `hsstore extract --backend sglang --check-against transformers --limit 8` and "
        f"set {UNTESTED_ENV}=1"
    )


def _default_engine_factory(**kwargs: Any) -> Any:
    try:
        import sglang
    except ImportError as exc:
        raise BadInputError(
            "the sglang backend needs SGLang (pip install '.[sglang]', GPU only)"
        ) from exc
    check_sglang_version(str(getattr(sglang, "__version__", "unknown")))
    return sglang.Engine(**kwargs)


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
        self.dtype = _DTYPES[dtype_name]
        self.layers = list(layers)
        self.plan = plan_capture(self.layers, self.num_hidden_layers)
        factory = engine_factory or _default_engine_factory
        self.engine = factory(
            **engine_kwargs(
                model_dir,
                self.plan,
                hidden_size=self.hidden_size,
                tp_size=tp_size,
                mem_fraction_static=mem_fraction_static,
                dtype=dtype_name,
                trust_remote_code=trust_remote_code,
                extra=extra_engine_args,
            )
        )

    def close(self) -> None:
        engine, self.engine = self.engine, None
        if engine is not None:
            engine.shutdown()

    def _generate(self, batch: Sequence[TokenizedPrompt]) -> list[Any]:
        responses = self.engine.generate(
            input_ids=[p.input_ids.tolist() for p in batch],
            sampling_params={"max_new_tokens": 1, "temperature": 0.0},
            return_hidden_states=True,
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
        h = self.hidden_size
        responses = self._generate(batch)
        out: list[torch.Tensor] = []
        for response, p in zip(responses, batch):
            t = p.num_tokens
            rows = rows_from_response(
                response,
                num_tokens=t,
                width=self.plan.blocks * h,
                sample_id=p.sample_id,
                hidden_size=h,
            )
            blocks = rows.view(t, self.plan.blocks, h)
            states = torch.empty((t, len(self.layers), h), dtype=self.dtype)
            for j, slot in enumerate(self.plan.slots):
                if slot is not None:
                    states[:, slot] = blocks[:, j]
            out.append(states)
        return out


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
