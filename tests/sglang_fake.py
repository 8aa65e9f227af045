"""A stand-in for ``sglang.Engine`` (0.5.23) whose rules come from the real wheel's sources.

SGLang needs a GPU and is not installed here. ``FakeSGLangEngine`` takes the same server
arguments (every name must be a ServerArgs field of the wheel), applies the capture rule of the
model class it is told to be (``architecture``), executed from that class's own
``set_eagle3_layers_to_capture`` in the wheel (:mod:`sglang_wheel`), computes the states with the
tiny HF model, fills a logits-processor output for the whole packed batch the way
``layers/logits_processor.py`` does with aux capture on (packed aux states +
``last_hidden_states``, FULL mode for every forward), runs the ``forward_hooks`` it was given
exactly as ``model_executor/hook_manager.py`` resolves and calls them, with the positional
arguments a model passes its logits processor (``models/llama.py``: input ids, final state, LM
head, ``ForwardBatch``, aux states) and, for hooks on the final norm, with what the fused
``norm(hidden, residual)`` returns (``layers/layer_boundary/residual/access.py``
``final_norm_pair``: the normed state and the updated residual), and answers with ``meta_info`` shaped as
``managers/tokenizer_manager.py`` builds it: hidden states as nested lists only for requests
that asked for them (``batch_result_processor.py`` ``_append_prefill_hidden_states``).

It is importable by module name so spawned extraction workers can unpickle it, and it counts
its constructions and forwards in a file (workers are other processes).
"""

from __future__ import annotations

import fnmatch
import functools
import importlib
import os
import signal
import uuid
from dataclasses import dataclass
from pathlib import Path

import torch
from sglang_wheel import SGLangModels, find_wheel


@functools.lru_cache(maxsize=1)
def wheel_models() -> SGLangModels:
    return SGLangModels(find_wheel())


@functools.lru_cache(maxsize=1)
def server_arg_fields() -> frozenset[str]:
    """Every ServerArgs field of the wheel (``sglang/srt/arg_groups/fields/*.py``)."""
    import ast
    import zipfile

    names = set()
    with zipfile.ZipFile(find_wheel()) as zf:
        for name in zf.namelist():
            if name.startswith("sglang/srt/arg_groups/fields/") and name.endswith(".py"):
                for node in ast.walk(ast.parse(zf.read(name).decode())):
                    if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
                        names.add(node.target.id)
    return frozenset(names)


def capture_rule(architecture: str):
    models = wheel_models()
    refs = [r for r in models.capturing_classes() if r.name == architecture]
    assert refs, f"{architecture} captures no EAGLE-3 aux states in the wheel"
    return models.rule(refs[0])


@dataclass
class LogitsOutput:
    """The two fields of LogitsProcessorOutput the capture path fills."""

    hidden_states: torch.Tensor | None
    last_hidden_states: torch.Tensor | None


class ForwardMode:
    """``model_executor/forward_batch_info.py`` ForwardMode, the one method the hook calls."""

    def __init__(self, extend: bool):
        self.extend = extend

    def is_extend(self) -> bool:
        return self.extend


@dataclass
class ForwardBatch:
    """The ForwardBatch fields hsstore's hook reads (``forward_batch_info.py``)."""

    forward_mode: ForwardMode
    rids: list[str]
    extend_seq_lens_cpu: list[int] | None
    extend_prefix_lens_cpu: list[int] | None


class FakeSGLangEngine:
    def __init__(
        self,
        *,
        architecture: str = "LlamaForCausalLM",
        counts: str | None = None,
        faults: dict | None = None,
        **server_args,
    ):
        from transformers import AutoModelForCausalLM

        unknown = set(server_args) - server_arg_fields()
        assert not unknown, f"not sglang 0.5.23 server args: {unknown}"
        self.args = server_args
        self.faults = faults or {}
        self.counts = counts
        self._count("engine")
        self.model = AutoModelForCausalLM.from_pretrained(
            server_args["model_path"], dtype=torch.float32
        ).eval()
        self.dtype = getattr(torch, server_args.get("dtype", "float32"))
        n = self.model.config.num_hidden_layers
        # arg_groups/validation_hook.py handle_aux_hidden_state_capture
        assert server_args.get("enable_return_aux_hidden_states") is True
        assert server_args.get("speculative_algorithm") == "EAGLE3"
        ids = server_args["return_aux_hidden_state_layer_ids"]
        assert ids and len(set(ids)) == len(ids) and min(ids) >= 0
        # model_runner_components/spec_aux_hidden_state.py _check_capture_layer_ids_in_range
        assert max(ids) < n, f"ids {ids} out of range for {n} layers"
        captured = capture_rule(architecture)(list(ids), n)
        # the model loop only captures layers that exist; logits_processor.py
        # _check_aux_hidden_states fails when fewer than asked were captured
        assert all(0 <= v < n for v in captured), (architecture, ids, captured)
        assert len(set(captured)) == len(ids), (architecture, ids, captured)
        self.capture = sorted(captured)  # the model loop captures in layer order
        if self.faults.get("wrong_layer"):  # a rule hsstore got wrong: one layer too deep
            self.capture = [min(v + 1, n - 1) for v in self.capture]
        self.hooks, self.norm_hooks = [], []
        for spec in server_args.get("forward_hooks") or []:
            on_norm, hook = self._resolve_hook(spec)
            (self.norm_hooks if on_norm else self.hooks).append(hook)
        self.shut = False
        self.forwards = 0

    def _count(self, what: str) -> None:
        if self.counts:
            with open(self.counts, "a") as f:
                f.write(f"{what} {os.getpid()}\n")

    @staticmethod
    def _resolve_hook(spec: dict):
        # model_executor/hook_manager.py: register_forward_hooks + resolve_callable
        def matches(names):
            return any(fnmatch.fnmatch(n, p) for n in names for p in spec["target_modules"])

        # the module names of a Llama-like class and of one that delegates to it
        on_logits = matches(("logits_processor", "language_model.logits_processor"))
        on_norm = matches(("model.norm", "language_model.model.norm"))
        assert on_logits != on_norm, spec["target_modules"]
        module_name, fn_name = spec["hook_factory"].split(":", 1)
        factory = getattr(importlib.import_module(module_name), fn_name)
        return on_norm, factory(spec.get("config") or {})

    def shutdown(self) -> None:
        self.shut = True
        if self.faults.get("kill_on_shutdown"):
            # what closing an engine can do to the process holding it (entrypoints/engine.py
            # kills the children; utils/watchdog.py then SIGQUITs the whole tree)
            os.kill(os.getpid(), signal.SIGKILL)

    @torch.inference_mode()
    def generate(self, *, input_ids, sampling_params, return_hidden_states=False, rid=None):
        assert sampling_params["max_new_tokens"] == 1
        self._count("forward")
        die = self.faults.get("die_once_file")
        # the forwards it completes first (their batches go on to the writer)
        survived = self.forwards >= self.faults.get("die_after_forwards", 0)
        self.forwards += 1
        if die and survived and not Path(die).exists():
            Path(die).write_text("died\n")
            os._exit(17)
        rids = list(rid) if rid is not None else [uuid.uuid4().hex for _ in input_ids]
        assert len(set(rids)) == len(rids) == len(input_ids)  # io_struct.py rid uniqueness
        aux, final, prenorm = [], [], []
        for ids in input_ids:
            a, f, pre = self._states(ids)
            aux.append(a)
            final.append(f)
            prenorm.append(pre)
        # a chunked prefill computes the truncated request's last rows in a second forward
        cut = self.faults.get("truncate_rows")
        chunk = [
            i
            for i, ids in enumerate(input_ids)
            if cut and len(ids) == self.faults.get("truncate_len", len(ids))
        ]
        lens = [len(ids) - (cut if i in chunk else 0) for i, ids in enumerate(input_ids)]
        first = self._forward(
            rids,
            lens,
            [0] * len(rids),
            [a[:n] for a, n in zip(aux, lens)],
            [f[:n] for f, n in zip(final, lens)],
            [p[:n] for p, n in zip(prenorm, lens)],
        )
        if chunk:
            self._forward(
                [rids[i] for i in chunk],
                [cut] * len(chunk),
                [lens[i] for i in chunk],
                [aux[i][lens[i] :] for i in chunk],
                [final[i][lens[i] :] for i in chunk],
                [prenorm[i][lens[i] :] for i in chunk],
            )
        self._forward(
            rids, [1] * len(rids), [len(i) for i in input_ids], None, None, None, decode=True
        )
        offsets = [sum(lens[:i]) for i in range(len(lens))]
        responses = []
        for i, ids in enumerate(input_ids):
            rows = None
            if return_hidden_states:  # the scheduler's list path, for this request only
                rows = first.hidden_states[offsets[i] : offsets[i] + lens[i]]
            responses.append(self._response(rids[i], ids, rows))
        if self.faults.get("drop_response"):
            responses.pop()
        return responses

    def _states(self, ids):
        """(packed aux captures [T, K*H], final state [T, H], final norm's input [T, H]) of one
        prompt."""
        seen = []
        hook = self.model.model.norm.register_forward_pre_hook(lambda _m, a: seen.append(a[0]))
        try:
            out = self.model.model(
                input_ids=torch.tensor([ids]), output_hidden_states=True, use_cache=False
            )
        finally:
            hook.remove()
        hs = out.hidden_states  # hs[i] = residual entering layer i; hs[N] = normed final
        aux = torch.cat([hs[i][0] for i in self.capture], dim=-1)
        final = out.last_hidden_state[0]
        if self.faults.get("prenorm_instead_of_aux"):
            aux = hs[-2][0]  # _get_hidden_states_to_store prefers hidden_states_before_norm
        return aux.to(self.dtype), final.to(self.dtype), seen[0][0].to(self.dtype)

    def _forward(self, rids, lens, prefixes, aux, final, prenorm, decode=False):
        """One packed forward's logits-processor output, with the hooks run on it."""
        if decode:  # the decode step after prefill: nothing packed, FULL mode all the same
            output = LogitsOutput(hidden_states=None, last_hidden_states=None)
            batch = ForwardBatch(ForwardMode(False), rids, None, None)
            normed = updated = torch.zeros(sum(lens), self.model.config.hidden_size)
        else:
            output = LogitsOutput(hidden_states=torch.cat(aux), last_hidden_states=torch.cat(final))
            batch = ForwardBatch(ForwardMode(True), rids, list(lens), list(prefixes))
            normed, updated = output.last_hidden_states, torch.cat(prenorm)
        if not self.faults.get("norm_bypassed"):  # a fused terminal norm calls no module
            for hook in self.norm_hooks:  # the fused norm(hidden, residual) of the last layer
                hook(None, (normed, updated), (normed.clone(), updated.clone()))
        ids = torch.zeros(sum(lens), dtype=torch.int64)
        args = (ids, output.last_hidden_states, None, batch, None)
        for hook in self.hooks:
            hook(None, args, output)
        return output

    def _response(self, rid, ids, rows: torch.Tensor | None) -> dict:
        meta = {
            "id": rid,
            "finish_reason": {"type": "length", "length": 1},
            "prompt_tokens": len(ids),
            "weight_version": "default",
            "num_retractions": 0,
            "reasoning_tokens": 0,
            "completion_tokens": 1,
            "cached_tokens": self.faults.get("cached_tokens", 0),
        }
        if rows is not None:
            meta["hidden_states"] = [rows.float().tolist()]
        return {"output_ids": [0], "meta_info": meta}


def factory(**fake_kwargs):
    """An engine factory that pickles by reference (spawned workers rebuild it)."""
    return functools.partial(FakeSGLangEngine, **fake_kwargs)


def counted(path: Path) -> dict[str, int]:
    """{"engine": constructions, "forward": generate calls} across every process."""
    out = {"engine": 0, "forward": 0}
    if path.exists():
        for line in path.read_text().splitlines():
            out[line.split()[0]] += 1
    return out
