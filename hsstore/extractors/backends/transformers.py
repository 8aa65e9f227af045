"""Hidden states from a Hugging Face ``AutoModelForCausalLM``, batched, on CPU or GPU.

Layer mapping (canonical -> what transformers gives), for a model with N decoder layers:

* depth k < N: ``output_hidden_states[k]`` (0 = embedding output), via the ``hf`` convention of
  :mod:`hsstore.spec.conventions`;
* ``final`` (depth N + final norm): ``output_hidden_states[N]``, which transformers sets to the
  normed ``last_hidden_state``;
* ``final-prenorm`` (depth N, no norm): not in ``output_hidden_states`` at all, so a forward
  pre-hook on the final norm module records its input (the residual after the last layer); if
  a model has no recognisable final norm, the last decoder layer's output is recorded instead.

Only the base model runs (no LM head: its [B, T, vocab] logits would be the largest tensor of
the forward and are not needed). Batches are right-padded with an attention mask; padded
positions are cut off before anything is returned, so no pad row is ever stored.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from hsstore.errors import BadInputError
from hsstore.extractors.chat_tokens import TokenizedPrompt
from hsstore.spec import conventions
from hsstore.spec.layers import LayerSpec

_DTYPES = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
}


def resolve_torch_dtype(name: str | None, default: torch.dtype) -> torch.dtype:
    if name in (None, "auto"):
        return default
    if name not in _DTYPES:
        raise BadInputError(f"unknown dtype {name!r}; use one of {', '.join(_DTYPES)} or auto")
    return _DTYPES[name]


class TransformersBackend:
    """Runs the target model and returns ``[T, L, H]`` hidden states per prompt (on CPU)."""

    name = "transformers"

    def __init__(
        self,
        model_dir: str,
        layers: Sequence[LayerSpec],
        *,
        device: str = "cpu",
        torch_dtype: str | None = "auto",
        attn_implementation: str | None = None,
        trust_remote_code: bool = False,
    ):
        from transformers import AutoConfig, AutoModelForCausalLM
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()  # our own bar is the one that matters

        try:
            config = AutoConfig.from_pretrained(model_dir, trust_remote_code=trust_remote_code)
        except (OSError, ValueError) as exc:
            raise BadInputError(f"cannot load a model config: {exc}", path=model_dir) from exc
        cfg_dtype = getattr(config, "dtype", None) or getattr(config, "torch_dtype", None)
        if isinstance(cfg_dtype, str):
            cfg_dtype = _DTYPES.get(cfg_dtype)
        dtype = resolve_torch_dtype(torch_dtype, cfg_dtype or torch.float32)
        kwargs: dict[str, Any] = {_dtype_keyword(): dtype, "trust_remote_code": trust_remote_code}
        if attn_implementation:
            kwargs["attn_implementation"] = attn_implementation
        try:
            model = AutoModelForCausalLM.from_pretrained(model_dir, **kwargs)
        except (OSError, ValueError) as exc:
            raise BadInputError(f"cannot load the model: {exc}", path=model_dir) from exc
        self.model = model.to(device).eval()
        self.device = torch.device(device)
        self.dtype = dtype
        self.base = self.model.base_model
        self.num_hidden_layers = int(config.num_hidden_layers)
        self.hidden_size = int(config.hidden_size)
        self.vocab_size = int(config.vocab_size)
        self.pad_token_id = _pad_id(config)
        self.layers = list(layers)
        self._plan = self._plan_layers(self.layers)
        self._prenorm: list[torch.Tensor] = []
        self._select = self._hidden_state_request()
        self._hook = None
        if any(kind == "prenorm" for kind, _ in self._plan):
            self._hook = self._install_prenorm_hook()

    def _plan_layers(self, layers: Sequence[LayerSpec]) -> list[tuple[str, int]]:
        """For each stored layer: ("hf", index into hidden_states) or ("prenorm", 0)."""
        n = self.num_hidden_layers
        plan: list[tuple[str, int]] = []
        for spec in layers:
            if spec.depth == n and not spec.final_norm:
                plan.append(("prenorm", 0))
                continue
            try:
                (hf_id,) = conventions.from_canonical(conventions.HF, [spec], n)
            except conventions.ConventionError as exc:
                raise BadInputError(f"layer {spec.label}: {exc}") from exc
            plan.append(("hf", hf_id))
        return plan

    def _hidden_state_request(self) -> bool | list[int]:
        """What to pass as ``output_hidden_states``: the indices wanted where this transformers
        release returns exactly those (same positions, ``None`` elsewhere), else ``True``.

        On a large model keeping only the wanted states saves most of the N + 1 [B, T, H]
        activations, but releases differ in what the list form returns: some ignore it and give
        all N + 1, some give N entries shifted by one and no final state, some the N + 1 asked
        for. So a short probe decides: the list is used only if its wanted entries equal, bit for
        bit, those of the all-states forward on the same tokens.
        """
        wanted = sorted({index for kind, index in self._plan if kind == "hf"})
        if not wanted or _release() < (5, 0):  # before 5, output_hidden_states is a bool only
            return True
        ids = (torch.arange(_PROBE_TOKENS) % self.vocab_size)[None].to(self.device)
        with torch.inference_mode():
            every = self._hidden_states(ids, torch.ones_like(ids), True)
            some = self._hidden_states(ids, torch.ones_like(ids), wanted)
        self._prenorm.clear()
        if len(some) == len(every) and all(
            some[i] is not None and torch.equal(some[i], every[i]) for i in wanted
        ):
            return wanted
        return True

    def _hidden_states(self, ids: torch.Tensor, mask: torch.Tensor, select: bool | list[int]):
        return self.base(
            input_ids=ids,
            attention_mask=mask,
            output_hidden_states=select,
            use_cache=False,
            return_dict=True,
        ).hidden_states

    def _install_prenorm_hook(self):
        norm = getattr(self.base, "norm", None)
        if isinstance(norm, torch.nn.Module):

            def pre_hook(_module, args):
                self._prenorm.append(args[0])

            return norm.register_forward_pre_hook(pre_hook)
        layers = getattr(self.base, "layers", None)
        if layers is None or len(layers) != self.num_hidden_layers:
            raise BadInputError(
                "final-prenorm needs a model whose base model has a 'norm' or 'layers' module; "
                f"{type(self.model).__name__} has neither"
            )

        def hook(_module, _args, output):
            self._prenorm.append(output[0] if isinstance(output, tuple) else output)

        return layers[-1].register_forward_hook(hook)

    def close(self) -> None:
        if self._hook is not None:
            self._hook.remove()
            self._hook = None

    @torch.inference_mode()
    def run(self, batch: Sequence[TokenizedPrompt]) -> list[torch.Tensor]:
        """One padded forward over ``batch``; returns ``[T_i, L, H]`` CPU tensors, model dtype."""
        if not batch:
            return []
        lengths = [p.num_tokens for p in batch]
        t_max = max(lengths)
        ids = torch.full((len(batch), t_max), self.pad_token_id, dtype=torch.int64)
        mask = torch.zeros((len(batch), t_max), dtype=torch.int64)
        for row, p in enumerate(batch):
            ids[row, : lengths[row]] = p.input_ids
            mask[row, : lengths[row]] = 1
        self._prenorm.clear()
        hs = self._hidden_states(ids.to(self.device), mask.to(self.device), self._select)
        if len(hs) != self.num_hidden_layers + 1:
            raise BadInputError(
                f"model returned {len(hs)} hidden states, expected num_hidden_layers + 1 = "
                f"{self.num_hidden_layers + 1}; its layer semantics are unknown"
            )
        missing = [i for kind, i in self._plan if kind == "hf" and hs[i] is None]
        if missing:
            raise BadInputError(f"model returned no hidden state at index {missing[0]}")
        picked = []
        for kind, index in self._plan:
            if kind == "prenorm":
                if len(self._prenorm) != 1:
                    raise RuntimeError(f"final-prenorm hook fired {len(self._prenorm)} times")
                picked.append(self._prenorm[0])
            else:
                picked.append(hs[index])
        stacked = torch.stack(picked, dim=2)  # [B, T, L, H]
        self._prenorm.clear()
        host = stacked.to("cpu", non_blocking=False)
        return [host[row, : lengths[row]].clone() for row in range(len(batch))]


# Tokens of the probe forward that checks the list form of output_hidden_states: enough for
# attention to mix positions, small enough to cost nothing next to a real batch.
_PROBE_TOKENS = 8


def _release() -> tuple[int, int]:
    import transformers

    major, minor = transformers.__version__.split(".")[:2]
    return int(major), int(minor)


def _dtype_keyword() -> str:
    """from_pretrained's name for the weights' dtype: ``dtype`` from 4.56 on; older releases hand
    an unknown ``dtype`` to the model's ``__init__``, which refuses it."""
    return "dtype" if _release() >= (4, 56) else "torch_dtype"


def _pad_id(config: Any) -> int:
    """Any valid token id works (padded positions are masked and cut); prefer the real pad."""
    for attr in ("pad_token_id", "eos_token_id", "bos_token_id"):
        value = getattr(config, attr, None)
        if isinstance(value, list):
            value = value[0] if value else None
        if isinstance(value, int) and value >= 0:
            return value
    return 0
