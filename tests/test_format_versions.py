"""Format versions: format 4 added the commit protocol's delta members; a format 3 dataset is
read and extended (its new deltas are format 4), a format 3 delta carrying a format 4 member
is refused, and a file of a newer format is refused in one line naming it and both versions."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

import hsstore
from hsstore import LayerSpec
from hsstore.cli import main
from hsstore.spec.manifest import FORMAT_VERSION
from hsstore.spec.sealing import seal_document
from tools.synthetic import random_sample

H = 16
# What format 4 deltas may carry and format 3 deltas never did.
FORMAT_4_MEMBERS = ("add_runs", "commit", "condemn", "prev", "remove_segments", "add_repairs")


def _sample(i: int):
    return random_sample(5 + i, 2, H, seed=i)


def _build(path: Path, commits: int) -> None:
    ds = hsstore.create(path, layers=[LayerSpec(1), LayerSpec(2)], hidden_size=H,
                        dtype=torch.bfloat16, chunk_bytes=1024, shard_bytes=4096)  # fmt: skip
    for i in range(commits):
        with ds.writer(encode_threads=1) as w:
            w.add(f"s{i}", *_sample(i))


def _as_format_3(path: Path) -> None:
    """Rewrite every version file as format 3 wrote it: no format 4 member, no hint tag."""
    for f in sorted((path / "manifests").glob("v*.json")):
        obj = json.loads(f.read_bytes())
        obj["format_version"] = 3
        for key in FORMAT_4_MEMBERS:
            obj.pop(key, None)
        f.write_bytes(seal_document(obj))
    (path / "manifests" / "_latest").write_text(f"{len(list(path.glob('manifests/v*')))}\n")


def test_the_format_version_was_bumped_for_the_commit_protocol():
    assert FORMAT_VERSION == 4


def test_a_format_3_dataset_is_read_and_extended_with_format_4_deltas(tmp_path):
    path = tmp_path / "ds"
    _build(path, 3)
    _as_format_3(path)
    ds = hsstore.open(path)
    assert ds.sample_ids == ["s0", "s1", "s2"]
    assert hsstore.verify(path, full=True).ok
    with ds.writer(encode_threads=1) as w:
        w.add("s3", *_sample(3))
    newest = json.loads((path / "manifests" / "v00000005.json").read_bytes())
    assert newest["format_version"] == FORMAT_VERSION and "commit" in newest
    ds = hsstore.open(path)
    assert ds.sample_ids == ["s0", "s1", "s2", "s3"]
    for i in range(4):
        assert torch.equal(ds.get(f"s{i}").hidden, _sample(i)[2])
    assert hsstore.verify(path, full=True).ok


@pytest.mark.parametrize("member", ["commit", "prev"])
def test_a_format_3_delta_with_a_format_4_member_is_refused(tmp_path, member):
    path = tmp_path / "ds"
    _build(path, 2)
    f = path / "manifests" / "v00000003.json"
    obj = json.loads(f.read_bytes())
    assert member in obj
    obj = {k: v for k, v in obj.items() if k == member or k not in FORMAT_4_MEMBERS}
    obj["format_version"] = 3
    f.write_bytes(seal_document(obj))
    with pytest.raises(hsstore.SchemaError, match=f"schema violation at {member}:"):
        hsstore.open(path)


@pytest.mark.parametrize("name", ["v00000001.json", "v00000003.json"])
def test_a_newer_format_is_refused_in_one_line_naming_the_file_and_versions(tmp_path, name):
    path = tmp_path / "ds"
    _build(path, 2)
    f = path / "manifests" / name
    obj = json.loads(f.read_bytes())
    obj["format_version"] = FORMAT_VERSION + 1
    obj["a_member_of_the_future"] = True
    f.write_bytes(seal_document(obj))
    want = (
        f"written by format version {FORMAT_VERSION + 1}; this hsstore reads up to {FORMAT_VERSION}"
    )
    with pytest.raises(hsstore.UnsupportedVersionError, match=want) as info:
        hsstore.open(path)
    assert name in str(info.value)
    for args in (["inspect", str(path)], ["verify", str(path)]):
        result = CliRunner().invoke(main, args)
        assert result.exit_code != 0, result.output
        lines = [line for line in result.output.splitlines() if want in line]
        assert len(lines) == 1 and name in lines[0], result.output
        assert "Traceback" not in result.output
