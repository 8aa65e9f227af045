"""A user's mistake gets one line that says what is wrong and what to do, through the real CLI:
the folder around a dataset named instead of the dataset, a model folder without config.json,
foreign files without the keys their format has, --plot without matplotlib, and a path that
does not exist (one wording whatever the command)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

import hsstore
from hsstore import LayerSpec
from hsstore.cli import main
from hsstore.demo_model import build_tiny_model
from tools.synthetic import random_sample


def run(*args: str):
    return CliRunner().invoke(main, [*map(str, args)])


def _one_line(result) -> str:
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and "Traceback" not in result.output, result.output
    return lines[0]


@pytest.fixture(scope="module")
def around(tmp_path_factory) -> Path:
    """A folder holding a dataset (OUT/dataset, as `hsstore demo OUT` makes) and more."""
    out = tmp_path_factory.mktemp("out")
    ds = hsstore.create(out / "dataset", layers=[LayerSpec(1), LayerSpec(2)], hidden_size=8,
                        dtype=torch.float32)  # fmt: skip
    with ds.writer() as w:
        for i in range(3):
            w.add(f"s{i}", *random_sample(6, 2, 8, seed=i, dtype=torch.float32))
    (out / "prompts.jsonl").write_text('{"text": "hello"}\n')
    (out / "model").mkdir()
    return out


@pytest.mark.parametrize("command", ["inspect", "verify", "repair", "gc"])
def test_the_folder_around_a_dataset_says_where_the_dataset_is(around, command):
    result = run(command, around)
    assert result.exit_code == 2
    line = _one_line(result)
    assert line.startswith(f"error: {around}: not an hsstore dataset")
    assert f"the dataset is at {around / 'dataset'}" in line
    assert run(command, around / "dataset").exit_code == 0


@pytest.mark.parametrize(
    "args",
    [
        ("inspect", "{missing}"),
        ("verify", "{missing}"),
        ("repair", "{missing}"),
        ("gc", "{missing}"),
        ("convert", "{missing}", "{tmp}/out"),
        ("extract", "--model", "{model}", "--data", "{missing}", "--out", "{tmp}/out"),
        ("extract", "--model", "{missing}", "--data", "{prompts}", "--out", "{tmp}/out"),
    ],
    ids=["inspect", "verify", "repair", "gc", "convert", "extract-data", "extract-model"],
)
def test_a_missing_path_has_one_wording_whatever_the_command(around, tmp_path, args):
    missing = tmp_path / "no-such-thing"
    values = {"missing": missing, "tmp": tmp_path, "model": around / "model",
              "prompts": around / "prompts.jsonl"}  # fmt: skip
    result = run(*(a.format(**values) for a in args))
    assert result.exit_code == 2
    assert _one_line(result) == f"error: {missing}: no such file or directory"
    assert not (tmp_path / "out").exists()


def test_a_model_folder_without_config_json_is_named(tmp_path):
    model = build_tiny_model(tmp_path / "model")
    (model / "config.json").unlink()
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"text": "hello there"}) + "\n")
    result = run("extract", "--model", model, "--data", prompts, "--out", tmp_path / "out")
    assert result.exit_code == 2
    assert (
        _one_line(result) == f"error: {model}: no config.json: not a Hugging Face model directory"
    )
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize(
    "layout, keys",
    [
        ("speculators-v1", ["'input_ids'", "'loss_mask'", "'hidden_states'"]),
        ("specforge", ["'hidden_state'", "'aux_hidden_state'"]),
    ],
)
def test_foreign_files_without_their_keys_name_the_missing_keys(tmp_path, layout, keys):
    src = tmp_path / "src"
    src.mkdir()
    name = "data_{i}.pt" if layout == "speculators-v1" else "data_{i}.ckpt"
    for i in range(2):
        obj = {"ids": torch.arange(5), "states": torch.randn(5, 8)}
        if layout == "specforge":
            obj |= {"input_ids": torch.arange(5), "loss_mask": torch.ones(5, dtype=torch.int64)}
        torch.save(obj, src / name.format(i=i))
    result = run("convert", src, tmp_path / "ds", "--from", layout, "--layer-ids", "1",
                 "--num-hidden-layers", "4", "--no-progress")  # fmt: skip
    assert result.exit_code == 2
    line = _one_line(result)
    assert "missing key(s)" in line and str(src / name.format(i=0)) in line
    assert all(key in line for key in keys) and "found ['ids', " in line


def test_plot_without_matplotlib_prints_the_report_and_one_line(around, tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # as if it were not installed
    figure = tmp_path / "fig.png"
    result = run("inspect", around / "dataset", "--plot", figure)
    assert result.exit_code == 2
    assert "verdict: OK" in result.stdout  # the whole report
    line = _one_line(result)
    assert "--plot needs matplotlib" in line and "pip install 'hsstore[plot]'" in line
    assert str(figure) in line and not figure.exists()
