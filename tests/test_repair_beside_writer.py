"""A repair beside live writers is an ordinary commit: it neither lets a writer skip its
duplicate-id check nor loses a writer's commit, and a writer's fresh commit mark is not taken
for a lost version. Interleaved at exact storage calls by `tests.faults.FaultyStorage` around
the real local backend."""

from __future__ import annotations

import pytest
import torch

import hsstore
from hsstore import LayerSpec
from hsstore.errors import DuplicateSampleError
from hsstore.spec import paths
from hsstore.storage.locations import open_storage
from tests.faults import stopped_at
from tools.synthetic import random_sample

H = 16
LAYERS = [LayerSpec(1), LayerSpec(2)]


def _sample(name: str):
    return random_sample(5 + len(name) % 4, len(LAYERS), H, seed=sum(map(ord, name)))


def _build(location: str, commits: int) -> hsstore.Dataset:
    ds = hsstore.create(location, layers=LAYERS, hidden_size=H, dtype=torch.bfloat16,
                        chunk_bytes=1024, shard_bytes=4096)  # fmt: skip
    for c in range(commits):
        with ds.writer(encode_threads=1) as w:
            for i in range(2):
                w.add(f"c{c}-s{i}", *_sample(f"c{c}-s{i}"))
    return hsstore.open(location)


def _commit(location: str, names: list[str]) -> None:
    with hsstore.open(location).writer(encode_threads=1) as w:
        for name in names:
            w.add(name, *_sample(name))


def test_a_writer_open_across_a_repair_still_refuses_a_duplicate_id(tmp_path):
    location = str(tmp_path / "ds")
    ds = _build(location, 3)
    storage = open_storage(location)
    for seg in ds.manifest.segments[:2]:  # two segments lost: the repair shortens the list
        storage.delete_tree(paths.segment_dir(seg.id))
    late = hsstore.open(location).writer(encode_threads=1)  # sees three segments
    assert hsstore.repair(location).version is not None
    _commit(location, ["x"])  # another writer's segment lands where `late` stopped looking
    late.add("x", *_sample("x"))
    with pytest.raises(DuplicateSampleError, match="committed by another writer"):
        late.commit()
    late.close()
    after = hsstore.open(location)
    assert sorted(after.sample_ids).count("x") == 1
    assert hsstore.verify(location).ok


def test_a_writer_committing_while_a_repair_publishes_keeps_its_commit(tmp_path):
    location = str(tmp_path / "ds")
    ds = _build(location, 3)
    storage = open_storage(location)
    damaged = ds.manifest.segments[0]
    storage.delete_tree(paths.segment_dir(damaged.id))

    # The repair stops just before creating its version; a writer (re-filling one of the
    # samples the repair drops) and another (new samples) publish meanwhile.
    def meanwhile() -> None:
        _commit(location, ["c0-s0"])
        _commit(location, ["w1", "w2"])

    report = stopped_at(
        open_storage(location), "put_if_absent", "manifests/v", hsstore.repair, meanwhile
    )
    dropped = [(r["segment"], r["num_samples"]) for r in report.repairs]
    assert report.version is not None and dropped == [(damaged.id, 2)]
    after = hsstore.open(location)
    assert after.manifest.version == report.version
    want = {f"c{c}-s{i}" for c in (1, 2) for i in range(2)} | {"c0-s0", "w1", "w2"}
    assert sorted(after.sample_ids) == sorted(want)
    for name in want:  # the writers' commits and the kept samples, bit-exact
        assert torch.equal(after.get(name).hidden, _sample(name)[2])
    assert hsstore.verify(location).ok


def test_a_commit_mark_written_after_the_repair_listed_versions_is_not_a_lost_version(tmp_path):
    location = str(tmp_path / "ds")
    _build(location, 2)
    # The repair lists the versions, then a writer publishes and marks its segment: the mark
    # names a version newer than the one the repair folded, which exists; nothing is lost.
    report = stopped_at(
        open_storage(location),
        "list",
        paths.SEGMENTS,
        hsstore.repair,
        lambda: _commit(location, ["w1"]),
    )
    assert report.repairs == [] and report.version is None
    assert "w1" in hsstore.open(location).sample_ids
    assert hsstore.gc(location).removed_segments == []
