"""Damage stays where it happened: a version whose segment is missing or damaged still opens,
every other sample reads, the damaged ones raise naming their ids, verify lists them, `repair`
publishes a version without them (recording what was dropped and why), and rerunning the
convert that wrote them fills them in. On a local disk and on S3 (the real server)."""

from __future__ import annotations

import pytest
import torch
from click.testing import CliRunner

import hsstore
from hsstore import LayerSpec
from hsstore.cli import main
from hsstore.interop.convert import convert_to_hsstore
from hsstore.spec import paths
from hsstore.storage.locations import open_storage
from tools.convert_fixtures import write_v1_dir
from tools.synthetic import random_sample

H = 16
LAYERS = [LayerSpec(1), LayerSpec(2)]


@pytest.fixture(params=["local", "s3"])
def location(request, tmp_path):
    if request.param == "local":
        return str(tmp_path / "ds")
    return request.getfixturevalue("s3_url")


def _build(location) -> hsstore.Dataset:
    ds = hsstore.create(location, layers=LAYERS, hidden_size=H, dtype=torch.bfloat16,
                        chunk_bytes=1024, shard_bytes=4096)  # fmt: skip
    for c in range(3):
        with ds.writer(encode_threads=1) as w:
            for i in range(4):
                w.add(f"c{c}-s{i}", *random_sample(20 + i, len(LAYERS), H, seed=10 * c + i))
    return hsstore.open(location)


def _bits(sample: hsstore.Sample) -> bytes:
    return sample.hidden.view(torch.int16).numpy().tobytes()


def test_a_missing_segment_stays_in_its_samples_until_repaired(location):
    ds = _build(location)
    truth = {s.sample_id: _bits(s) for s in ds}
    storage = open_storage(location)
    gone = ds.manifest.segments[1]
    storage.delete_tree(paths.segment_dir(gone.id))
    lost = {f"c1-s{i}" for i in range(4)}

    opened = hsstore.open(location)
    assert set(opened.sample_ids) == set(truth) - lost
    assert gone.id in opened.unreadable and "missing" in opened.unreadable[gone.id]
    for s in opened:  # every other sample reads, bit-exact
        assert _bits(s) == truth[s.sample_id]
    report = hsstore.verify(location)
    assert not report.ok and gone.id in report.unreadable_segments
    result = CliRunner().invoke(main, ["verify", location])
    assert result.exit_code == 1 and f"UNREADABLE segment {gone.id}" in result.output

    fixed = hsstore.repair(location)
    dropped = [r for r in fixed.repairs if r["action"] == "dropped"]
    assert [(r["segment"], r["num_samples"]) for r in dropped] == [(gone.id, 4)]
    assert "missing" in dropped[0]["reason"]
    after = hsstore.open(location)
    assert after.manifest.provenance["repairs"] == fixed.repairs
    assert not after.unreadable and set(after.sample_ids) == set(truth) - lost
    assert hsstore.verify(location).ok
    with after.writer(encode_threads=1) as w:  # the lost ids can be written again
        for sid in sorted(lost):
            w.add(sid, *random_sample(20 + int(sid[-1]), len(LAYERS), H, seed=10 + int(sid[-1])))
    again = hsstore.open(location)
    assert {s.sample_id: _bits(s) for s in again} == truth


def test_a_damaged_shard_costs_only_its_samples(location):
    ds = _build(location)
    truth = {s.sample_id: _bits(s) for s in ds}
    storage = open_storage(location)
    seg = ds.manifest.segments[2]
    key = paths.segment_file(seg.id, paths.shard_relpath(0))
    data = bytearray(storage.read_bytes(key))
    data[40] ^= 0xFF  # inside the first chunk: one sample's rows
    storage.delete(key)
    storage.put(key, bytes(data))

    opened = hsstore.open(location)
    assert len(opened) == len(truth)
    bad = []
    for i, sid in enumerate(opened.sample_ids):
        try:
            assert _bits(opened.read(i)) == truth[sid]
        except hsstore.IntegrityError as exc:
            assert exc.sample_id == sid
            bad.append(sid)
    assert bad and all(sid.startswith("c2-") for sid in bad) and len(bad) < 4
    report = hsstore.verify(location)
    assert set(report.bad_samples) == set(bad)

    result = CliRunner().invoke(main, ["repair", location])
    assert result.exit_code == 0, result.output
    assert "dropped segment" in result.output
    after = hsstore.open(location)
    repairs = after.manifest.provenance["repairs"]
    assert [r["action"] for r in repairs] == ["dropped"] and repairs[0]["segment"] == seg.id
    assert sorted(repairs[0]["sample_ids"]) == sorted(bad)
    assert set(after.sample_ids) == set(truth) - set(bad)  # the rest of the segment kept
    for s in after:
        assert _bits(s) == truth[s.sample_id]
    assert hsstore.verify(location).ok
    assert hsstore.repair(location).version is None  # nothing left to repair


def test_rerunning_the_convert_fills_in_what_repair_dropped(tmp_path):
    src, dst, clean = tmp_path / "v1", tmp_path / "ds", tmp_path / "clean"
    write_v1_dir(src, [3, 9, 1, 40, 7, 12], layer_ids=[1, 3], hidden_size=8)
    convert_to_hsstore(src, dst, commit_every=2, progress=False)
    convert_to_hsstore(src, clean, progress=False)
    ds = hsstore.open(dst)
    storage = open_storage(dst)
    for name in (paths.INDEX, paths.INDEX_COPY):  # the index and its copy: the ids are lost
        storage.delete(paths.segment_file(ds.manifest.segments[1].id, name))
    assert len(hsstore.open(dst)) == 4
    hsstore.repair(dst)
    assert len(hsstore.open(dst)) == 4 and hsstore.verify(dst).ok
    convert_to_hsstore(src, dst, commit_every=2, progress=False)
    a, b = hsstore.open(dst), hsstore.open(clean)
    assert sorted(a.sample_ids) == sorted(b.sample_ids)
    for sid in b.sample_ids:
        x, y = a.get(sid), b.get(sid)
        assert torch.equal(x.hidden.view(torch.int16), y.hidden.view(torch.int16))
        assert torch.equal(x.input_ids, y.input_ids) and torch.equal(x.loss_mask, y.loss_mask)
    hsstore.gc(dst, grace_s=0)  # the dropped segment's files go; the data stays
    assert not storage.exists(paths.segment_dir(ds.manifest.segments[1].id) + "/zarr.json")
    assert hsstore.verify(dst).ok
