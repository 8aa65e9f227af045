"""Format versions: format 4 added the commit protocol's delta members, format 5 group commit's
(``group``, ``sample_digest``); a format 3 or 4 dataset is read and extended (its new deltas
are format 5), an older delta carrying a newer member is refused, and a file of a newer format
is refused in one line naming it and both versions."""

from __future__ import annotations

import base64
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
# What format 5 deltas may carry and format 4 deltas never did.
FORMAT_5_MEMBERS = ("group", "sample_digest")


def _sample(i: int):
    return random_sample(5 + i, 2, H, seed=i)


def _build(path: Path, commits: int) -> None:
    ds = hsstore.create(path, layers=[LayerSpec(1), LayerSpec(2)], hidden_size=H,
                        dtype=torch.bfloat16, chunk_bytes=1024, shard_bytes=4096)  # fmt: skip
    for i in range(commits):
        with ds.writer(encode_threads=1) as w:
            w.add(f"s{i}", *_sample(i))


def _as_format(path: Path, version: int) -> None:
    """Rewrite every version file as format 3 or 4 wrote it (no newer member; format 3: no
    hint tag, and no hash chain to keep)."""
    newer = FORMAT_5_MEMBERS + (FORMAT_4_MEMBERS if version < 4 else ())
    prev = None
    for f in sorted((path / "manifests").glob("v*.json")):
        obj = json.loads(f.read_bytes())
        obj["format_version"] = version
        for key in newer:
            obj.pop(key, None)
        if "prev" in obj:
            obj["prev"] = prev
        f.write_bytes(seal_document(obj))
        prev = json.loads(f.read_bytes())["checksum"]
    (path / "manifests" / "_latest").write_text(f"{len(list(path.glob('manifests/v*')))}\n")


def test_the_format_version_was_bumped_for_group_commit():
    assert FORMAT_VERSION == 5


@pytest.mark.parametrize("older", [3, 4])
def test_an_older_dataset_is_read_and_extended_with_current_deltas(tmp_path, older):
    path = tmp_path / "ds"
    _build(path, 3)
    _as_format(path, older)
    ds = hsstore.open(path)
    assert ds.sample_ids == ["s0", "s1", "s2"]
    assert hsstore.verify(path, full=True).ok
    with ds.writer(encode_threads=1) as w:
        w.add("s3", *_sample(3))
    newest = json.loads((path / "manifests" / "v00000005.json").read_bytes())
    assert newest["format_version"] == FORMAT_VERSION
    assert "commit" in newest and "sample_digest" in newest
    ds = hsstore.open(path)
    assert ds.sample_ids == ["s0", "s1", "s2", "s3"]
    for i in range(4):
        assert torch.equal(ds.get(f"s{i}").hidden, _sample(i)[2])
    assert hsstore.verify(path, full=True).ok


def test_a_version_without_a_sample_digest_is_checked_by_its_index(tmp_path):
    """A writer checks its ids against a format 4 version (no digest) by reading the added
    segment's index, and refuses a duplicate as it does against a digest."""
    path = tmp_path / "ds"
    _build(path, 1)
    late = hsstore.open(path).writer(encode_threads=1)
    with hsstore.open(path).writer(encode_threads=1) as w:
        w.add("dup", *_sample(5))
    f = path / "manifests" / "v00000003.json"  # as a format 4 writer wrote it
    obj = {k: v for k, v in json.loads(f.read_bytes()).items() if k not in FORMAT_5_MEMBERS}
    f.write_bytes(seal_document({**obj, "format_version": 4}))
    (path / "manifests" / "_latest").write_text("3\n")
    late.add("dup", *_sample(6))
    with pytest.raises(hsstore.DuplicateSampleError, match="committed by another writer"):
        late.commit()
    late.close()
    assert hsstore.open(path).sample_ids == ["s0", "dup"]


@pytest.mark.parametrize("member", FORMAT_5_MEMBERS)
def test_a_format_4_delta_with_a_format_5_member_is_refused(tmp_path, member):
    path = tmp_path / "ds"
    _build(path, 2)
    f = path / "manifests" / "v00000003.json"
    obj = json.loads(f.read_bytes())
    obj["format_version"] = 4
    obj.setdefault("group", [f"{'a' * 32}.1"])
    obj = {k: v for k, v in obj.items() if k == member or k not in FORMAT_5_MEMBERS}
    f.write_bytes(seal_document(obj))
    with pytest.raises(hsstore.SchemaError, match=f"schema violation at {member}:"):
        hsstore.open(path)


def test_a_sample_digest_of_the_wrong_length_is_refused_naming_the_file(tmp_path):
    path = tmp_path / "ds"
    _build(path, 2)
    f = path / "manifests" / "v00000003.json"
    obj = json.loads(f.read_bytes())
    one = base64.b64decode(obj["sample_digest"])  # the hash of its one sample id
    obj["sample_digest"] = base64.b64encode(one * 2).decode()
    f.write_bytes(seal_document(obj))
    with pytest.raises(hsstore.FormatError, match="sample_digest holds 2 hashes for 1") as info:
        hsstore.open(path)
    assert "v00000003.json" in str(info.value)


@pytest.mark.parametrize("member", ["commit", "prev"])
def test_a_format_3_delta_with_a_format_4_member_is_refused(tmp_path, member):
    path = tmp_path / "ds"
    _build(path, 2)
    f = path / "manifests" / "v00000003.json"
    obj = json.loads(f.read_bytes())
    assert member in obj
    obj = {
        k: v for k, v in obj.items() if k == member or k not in FORMAT_4_MEMBERS + FORMAT_5_MEMBERS
    }
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
