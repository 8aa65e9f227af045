"""History that costs O(change): delta commits, checkpoints, bounded loads, format 1 datasets,
version pruning, and reader memory that does not grow with the number of segments."""

from __future__ import annotations

import json
import threading
import tracemalloc
from pathlib import Path

import pytest
import torch

import hsstore
from hsstore import LayerSpec
from hsstore.commits import commit
from hsstore.spec.manifest import FORMAT_VERSION
from tools.synthetic import random_sample

H = 32
K = commit.CHECKPOINT_EVERY


def _create(path: Path, **kw) -> hsstore.Dataset:
    return hsstore.create(path, layers=[LayerSpec(1), LayerSpec(2)], hidden_size=H,
                          dtype=torch.bfloat16, **kw)  # fmt: skip


def _commit_each(ds: hsstore.Dataset, n: int, *, start: int = 0, tokens: int = 5) -> None:
    with ds.writer(encode_threads=1) as w:
        for i in range(start, start + n):
            w.add(f"s{i}", *random_sample(tokens, 2, H, seed=i))
            w.commit()


def _names(path: Path) -> list[str]:
    return sorted(p.name for p in (path / "manifests").iterdir())


@pytest.fixture(scope="module")
def long_history(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("history") / "ds"
    _commit_each(_create(path), 3 * K + 5)
    return path


def test_each_commit_writes_a_small_delta(long_history):
    sizes = [(long_history / "manifests" / f"v{v:08d}.json").stat().st_size for v in (2, 3 * K + 6)]
    first, last = sizes
    assert last <= first * 1.2  # the newest delta is no bigger than the first one
    doc = json.loads((long_history / "manifests" / f"v{3 * K + 6:08d}.json").read_text())
    assert doc["kind"] == "delta" and len(doc["add_segments"]) == 1


def test_only_the_newest_two_checkpoints_are_kept(long_history):
    """Besides version 1's copy (the dataset's description, kept should version 1's file be
    lost)."""
    checkpoints = [n for n in _names(long_history) if n.startswith("c")]
    assert checkpoints == ["c00000001.json", f"c{2 * K:08d}.json", f"c{3 * K:08d}.json"]
    files = {f.name: f.stat().st_size for f in (long_history / "manifests").iterdir()}
    deltas = [size for name, size in files.items() if name.startswith("v")]
    # O(segments) on disk: one small delta per version plus two checkpoints, nothing that
    # repeats the whole state per version.
    bound = (
        len(deltas) * 1.2 * files["v00000002.json"]
        + 2 * files[checkpoints[-1]]
        + files["c00000001.json"]
        + 1000
    )
    assert sum(files.values()) <= bound


def test_open_reads_the_newest_checkpoint_and_the_deltas_after_it(long_history, tmp_path):
    import shutil

    copy = tmp_path / "ds"
    shutil.copytree(long_history, copy)
    n = 3 * K + 5
    # Remove every version file the latest version does not need: open must not notice.
    for v in range(1, 3 * K + 1):
        (copy / "manifests" / f"v{v:08d}.json").unlink()
    ds = hsstore.open(copy)
    assert len(ds) == n and ds.manifest.version == n + 1
    assert ds.sample_ids == [f"s{i}" for i in range(n)]
    assert torch.equal(ds.get("s7").hidden, random_sample(5, 2, H, seed=7)[2])


def test_every_version_stays_readable(long_history):
    for version in (1, 2, K - 1, K, K + 1, 2 * K + 3, 3 * K + 6):
        ds = hsstore.open(long_history, version=version)
        assert len(ds) == version - 1 and ds.manifest.version == version
        if len(ds):
            assert ds.sample_ids[-1] == f"s{version - 2}"


def test_history_verifies(long_history):
    report = hsstore.verify(long_history)
    assert report.ok, report.problems
    assert report.samples_checked == 3 * K + 5


def test_writers_from_one_base_catch_up_over_each_others_deltas(tmp_path):
    ds = _create(tmp_path / "ds")
    a, b, c = (hsstore.open(tmp_path / "ds").writer(encode_threads=1) for _ in range(3))
    a.add("a", *random_sample(4, 2, H, seed=1))
    b.add("b", *random_sample(4, 2, H, seed=2))
    c.add("a", *random_sample(4, 2, H, seed=3))  # the same id as a's, not yet committed
    assert a.commit().version == 2
    assert b.commit().version == 3  # caught up over a's delta, then published its own
    with pytest.raises(hsstore.DuplicateSampleError, match="committed by another writer"):
        c.commit()  # a's delta names "a": nothing of c's is published
    for w in (a, b, c):
        w.close()
    assert ds.refresh().sample_ids == ["a", "b"]
    assert hsstore.verify(tmp_path / "ds").ok


def test_gc_keep_versions_checkpoints_before_pruning(tmp_path):
    ds = _create(tmp_path / "ds")
    _commit_each(ds, 10)
    report = hsstore.gc(tmp_path / "ds", keep_versions=3, grace_s=0)
    assert report.pruned_manifests == list(range(1, 9))
    assert _names(tmp_path / "ds") == ["_latest", "c00000001.json", "c00000009.json",
                                       "v00000009.json", "v00000010.json",
                                       "v00000011.json"]  # fmt: skip
    for version in (9, 10, 11):
        assert len(hsstore.open(tmp_path / "ds", version=version)) == version - 1
    assert hsstore.verify(tmp_path / "ds").ok


def _format_1_dataset(path: Path, commits: int) -> list[dict]:
    """What format 1 wrote: a full manifest per version, no checksum, no deltas."""
    ds = _create(path)
    _commit_each(ds, commits)
    docs = []
    for v in range(1, commits + 2):
        obj = hsstore.open(path, version=v).manifest.to_json()
        obj["format_version"] = 1
        del obj["kind"]
        docs.append(obj)
    for f in (path / "manifests").iterdir():
        f.unlink()
    for obj in docs:
        (path / "manifests" / f"v{obj['version']:08d}.json").write_text(json.dumps(obj, indent=1))
    return docs


def test_format_1_datasets_are_read_and_extended(tmp_path):
    _format_1_dataset(tmp_path / "ds", 3)
    ds = hsstore.open(tmp_path / "ds")
    assert ds.manifest.format_version == 1 and len(ds) == 3
    assert hsstore.verify(tmp_path / "ds").ok
    _commit_each(ds, 2, start=3)
    newest = json.loads((tmp_path / "ds" / "manifests" / "v00000006.json").read_text())
    assert newest["format_version"] == FORMAT_VERSION and newest["kind"] == "delta"
    ds = hsstore.open(tmp_path / "ds")
    assert ds.sample_ids == [f"s{i}" for i in range(5)]
    assert torch.equal(ds.get("s1").hidden, random_sample(5, 2, H, seed=1)[2])
    assert hsstore.verify(tmp_path / "ds").ok


def _held_while_reading(path: Path, threads: int) -> int:
    """Bytes allocated and still held once each of ``threads`` live threads has read every
    sample (every thread touches every segment)."""
    ds = hsstore.open(path)
    done, release = threading.Barrier(threads + 1), threading.Event()

    def run(k: int) -> None:
        for i in range(len(ds)):
            ds.read(i, layers=[1])  # a layer subset decodes through the scratch chunk
            ds.read(i)
        done.wait()
        release.wait()  # keep the thread (and anything it holds) alive while measured

    tracemalloc.start()
    pool = [threading.Thread(target=run, args=(k,)) for k in range(threads)]
    try:
        for t in pool:
            t.start()
        done.wait()
        held = tracemalloc.get_traced_memory()[0]
    finally:
        release.set()
        for t in pool:
            t.join()
        tracemalloc.stop()
    return held


def test_reader_memory_per_thread_does_not_grow_with_segments(tmp_path):
    ds = _create(tmp_path / "ds", chunk_bytes=64 << 10, sample_aligned=False)
    chunk = ds.manifest.chunk_nbytes
    assert chunk >= 32 << 10
    _commit_each(ds, 40, tokens=300)
    per_thread = (
        _held_while_reading(tmp_path / "ds", 4) - _held_while_reading(tmp_path / "ds", 1)
    ) / 3
    # A thread holds a scratch chunk and a staging buffer for encoded chunks, whatever the
    # number of segments (40 here). The 1-thread figure holds what is per segment but shared
    # (token columns, shard indexes).
    assert per_thread < 4 * chunk, per_thread / chunk


def test_a_damaged_checkpoint_is_passed_over_and_reported(long_history, tmp_path):
    import shutil

    copy = tmp_path / "ds"
    shutil.copytree(long_history, copy)
    checkpoint = copy / "manifests" / f"c{3 * K:08d}.json"
    data = checkpoint.read_bytes()
    assert b'"num_tokens":5}' in data
    checkpoint.write_bytes(data.replace(b'"num_tokens":5}', b'"num_tokens":6}', 1))
    ds = hsstore.open(copy)  # folds from the older checkpoint and more deltas
    assert ds.sample_ids == [f"s{i}" for i in range(3 * K + 5)]
    assert len(hsstore.open(copy, version=3 * K)) == 3 * K - 1
    report = hsstore.verify(copy)
    assert [p.where for p in report.problems] == [str(checkpoint)]
    assert "checksum mismatch" in report.problems[0].reason


def test_a_writer_whose_base_version_was_pruned_refuses_without_claiming_a_rollback(tmp_path):
    ds = _create(tmp_path / "ds")
    late = hsstore.open(tmp_path / "ds").writer(encode_threads=1)
    _commit_each(ds, 4)
    assert hsstore.gc(tmp_path / "ds", keep_versions=1).pruned_manifests == [1, 2, 3, 4]
    late.add("late", *random_sample(5, 2, H, seed=99))
    with pytest.raises(hsstore.IntegrityError, match="pruned .gc --keep-versions. after") as info:
        late.commit()
    assert "rolled back" not in str(info.value)
    late.close()
    assert "late" not in hsstore.open(tmp_path / "ds").sample_ids
    assert hsstore.verify(tmp_path / "ds").ok
