"""The commit/gc protocol under exact interleavings, on a local disk and on S3, GCS and Azure alike.

Each test puts a writer step at one precise point of gc (or a failure at one precise point of a
commit) through the hooks the protocol exposes, so no outcome depends on scheduling luck.
"""

from __future__ import annotations

import threading
import time

import pytest
import torch

import hsstore
from hsstore import LayerSpec
from hsstore.commits import commit, lease
from hsstore.dataset.writer import Writer
from hsstore.errors import SegmentRemovedError
from hsstore.spec import paths
from hsstore.storage.local_store import LocalStorage
from hsstore.storage.locations import open_storage
from hsstore.storage.store import Storage
from tests.faults import Fault, FaultyStorage, at, stopped_at
from tools.synthetic import random_sample

TTL = 0.4


@pytest.fixture(params=["local", "s3", "gs", "az"])
def location(request: pytest.FixtureRequest, tmp_path, remote_of) -> str:
    if request.param == "local":
        return str(tmp_path / "ds")
    return remote_of(request.param).url


def _lapse_wait(location: str) -> float:
    """Long enough for a lease to look dead to gc: S3 dates have whole seconds, which gc adds
    to the ttl as slack."""
    return 1.5 * TTL + open_storage(location).clock_resolution_s * 2.2


def _make(location: str | Storage) -> hsstore.Dataset:
    return hsstore.create(location, layers=[LayerSpec(1), LayerSpec(4)], hidden_size=32,
                          dtype=torch.bfloat16, chunk_bytes=2048, shard_bytes=8192)  # fmt: skip


def _segment_keys(storage: Storage, segment_id: str) -> list[str]:
    return [o.key for o in storage.walk(paths.segment_dir(segment_id))]


def test_gc_spares_a_segment_whose_heartbeat_runs(location):
    ds = _make(location)
    w = ds.writer(lease_ttl_s=TTL)
    w.add("a", *random_sample(10, 2, 32))
    seg_id = w.flush().id  # the segment's files are all written, not yet committed
    time.sleep(_lapse_wait(location) + TTL)  # the heartbeat keeps the lease live past its ttl
    report = hsstore.gc(location, grace_s=0)
    assert report.live_segments == [seg_id] and report.removed_segments == []
    assert w.commit() is not None
    w.close()
    assert hsstore.open(location).sample_ids == ["a"] and hsstore.verify(location).ok


def test_a_commit_between_gc_listing_and_checks_is_kept(location):
    """The writer publishes and drops its lease after gc read the manifest: the lease check
    then finds nothing, and only the re-read of the manifest saves the segment."""
    ds = _make(location)
    w = ds.writer(lease_ttl_s=TTL)
    w.add("a", *random_sample(10, 2, 32))
    seg_id = w.flush().id

    # gc stops at its first listing of segments/, after it read the manifest; the writer
    # publishes and drops its lease meanwhile.
    report = stopped_at(
        open_storage(location), "list", paths.SEGMENTS, lambda s: commit.gc(s, grace_s=0), w.commit
    )
    w.close()
    assert seg_id not in report.removed_segments
    storage = open_storage(location)
    assert _segment_keys(storage, seg_id), "a committed segment was deleted"
    assert hsstore.open(location).sample_ids == ["a"] and hsstore.verify(location).ok


def test_a_writer_whose_lease_lapsed_never_publishes(location):
    """gc judged the writer dead while its heartbeat stalled, condemned the segment in a
    version and removed it; the writer reads that version while catching up and refuses to
    publish a manifest that would reference missing files, naming the sample."""
    ds = _make(location)
    stalled = threading.Event()
    release = threading.Event()
    # The heartbeat's first refresh of the lease (a put; taking it is a conditional create)
    # hangs at the storage until released.
    hang = Fault("pause", release=release, reached=stalled)
    storage = FaultyStorage(open_storage(location), at("put", paths.WRITING_LOCK, hang))
    w = Writer(storage, ds.manifest, ds.sample_ids, lease_ttl_s=TTL)
    w.add("a", *random_sample(10, 2, 32))
    seg_id = w.flush().id
    assert stalled.wait(5)
    time.sleep(_lapse_wait(location))
    report = hsstore.gc(location, grace_s=0)
    assert report.removed_segments == [seg_id]
    release.set()  # the heartbeat's put lands, too late (it holds the leases' lock meanwhile)
    with pytest.raises(SegmentRemovedError, match="condemned.*lease lapsed") as caught:
        w.commit()
    assert caught.value.sample_ids == ("a",) and caught.value.published is None
    w.close()
    assert len(hsstore.open(location)) == 0 and hsstore.verify(location).ok


class _PublishFails(LocalStorage):
    """A real local store whose manifest create fails once, before or after it lands (the
    server stored the object, then the connection dropped)."""

    def __init__(self, root: str, *, lands: bool):
        super().__init__(root)
        self.lands = lands
        self.armed = True

    def put_if_absent(self, key: str, data: bytes) -> bool:
        if not (self.armed and key.startswith(paths.MANIFESTS + "/")):
            return super().put_if_absent(key, data)
        self.armed = False
        if self.lands:
            super().put_if_absent(key, data)
        raise ConnectionResetError(104, "connection reset by peer", key)


def test_a_publish_that_raised_after_landing_keeps_its_segment(tmp_path):
    root = str(tmp_path / "ds")
    _make(root)
    ds = hsstore.open(_PublishFails(root, lands=True))
    w = ds.writer(lease_ttl_s=TTL)
    w.add("a", *random_sample(10, 2, 32))
    published = w.commit()  # the version is in place: the commit reports success
    w.close()
    assert published is not None and published.version == 2
    assert hsstore.open(root).sample_ids == ["a"] and hsstore.verify(root).ok


def test_a_publish_that_failed_before_landing_is_sent_again_not_aborted(tmp_path):
    """The create never reached the store: the writer finds the version absent and creates
    the same bytes again (so a first copy stalled on the wire can never land unseen)."""
    root = str(tmp_path / "ds")
    _make(root)
    storage = _PublishFails(root, lands=False)
    with hsstore.open(storage).writer(lease_ttl_s=TTL) as w:
        w.add("a", *random_sample(10, 2, 32))
    assert not storage.armed  # the fault was injected
    assert hsstore.open(root).sample_ids == ["a"] and hsstore.verify(root).ok


def test_gc_leaves_young_temp_files_alone(tmp_path):
    import os

    root = tmp_path / "ds"
    _make(str(root))
    young, old = root / "manifests" / ".tmp-young", root / "manifests" / ".tmp-old"
    young.write_bytes(b"x")
    old.write_bytes(b"x")
    os.utime(old, (0, 0))
    report = hsstore.gc(str(root), grace_s=60)
    assert report.removed_files == ["manifests/.tmp-old"]
    assert young.exists() and not old.exists()


def test_a_lone_commit_writes_its_lease_and_the_hint_once_each(tmp_path, monkeypatch):
    """A commit right after its sample was written: the lease is created and deleted, not
    written again before the publish (it is moments old), and the hint is written once,
    without being read again (the catch-up read it). A lease older than its fresh share of
    the ttl is written again before the publish."""
    root = str(tmp_path / "ds")
    _make(root)
    calls: list[tuple[str, str]] = []

    def record(call) -> None:
        calls.append((call.verb, call.key))

    def commit_one(w: Writer, sample_id: str) -> tuple[list[str], list[str]]:
        w.add(sample_id, *random_sample(10, 2, 32))
        calls.clear()
        w.commit()
        lease_calls = [verb for verb, key in calls if key.endswith(paths.WRITING_LOCK)]
        hint_calls = [verb for verb, key in calls if key == paths.LATEST_HINT]
        return lease_calls, hint_calls

    w = hsstore.open(FaultyStorage(open_storage(root), record)).writer(lease_ttl_s=60)
    # The lease was created by add(); it is deleted once the commit is published.
    assert commit_one(w, "a") == (["delete"], ["read_bytes", "put"])
    monkeypatch.setattr(lease, "FRESH_SHARE", 0.0)  # no lease counts as fresh
    assert commit_one(w, "b") == (["put", "delete"], ["read_bytes", "put"])
    w.close()
    assert hsstore.open(root).sample_ids == ["a", "b"]
    assert hsstore.open(root).manifest.version == 3


def test_a_stalled_heartbeat_write_holds_up_neither_a_commit_nor_the_next_lease(tmp_path):
    """The storage stalls on the heartbeat's rewrite of a lease (a slow object store): the
    writer still commits, drops that lease and leases its next segment meanwhile. When the
    stalled write lands after the drop, the heartbeat deletes the lease again."""
    root = str(tmp_path / "ds")
    _make(root)
    release, reached = threading.Event(), threading.Event()
    armed = [False]
    stall = at("put", paths.WRITING_LOCK, Fault("pause", release=release, reached=reached))
    storage = FaultyStorage(open_storage(root), lambda call: stall(call) if armed[0] else None)
    w = hsstore.open(storage).writer(lease_ttl_s=0.6)  # a heartbeat every 0.2 s
    w.add("a", *random_sample(10, 2, 32))
    (first,) = filter(paths.is_segment_id, storage.inner.list(paths.SEGMENTS))  # a's segment
    armed[0] = True
    assert reached.wait(10)  # the heartbeat's write is stalled
    done = threading.Event()

    def commit_and_go_on() -> None:
        w.commit()
        w.add("b", *random_sample(10, 2, 32))  # a new segment: a new lease
        w.flush()
        done.set()

    t = threading.Thread(target=commit_and_go_on, daemon=True)
    t.start()
    assert done.wait(20), "the commit waited for the stalled heartbeat write"
    assert hsstore.open(root).sample_ids == ["a"]
    release.set()  # the stalled write lands, after the commit dropped its lease
    deadline = time.monotonic() + 10
    while storage.inner.exists(lease.lease_key(first)) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not storage.inner.exists(lease.lease_key(first))
    w.commit()
    w.close()
    assert hsstore.open(root).sample_ids == ["a", "b"]
