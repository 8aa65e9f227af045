"""`hsstore gc` through the command line."""

from __future__ import annotations

import json
import os

import torch
from click.testing import CliRunner

import hsstore
from hsstore import LayerSpec
from hsstore.cli import main
from tools.synthetic import random_sample


def test_gc_cli_removes_only_debris(tmp_path):
    path = tmp_path / "ds"
    ds = hsstore.create(path, layers=[LayerSpec(1)], hidden_size=16, dtype=torch.bfloat16)
    with ds.writer() as w:
        w.add("a", *random_sample(8, 1, 16))
    committed = {s.id for s in hsstore.open(path).manifest.segments}
    debris = path / "segments" / ("f" * 32)
    (debris / "states").mkdir(parents=True)
    (debris / "states" / "junk").write_bytes(b"x" * 100)
    # old and lease-less: debris of a writer that died long ago
    os.utime(debris / "states" / "junk", (0, 0))
    result = CliRunner().invoke(main, ["gc", str(path), "--json"])
    assert result.exit_code == 0, result.output
    report = json.loads(result.output)
    assert report["removed_segments"] == ["f" * 32]
    assert set(os.listdir(path / "segments")) == committed | {"zarr.json"}
    assert hsstore.open(path).get("a").num_tokens == 8


def test_gc_cli_on_a_non_dataset_is_one_line(tmp_path):
    (tmp_path / "plain").mkdir()
    result = CliRunner().invoke(main, ["gc", str(tmp_path / "plain")])
    assert result.exit_code == 2
    assert "not an hsstore dataset" in result.output and "Traceback" not in result.output
