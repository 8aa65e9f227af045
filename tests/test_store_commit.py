"""Atomic commits: parallel writers, crashes, duplicates, gc."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
import zlib
from pathlib import Path

import pytest
import torch

import hsstore
from hsstore import LayerSpec
from tools.synthetic import random_sample

ROOT = Path(__file__).resolve().parents[1]

WRITER = textwrap.dedent(
    """
    import sys, time, zlib, hsstore
    from tools.synthetic import random_sample
    path, prefix, n, commit_every, pause = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), float(sys.argv[5])
    ds = hsstore.open(path)
    with ds.writer(segment_bytes=1 << 16, encode_threads=1) as w:
        for i in range(n):
            ids, mask, hid = random_sample(20 + (i * 7) % 50, 2, 32, seed=zlib.crc32(f"{prefix}-{i}".encode()) % 1000)
            w.add(f"{prefix}-{i}", ids, mask, hid)
            if commit_every and (i + 1) % commit_every == 0:
                w.commit()
                print("committed", i + 1, flush=True)
            if pause:
                time.sleep(pause)
    print("done", flush=True)
    """
)


def _spawn(
    path: Path,
    prefix: str,
    n: int,
    commit_every: int = 0,
    pause: float = 0.0,
    lease_ttl: str = "60",
) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-c", WRITER, str(path), prefix, str(n), str(commit_every), str(pause)],
        cwd=ROOT,
        env={**os.environ, "HSSTORE_LEASE_TTL": lease_ttl},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def _make(path: Path) -> hsstore.Dataset:
    return hsstore.create(path, layers=[LayerSpec(1), LayerSpec(4)], hidden_size=32, dtype=torch.bfloat16,
                          chunk_bytes=2048, shard_bytes=8192)  # fmt: skip


def test_four_processes_write_one_dataset(tmp_path):
    path = tmp_path / "ds"
    _make(path)
    procs = [_spawn(path, f"w{k}", 30, commit_every=7) for k in range(4)]
    for p in procs:
        out, err = p.communicate(timeout=240)
        assert p.returncode == 0, err
    ds = hsstore.open(path)
    ids = ds.sample_ids
    assert len(ids) == len(set(ids)) == 120
    assert set(ids) == {f"w{k}-{i}" for k in range(4) for i in range(30)}
    assert hsstore.verify(path).ok
    # every commit was published exactly once: alone in a version, or in a group
    versions = sorted(v for v in os.listdir(path / "manifests") if v.startswith("v"))
    tokens = []
    for name in versions[1:]:
        delta = json.loads((path / "manifests" / name).read_bytes())
        tokens += [delta["commit"], *delta.get("group", [])]
    assert len(tokens) == len(set(tokens)) == 4 * 5
    assert 1 < len(versions) <= 1 + 4 * 5


def test_kill_9_mid_segment_loses_nothing_committed(tmp_path):
    path = tmp_path / "ds"
    _make(path)
    proc = _spawn(path, "k", 10_000, commit_every=5, pause=0.01, lease_ttl="0.5")
    assert proc.stdout is not None
    seen = 0
    while seen < 3:  # let it commit three times, then kill it mid-way through the next segment
        line = proc.stdout.readline()
        assert line, proc.stderr.read() if proc.stderr else ""
        if line.startswith("committed"):
            seen += 1
    time.sleep(0.03)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    ds = hsstore.open(path)
    assert len(ds) >= 15 and len(ds) % 5 == 0  # whole commits only
    assert ds.sample_ids == [f"k-{i}" for i in range(len(ds))]
    for i in range(len(ds)):
        ids, mask, hid = random_sample(
            20 + (i * 7) % 50, 2, 32, seed=zlib.crc32(f"k-{i}".encode()) % 1000
        )
        assert torch.equal(ds[i].hidden.view(torch.int16), hid.view(torch.int16))
    debris = (
        set(os.listdir(path / "segments")) - {s.id for s in ds.manifest.segments} - {"zarr.json"}
    )
    assert debris, "the killed writer should have left an uncommitted segment behind"
    time.sleep(0.6)  # the dead writer's lease lapses (no heartbeat since the kill)
    report = hsstore.gc(path, grace_s=0)
    assert set(report.removed_segments) == debris
    assert set(os.listdir(path / "segments")) == {s.id for s in ds.manifest.segments} | {
        "zarr.json"
    }
    assert hsstore.verify(path).ok


def test_gc_spares_a_live_writer(tmp_path):
    path = tmp_path / "ds"
    ds = _make(path)
    w = ds.writer()
    w.add("live", *random_sample(10, 2, 32))
    report = hsstore.gc(path)
    assert report.removed_segments == [] and len(report.live_segments) == 1
    w.commit()
    w.close()
    assert "live" in hsstore.open(path)


def test_exception_in_writer_block_commits_nothing(tmp_path):
    path = tmp_path / "ds"
    ds = _make(path)
    with ds.writer() as w:
        w.add("keep", *random_sample(10, 2, 32))
    with pytest.raises(RuntimeError), ds.writer() as w:
        w.add("lost", *random_sample(10, 2, 32))
        raise RuntimeError("boom")
    ds = hsstore.open(path)
    assert ds.sample_ids == ["keep"]
    assert len(os.listdir(path / "segments")) == 2  # zarr.json + the committed segment


def test_duplicate_ids_are_rejected(tmp_path):
    path = tmp_path / "ds"
    ds = _make(path)
    with ds.writer() as w:
        w.add("a", *random_sample(5, 2, 32))
        with pytest.raises(hsstore.DuplicateSampleError, match="already"):
            w.add("a", *random_sample(5, 2, 32))
    with pytest.raises(hsstore.DuplicateSampleError, match="'a'"), ds.writer() as w:
        w.add("a", *random_sample(5, 2, 32))
    # two writers racing with the same id: the second commit fails and publishes nothing
    w1, w2 = ds.writer(), ds.writer()
    w1.add("b", *random_sample(5, 2, 32))
    w2.add("b", *random_sample(6, 2, 32))
    w2.add("c", *random_sample(6, 2, 32))
    w1.commit()
    with pytest.raises(hsstore.DuplicateSampleError, match="another writer"):
        w2.commit()
    w1.close()
    w2.close()
    ds = hsstore.open(path)
    assert ds.sample_ids == ["a", "b"] and ds.get("b").num_tokens == 5


def test_an_id_another_writer_published_is_refused_in_every_later_commit(tmp_path):
    """A writer learns what others publish from the versions' sample digests (hashes): an id
    it learnt that way is refused at add() in every later commit, not only by the commit that
    first checked against it."""
    path = tmp_path / "ds"
    ds = _make(path)
    late = hsstore.open(path).writer(encode_threads=1)
    with ds.writer(encode_threads=1) as w:
        w.add("x", *random_sample(5, 2, 32, seed=1))
        w.add("z", *random_sample(5, 2, 32, seed=9))
    late.add("y", *random_sample(4, 2, 32, seed=2))
    late.commit()  # checked against the segment holding "x", by hash
    with pytest.raises(hsstore.DuplicateSampleError, match="'x'"):
        late.add("x", *random_sample(3, 2, 32, seed=3))
    late.add("x2", *random_sample(3, 2, 32, seed=3))
    late.commit()
    late.close()
    ds = hsstore.open(path)
    assert sorted(ds.sample_ids) == ["x", "x2", "y", "z"]
    assert torch.equal(ds.get("x").hidden, random_sample(5, 2, 32, seed=1)[2])


@pytest.mark.parametrize(
    "bad, match",
    [
        (dict(hidden=torch.zeros(4, 2, 32, dtype=torch.float32)), "never casts"),
        (dict(hidden=torch.zeros(4, 3, 32, dtype=torch.bfloat16)), "3 layers"),
        (dict(hidden=torch.zeros(0, 2, 32, dtype=torch.bfloat16)), "no tokens"),
        (dict(input_ids=torch.arange(3)), "input_ids has shape"),
        (dict(loss_mask=torch.full((4,), 2)), "only 0 and 1"),
        (dict(input_ids=torch.full((4,), -1)), "out of range"),
    ],
)
def test_bad_samples_are_refused_with_a_reason(tmp_path, bad, match):
    ds = _make(tmp_path / "ds")
    args = dict(input_ids=torch.arange(4), loss_mask=torch.ones(4, dtype=torch.long),
                hidden=torch.zeros(4, 2, 32, dtype=torch.bfloat16))  # fmt: skip
    args.update(bad)
    with ds.writer() as w:
        w.add("good", *random_sample(4, 2, 32))
        with pytest.raises(hsstore.BadInputError, match=match) as info:
            w.add("bad", args["input_ids"], args["loss_mask"], args["hidden"], source="file_7.pt")
        assert info.value.sample_id == "bad" and "file_7.pt" in str(info.value)
    assert hsstore.open(tmp_path / "ds").sample_ids == ["good"]


def test_create_refuses_existing_and_reopens_compatible(tmp_path):
    path = tmp_path / "ds"
    _make(path)
    with pytest.raises(hsstore.ConflictError, match="already exists"):
        _make(path)
    again = hsstore.create(
        path, layers=[LayerSpec(1), LayerSpec(4)], hidden_size=32, dtype="bfloat16", exist_ok=True
    )
    assert again.manifest.version == 1
    with pytest.raises(hsstore.ConflictError, match="hidden_size"):
        hsstore.create(
            path,
            layers=[LayerSpec(1), LayerSpec(4)],
            hidden_size=64,
            dtype="bfloat16",
            exist_ok=True,
        )


def test_skipped_inputs_land_in_provenance(tmp_path):
    ds = _make(tmp_path / "ds")
    with ds.writer() as w:
        w.add("a", *random_sample(5, 2, 32))
        w.record_skipped("data_3.pt", "truncated zip")
    prov = hsstore.open(tmp_path / "ds").manifest.provenance
    assert prov["skipped"] == [{"name": "data_3.pt", "reason": "truncated zip"}]


def test_reopen_with_layers_named_in_another_convention(tmp_path):
    path = tmp_path / "ds"
    _make(path)
    renamed = [LayerSpec(1, source_convention="speculators", source_id=0), LayerSpec(4)]
    ds = hsstore.create(path, layers=renamed, hidden_size=32, dtype="bfloat16", exist_ok=True)
    assert [layer.depth for layer in ds.layers] == [1, 4]
    with pytest.raises(hsstore.IncompatibleDatasetError, match=r"layers \[after 1, after 4\]"):
        hsstore.create(
            path,
            layers=[LayerSpec(2), LayerSpec(4)],
            hidden_size=32,
            dtype="bfloat16",
            exist_ok=True,
        )


def test_bytes_written_counts_what_reached_disk(tmp_path):
    ds = _make(tmp_path / "ds")
    with ds.writer() as w:
        assert w.bytes_written == 0
        w.add("a", *random_sample(300, 2, 32))
        w.commit()
        after_commit = w.bytes_written
        on_disk = sum(
            f.size
            for s in hsstore.open(tmp_path / "ds").manifest.segments
            for f in s.files.values()
        )
        assert after_commit == on_disk > 0


def test_refresh_reuses_loaded_segments_and_sees_new_ones(tmp_path):
    path = tmp_path / "ds"
    ds = _make(path)
    reader_view = hsstore.open(path)
    with ds.writer() as w:
        w.add("a", *random_sample(5, 2, 32))
    reader_view.refresh()
    first = reader_view.segment_reader(0)
    with ds.writer() as w:
        w.add("b", *random_sample(6, 2, 32))
    reader_view.refresh()
    assert reader_view.segment_reader(0) is first  # immutable segments are not reloaded
    assert reader_view.sample_ids == ["a", "b"] and reader_view.get("b").num_tokens == 6
