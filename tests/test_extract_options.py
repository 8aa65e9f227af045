"""The extraction options are defined once: the CLI is generated from them, and every worker
receives them unchanged beside its own slice of the work."""

from __future__ import annotations

import dataclasses
import os
import pickle
import pydoc

import pytest

from hsstore.cli.extract import command
from hsstore.extractors.options import ExtractOptions, cli_fields
from hsstore.extractors.runner import worker_specs
from hsstore.spec.layers import LayerSpec

# Command-line options that are not fields: they fill backend_options, or shape the output.
CLI_ONLY = {"tp_size", "mem_fraction", "as_json"}


def test_every_field_is_one_click_option_with_its_default_and_help():
    params = {p.name: p for p in command.params}
    declared = cli_fields()
    assert declared and {name for name, _, _ in declared} | CLI_ONLY == set(params)
    for name, default, flag in declared:
        param = params[name]
        assert param.help == flag.help, name
        assert param.required == (default is ...), name
        if default is not ...:
            assert param.default == default, name
        assert param.opts[0] == flag.flag.split("/")[0], name


def test_options_are_frozen_and_their_help_is_in_help():
    opts = ExtractOptions(model="m", data="d", out="o")
    with pytest.raises(dataclasses.FrozenInstanceError):
        opts.batch_size = 3  # type: ignore[misc]
    text = " ".join(pydoc.render_doc(ExtractOptions).split())
    for name, _, flag in cli_fields():
        assert f"{name} ({flag.flag}): {' '.join(flag.help.split())}" in text


def test_each_worker_gets_the_options_unchanged_and_its_slice():
    opts = ExtractOptions(model="m", data="d", out="o", workers=3, batch_size=5)
    layers = [LayerSpec(2), LayerSpec(8, final_norm=True)]
    specs = worker_specs(opts, layers, 1, 2, device="cpu", dtype="bfloat16")
    assert [s.rank for s in specs] == [3, 4, 5] and {s.world for s in specs} == {6}
    for spec in specs:
        assert spec.options is opts
        assert spec.layers == tuple(layers)
        assert (spec.device, spec.dtype) == ("cpu", "bfloat16")
        assert pickle.loads(pickle.dumps(spec)) == spec  # what a spawned worker receives


def test_workers_take_omp_num_threads_where_set_else_share_the_cores(monkeypatch):
    opts = ExtractOptions(model="m", data="d", out="o", workers=2)
    layers = [LayerSpec(2)]
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    specs = worker_specs(opts, layers, 0, 1, device="cpu", dtype="bfloat16")
    assert [(s.torch_threads, s.encode_threads) for s in specs] == [(3, 3), (3, 3)]
    monkeypatch.delenv("OMP_NUM_THREADS")
    shared = max(1, len(os.sched_getaffinity(0)) // 2)
    specs = worker_specs(opts, layers, 0, 1, device="cpu", dtype="bfloat16")
    assert {s.torch_threads for s in specs} == {shared}
    monkeypatch.setenv("OMP_NUM_THREADS", "none")  # not a count: ignored
    specs = worker_specs(opts, layers, 0, 1, device="cpu", dtype="bfloat16")
    assert {s.torch_threads for s in specs} == {shared}
    specs = worker_specs(opts, layers, 0, 1, device="cuda", dtype="bfloat16")
    assert {s.torch_threads for s in specs} == {None}  # a GPU worker leaves torch's own count
