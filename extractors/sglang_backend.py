"""Hidden states from SGLang's offline ``Engine`` (GPU only; ``pip install '.[sglang]'``).

How SGLang is driven (sources and versions in docs/EXTRACT.md):

* Aux layers (depths 1..N-1) come from an engine started with
  ``enable_return_aux_hidden_states=True`` + ``speculative_algorithm="EAGLE3"`` (the capture
  convention; no draft is loaded) and explicit ``return_aux_hidden_state_layer_ids``. Those ids
  are computed from canonical depths by :mod:`hsstore.format.conventions` (``sglang-llama``, or
  ``sglang-deepseek`` for the model classes that use that rule). SGLang returns the captured
  states concatenated along the feature axis, ``[T, K*H]``, in ascending layer order whatever
  order the ids were passed in.
* With aux capture on, SGLang returns the aux states *instead of* the final state, so the
  ``final`` layer (post-norm) comes from a second engine started with
  ``enable_return_hidden_states=True`` and no aux capture (each engine gets half the memory
  fraction). ``final-prenorm`` and depth 0 have no SGLang id and are refused up front.
* Every engine runs with ``disable_radix_cache`` and ``chunked_prefill_size=-1``: a prefix-cache
  hit or a prefill split into chunks returns fewer rows than prompt tokens (older releases even
  misalign them). Requests go by ``input_ids`` with ``max_new_tokens=1`` and
  ``return_hidden_states=True``.
* Every response is checked: prompt_tokens, cached_tokens == 0, and exactly T rows of the
  expected width; anything else raises, naming the sample. A truncated response never turns
  into a stored sample.

The engine is created through ``engine_factory`` so tests can pass a fake that returns SGLang's
response shapes; by default it is ``sglang.Engine``.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch

from extractors.chat_tokens import TokenizedPrompt
from hsstore.errors import BadInputError, HsstoreError
from hsstore.format import conventions
from hsstore.format.layers import LayerSpec

# Model classes whose set_eagle3_layers_to_capture applies the "+1 only when the first id is 1"
# rule (sglang 0.5.23: models/deepseek_v2.py, models/glm4_moe_lite.py). Every other model class
# with EAGLE-3 capture adds 1 to each id (models/llama.py and the rest).
DEEPSEEK_RULE_ARCHITECTURES = frozenset(
    {
        "DeepseekV2ForCausalLM",
        "DeepseekV3ForCausalLM",
        "DeepseekV32ForCausalLM",
        "Glm4MoeLiteForCausalLM",
    }
)


class SGLangResponseError(HsstoreError):
    """SGLang answered, but not with one full row of hidden states per prompt token."""


def sglang_convention(architectures: Sequence[str] | None) -> str:
    """The layer-id convention SGLang applies to this model's aux ids."""
    arch = architectures[0] if architectures else ""
    if arch in DEEPSEEK_RULE_ARCHITECTURES:
        return conventions.SGLANG_DEEPSEEK
    return conventions.SGLANG_LLAMA


def plan_layers(
    layers: Sequence[LayerSpec], num_hidden_layers: int, architectures: Sequence[str] | None
) -> tuple[list[int], list[int], bool]:
    """Split stored layers into SGLang requests.

    Returns ``(aux_ids, aux_positions, want_final)``: the ids to pass as
    ``return_aux_hidden_state_layer_ids``, for each stored layer position served by aux capture
    the order SGLang returns them in (ascending depth), and whether the final post-norm state is
    needed (second engine).
    """
    n = num_hidden_layers
    aux: list[tuple[int, LayerSpec]] = []
    want_final = False
    for pos, spec in enumerate(layers):
        if spec.final_norm and spec.depth == n:
            want_final = True
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
            aux.append((pos, spec))
    if not aux:
        return [], [], want_final
    convention = sglang_convention(architectures)
    # SGLang returns captures in layer order, so the id order is free: pass deepest first so the
    # deepseek rule never sees a leading id of 1 unless there is a single depth-1 layer.
    by_depth_desc = sorted((spec for _, spec in aux), key=lambda s: -s.depth)
    try:
        ids = conventions.from_canonical(convention, by_depth_desc, n)
    except conventions.ConventionError as exc:
        raise BadInputError(f"sglang backend: {exc}") from exc
    ascending = sorted(aux, key=lambda item: item[1].depth)
    positions = [pos for pos, _ in ascending]
    return ids, positions, want_final


def rows_from_response(
    response: Any, *, num_tokens: int, width: int, sample_id: str, what: str
) -> torch.Tensor:
    """One SGLang response -> a float32 ``[num_tokens, width]`` tensor, or a loud error.

    ``meta_info["hidden_states"]`` is a list with one entry per forward the request took part
    in: the prefill entry is ``[T][width]`` nested lists; with ``max_new_tokens=1`` no decode
    entry follows, and any that do are ignored.
    """

    def fail(msg: str) -> SGLangResponseError:
        return SGLangResponseError(f"sglang {what} response: {msg}", sample_id=sample_id)

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
        raise fail(f"rows have width {rows.shape[1]}, expected {width}")
    if not np.isfinite(rows).all():
        raise fail("non-finite values in hidden_states")
    return torch.from_numpy(rows)


def engine_kwargs(
    model_dir: str,
    *,
    aux_ids: list[int] | None,
    tp_size: int,
    mem_fraction_static: float | None,
    dtype: str,
    extra: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """Server arguments for one engine: aux capture when ``aux_ids`` is given, else final."""
    kwargs: dict[str, Any] = {
        "model_path": model_dir,
        "skip_tokenizer_init": True,
        "disable_radix_cache": True,
        "chunked_prefill_size": -1,
        "tp_size": tp_size,
        "dtype": dtype,
        "random_seed": 0,
        "log_level": "error",
    }
    if mem_fraction_static is not None:
        kwargs["mem_fraction_static"] = mem_fraction_static
    if aux_ids is not None:
        kwargs.update(
            enable_return_aux_hidden_states=True,
            speculative_algorithm="EAGLE3",
            return_aux_hidden_state_layer_ids=list(aux_ids),
        )
    else:
        kwargs["enable_return_hidden_states"] = True
    kwargs.update(extra or {})
    return kwargs


# The first release with enable_return_aux_hidden_states (absent up to 0.5.22, see EXTRACT.md).
MIN_AUX_VERSION = (0, 5, 23)


def _version_tuple(text: str) -> tuple[int, ...]:
    parts = []
    for piece in text.split(".")[:3]:
        lead = re.match(r"\d+", piece)  # "23rc1" -> 23
        if lead is None:
            break
        parts.append(int(lead.group()))
    return tuple(parts)


def _default_engine_factory(**kwargs: Any) -> Any:
    try:
        import sglang
    except ImportError as exc:
        raise BadInputError(
            "the sglang backend needs SGLang (pip install '.[sglang]', GPU only)"
        ) from exc
    version = getattr(sglang, "__version__", "0")
    if kwargs.get("enable_return_aux_hidden_states") and _version_tuple(version) < MIN_AUX_VERSION:
        need = ".".join(map(str, MIN_AUX_VERSION))
        raise BadInputError(
            f"SGLang {version} cannot return aux hidden states without a draft model; "
            f"aux layers need sglang>={need} (or use the transformers backend)"
        )
    return sglang.Engine(**kwargs)


class SGLangBackend:
    """Runs prompts through one or two SGLang engines; returns ``[T, L, H]`` per prompt."""

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
        extra_engine_args: dict[str, Any] | None = None,
    ):
        from transformers import AutoConfig

        try:
            config = AutoConfig.from_pretrained(model_dir)
        except (OSError, ValueError) as exc:
            raise BadInputError(f"cannot load a model config: {exc}", path=model_dir) from exc
        text_config = getattr(config, "text_config", None) or config
        self.num_hidden_layers = int(text_config.num_hidden_layers)
        self.hidden_size = int(text_config.hidden_size)
        self.vocab_size = int(text_config.vocab_size)
        cfg_dtype = getattr(config, "dtype", None) or getattr(config, "torch_dtype", None)
        dtype_name = resolve_dtype(dtype, cfg_dtype)
        self.dtype = _DTYPES[dtype_name]
        self.layers = list(layers)
        self.aux_ids, self.aux_positions, self.want_final = plan_layers(
            self.layers, self.num_hidden_layers, getattr(config, "architectures", None)
        )
        factory = engine_factory or _default_engine_factory
        n_engines = int(bool(self.aux_ids)) + int(self.want_final)
        share = None
        if mem_fraction_static is not None:
            share = mem_fraction_static
        elif n_engines == 2:
            share = 0.4  # two engines side by side must each leave room for the other
        common = {"tp_size": tp_size, "mem_fraction_static": share, "dtype": dtype_name}
        self.aux_engine = (
            factory(
                **engine_kwargs(model_dir, aux_ids=self.aux_ids, extra=extra_engine_args, **common)
            )
            if self.aux_ids
            else None
        )
        self.final_engine = (
            factory(**engine_kwargs(model_dir, aux_ids=None, extra=extra_engine_args, **common))
            if self.want_final
            else None
        )

    def close(self) -> None:
        for engine in (self.aux_engine, self.final_engine):
            if engine is not None and hasattr(engine, "shutdown"):
                engine.shutdown()
        self.aux_engine = self.final_engine = None

    def _generate(self, engine: Any, batch: Sequence[TokenizedPrompt]) -> list[Any]:
        responses = engine.generate(
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
        k = len(self.aux_ids)
        aux = self._generate(self.aux_engine, batch) if self.aux_engine is not None else None
        final = self._generate(self.final_engine, batch) if self.final_engine is not None else None
        out: list[torch.Tensor] = []
        for i, p in enumerate(batch):
            t = p.num_tokens
            states = torch.empty((t, len(self.layers), h), dtype=self.dtype)
            if aux is not None:
                rows = rows_from_response(
                    aux[i], num_tokens=t, width=k * h, sample_id=p.sample_id, what="aux"
                )
                per_layer = rows.view(t, k, h)
                for j, pos in enumerate(self.aux_positions):
                    states[:, pos] = per_layer[:, j]
            if final is not None:
                rows = rows_from_response(
                    final[i], num_tokens=t, width=h, sample_id=p.sample_id, what="final"
                )
                for pos, spec in enumerate(self.layers):
                    if spec.final_norm:
                        states[:, pos] = rows
            out.append(states)
        return out


_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def resolve_dtype(name: str | None, cfg_dtype: Any) -> str:
    """The dtype the engines run in, always passed explicitly so SGLang's own "auto" (which
    turns float32 checkpoints into float16) never decides what gets stored."""
    if name and name != "auto":
        if name not in _DTYPES:
            raise BadInputError(f"unknown dtype {name!r}; use one of {', '.join(_DTYPES)}")
        return name
    cfg = str(cfg_dtype).replace("torch.", "") if cfg_dtype is not None else ""
    return cfg if cfg in ("bfloat16", "float16") else "bfloat16"
