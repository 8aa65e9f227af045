"""`hsstore verify`: exit 0 on a clean dataset, 1 naming the bad samples on corruption, 2 on
usage errors, with a one-line message and no traceback."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

import hsstore
from hsstore import LayerSpec
from hsstore.cli import main
from tools.synthetic import random_sample

LENGTHS = [40, 90, 7, 200, 33]


def _build(path: Path) -> Path:
    ds = hsstore.create(path, layers=[LayerSpec(1), LayerSpec(3)], hidden_size=32,
                        dtype=torch.bfloat16, chunk_bytes=2048, shard_bytes=16384)  # fmt: skip
    with ds.writer() as w:
        for i, t in enumerate(LENGTHS):
            w.add(f"s{i}", *random_sample(t, 2, 32, seed=i))
    return path


def _first_shard(path: Path) -> Path:
    ds = hsstore.open(path)
    seg = ds.manifest.segments[0].id
    return next((path / "segments" / seg / "states" / "c").glob("0/0/0"))


def _flip(file: Path, offset: int) -> None:
    file.chmod(0o644)
    data = bytearray(file.read_bytes())
    data[offset] ^= 0x40
    file.write_bytes(bytes(data))


def verify(*args: str):
    return CliRunner().invoke(main, ["verify", *args])


def test_clean_dataset_exits_0(tmp_path):
    res = verify(str(_build(tmp_path / "ds")))
    assert res.exit_code == 0, res.output
    assert "verdict: OK" in res.stdout
    assert "GB/s" in res.stdout


def test_clean_dataset_json(tmp_path):
    res = verify(str(_build(tmp_path / "ds")), "--json")
    assert res.exit_code == 0
    doc = json.loads(res.stdout)
    assert doc["schema"] == "hsstore.verify/1"
    assert doc["ok"] is True and doc["problems"] == []
    assert doc["samples_checked"] == len(LENGTHS)
    assert doc["bytes_read"] > 0


def test_flipped_byte_exits_1_and_names_the_sample(tmp_path):
    path = _build(tmp_path / "ds")
    _flip(_first_shard(path), 5)  # first chunk of the first shard: s0's first rows
    res = verify(str(path), "--json")
    assert res.exit_code == 1
    doc = json.loads(res.stdout)
    assert doc["ok"] is False
    assert "s0" in doc["bad_samples"]
    text = verify(str(path))
    assert text.exit_code == 1
    assert "s0" in text.stdout and "CORRUPT" in text.stdout


def test_truncated_shard_exits_1(tmp_path):
    path = _build(tmp_path / "ds")
    shard = _first_shard(path)
    shard.chmod(0o644)
    shard.write_bytes(shard.read_bytes()[:-100])
    res = verify(str(path))
    assert res.exit_code == 1
    assert "truncated" in res.stdout


def test_missing_committed_file_exits_1(tmp_path):
    path = _build(tmp_path / "ds")
    _first_shard(path).unlink()
    res = verify(str(path), "--json")
    assert res.exit_code == 1
    assert any("missing" in p["reason"] for p in json.loads(res.stdout)["problems"])


@pytest.mark.parametrize("make", ["missing", "empty_dir", "file"])
def test_usage_errors_exit_2_with_one_line(tmp_path, make):
    target = tmp_path / "x"
    if make == "empty_dir":
        target.mkdir()
    elif make == "file":
        target.write_text("hello")
    res = verify(str(target))
    assert res.exit_code == 2
    assert res.stdout == ""
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error:") and str(target) in lines[0]
    assert "Traceback" not in res.output
