"""The premises of the vllm backend, read from the installed vllm 0.32.0 (no engine started).

The capture relies on vLLM's aux id meaning "the residual stream after that many decoder
layers" in every model built on ``EagleModelMixin``, on the engine arguments hsstore passes,
and on the runner lines the hook reads; each is checked here against the sources it cites.
"""

from __future__ import annotations

import ast
import dataclasses
import re
from pathlib import Path

import pytest
import vllm
from vllm import EngineArgs

from hsstore.extractors.backends.vllm.backend import engine_kwargs

ROOT = Path(vllm.__file__).resolve().parent
MODELS = ROOT / "model_executor" / "models"
# (file, line, text the line holds) for what hsstore's docs and comments cite
CITED = [
    ("model_executor/models/interfaces.py", 1601, "def _maybe_add_hidden_state("),
    ("model_executor/models/interfaces.py", 1609, "hidden_states + residual if residual"),
    ("model_executor/models/interfaces.py", 1689, "def set_aux_hidden_state_layers("),
    (
        "model_executor/models/llama.py",
        452,
        "hidden_states, _ = self.norm(hidden_states, residual)",
    ),
    ("model_executor/models/llama.py", 456, "return hidden_states, aux_hidden_states"),
    ("v1/worker/worker_base.py", 296, "if parallel_config.worker_extension_cls:"),
    ("v1/worker/gpu_model_runner.py", 2030, "self.query_start_loc.np[1 : num_reqs + 1]"),
    (
        "v1/worker/gpu_model_runner.py",
        1954,
        "self.input_batch.num_computed_tokens_cpu[req_indices]",
    ),
    ("v1/worker/gpu_model_runner.py", 3645, "return self.model("),
    ("v1/engine/input_processor.py", 371, 'request.request_id = f"{request.external_req_id}-'),
    ("platforms/cpu.py", 341, 'parallel_config.distributed_executor_backend = "mp"'),
    ("config/scheduler.py", 316, "self.max_num_batched_tokens < max_model_len"),
    ("v1/utils.py", 616, "timeout = 5.0"),
    ("v1/executor/multiproc_executor.py", 484, "timeout=envs.VLLM_WORKER_SHUTDOWN_TIMEOUT_SECONDS"),
    ("v1/engine/core_client.py", 766, "def shutdown(self, timeout: float | None = None)"),
    ("utils/ompmultiprocessing.py", 217, "len(allowed_numa_nodes) >= local_world_size"),
]


def test_vllm_is_the_release_the_backend_was_checked_against():
    assert vllm.__version__ == "0.32.0"


@pytest.mark.parametrize(("path", "line", "text"), CITED)
def test_cited_lines_say_what_the_docs_say(path, line, text):
    assert text in (ROOT / path).read_text().splitlines()[line - 1]


def test_engine_arguments_are_fields_of_engine_args():
    names = {f.name for f in dataclasses.fields(EngineArgs)}
    kwargs = engine_kwargs("m", dtype="float32", max_tokens=64, kv_cache_bytes=1 << 26)
    assert set(kwargs) <= names, set(kwargs) - names


def _capture_points(tree: ast.AST) -> list[str]:
    """How each ``_maybe_add_hidden_state`` call of a model file names its layer id."""
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and getattr(node.func, "attr", "") == (
            "_maybe_add_hidden_state"
        ):
            arg = node.args[1]
            first = (isinstance(arg, ast.Constant) and arg.value == 0) or (
                isinstance(arg, ast.Attribute) and arg.attr == "start_layer"
            )
            if first:
                out.append("before")
            # "idx + 1"; moss_audio.py writes "layer_idx - self.start_layer + 1", the same
            # without pipeline parallelism (start_layer 0), which hsstore never asks for
            elif re.fullmatch(r"\w+( - self\.start_layer)? \+ 1", ast.unparse(arg)):
                out.append("after")
            else:
                out.append(ast.unparse(arg))
    return out


def test_every_mixin_model_captures_id_k_after_k_layers():
    """Each model calls the mixin's capture with its first layer index before the loop and
    ``index + 1`` after each layer, and nothing else: id k is the stream after k layers."""
    files = {}
    for path in sorted(MODELS.glob("*.py")):
        if path.name == "interfaces.py":
            continue
        points = _capture_points(ast.parse(path.read_text()))
        if points:
            files[path.name] = points
    assert {"llama.py", "qwen2.py", "qwen3_moe.py"} <= set(files)
    for name, points in files.items():
        assert sorted(set(points)) == ["after", "before"], (name, points)
