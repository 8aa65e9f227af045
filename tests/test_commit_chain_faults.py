"""The commit protocol and the history's evidence together: a commit resolved by identity
after a lost reply or an outage still extends the hash chain and announces its checksum; gc's
condemning version is a link of the chain like any other; and a refresh that fails because the
storage did not answer leaves the view at its old version, while a damaged segment is only
left out of it. On a local disk and on S3 (the real server), under `tests.faults`."""

from __future__ import annotations

import time

import pytest
import torch

import hsstore
from hsstore import LayerSpec
from hsstore.commits import commit, history
from hsstore.errors import CommitUnknownError, HsstoreError
from hsstore.spec import paths
from hsstore.spec.manifest import Delta
from hsstore.storage.locations import open_storage
from tests.faults import Call, Fault, FaultyStorage, at
from tools.synthetic import random_sample


@pytest.fixture(params=["local", "s3"])
def location(request: pytest.FixtureRequest, tmp_path) -> str:
    if request.param == "local":
        return str(tmp_path / "ds")
    return request.getfixturevalue("s3_url")


def _make(location: str) -> None:
    hsstore.create(location, layers=[LayerSpec(1), LayerSpec(4)], hidden_size=32,
                   dtype=torch.bfloat16, chunk_bytes=2048, shard_bytes=8192)  # fmt: skip


def _sample(name: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return random_sample(6 + len(name) % 5, 2, 32, seed=sum(map(ord, name)))


def _delta(location: str, version: int) -> Delta:
    doc = history.read_version(open_storage(location), version)
    assert isinstance(doc, Delta)
    return doc


def _check_chain(location: str) -> None:
    """Every delta names its predecessor's file checksum; the hint names the newest one's;
    ``verify --full`` reads the whole history and passes."""
    storage = open_storage(location)
    versions = commit.list_versions(storage)
    for v in versions[1:]:
        before = history.read_version(storage, v - 1)
        link = before.checksum if isinstance(before, Delta) else before.head_checksum
        assert link is not None and _delta(location, v).prev == link, f"v{v} breaks the chain"
    latest = commit.load_manifest(storage)
    hint = history.read_hint(storage)
    assert (hint.version, hint.checksum) == (latest.version, latest.head_checksum)
    report = hsstore.verify(location, full=True)
    assert report.ok, report.problems


class _Outage:
    """Every call fails from the manifest create on (its reply lost) for ``seconds``."""

    def __init__(self, seconds: float):
        self.seconds, self.until = seconds, None

    def __call__(self, call: Call) -> Fault | None:
        if (
            self.until is None
            and "manifests/v00000002" in call.key
            and call.verb == "put_if_absent"
        ):
            self.until = time.monotonic() + self.seconds
            return Fault("lose")
        if self.until is not None and time.monotonic() < self.until:
            return Fault("fail")
        return None


@pytest.mark.parametrize("kind", ["resend", "lose"])
def test_a_commit_recognised_after_a_lost_reply_extends_the_hash_chain(location, kind):
    _make(location)
    storage = FaultyStorage(open_storage(location), at("put_if_absent", "v00000002", Fault(kind)))
    with hsstore.open(storage).writer(lease_ttl_s=5) as w:
        w.add("a", *_sample("a"))
        published = w.commit()
        assert storage.tally.counts[kind] == 1
        w.add("b", *_sample("b"))
        w.commit()
    own = _delta(location, 2)
    assert published.version == 2 and own.commit is not None
    assert published.head_checksum == own.checksum  # the link the next commit names
    assert _delta(location, 3).prev == own.checksum
    assert _delta(location, 3).commit not in (None, own.commit)
    _check_chain(location)
    # Its segment carries the commit mark of the version it landed as.
    mark = history.read_mark(open_storage(location), own.add_segments[0].id)
    assert mark is not None and mark["version"] == 2


def test_a_commit_resolved_after_an_outage_extends_the_hash_chain(location, monkeypatch):
    monkeypatch.setenv("HSSTORE_RESOLVE_TIMEOUT", "0.3")
    _make(location)
    storage = FaultyStorage(open_storage(location), _Outage(1.5))
    w = hsstore.open(storage).writer(lease_ttl_s=5)
    w.add("a", *_sample("a"))
    with pytest.raises(CommitUnknownError):
        w.commit()
    time.sleep(1.5)
    published = w.commit()  # learns it landed
    w.add("b", *_sample("b"))
    w.commit()
    w.close()
    assert published.version == 2 and published.head_checksum == _delta(location, 2).checksum
    _check_chain(location)
    assert set(hsstore.open(location).sample_ids) == {"a", "b"}


def test_gc_condemning_version_is_a_link_of_the_chain(location):
    _make(location)
    storage = open_storage(location)
    with hsstore.open(location).writer() as w:
        w.add("a", *_sample("a"))
    debris = "0" * 32
    storage.put(paths.segment_file(debris, "zarr.json"), b"{}")  # a crashed writer's folder
    time.sleep(2.1)  # past the whole-second slack of an object store's Last-Modified
    report = hsstore.gc(location, grace_s=0)
    assert report.removed_segments == [debris]
    condemning = _delta(location, commit.list_versions(storage)[-1])
    assert condemning.condemn == (debris,) and condemning.commit is not None
    with hsstore.open(location).writer() as w:  # the next commit links to gc's version
        w.add("b", *_sample("b"))
    _check_chain(location)


def test_a_refresh_the_storage_did_not_answer_keeps_the_old_view(location):
    """A failed index read of a new segment (an object store not answering) raises and leaves
    the view at its version (a local EIO is read again); the same segment with its index removed is damage: the view moves on
    without it, naming it in ``unreadable``."""
    _make(location)
    storage = FaultyStorage(open_storage(location))
    ds = hsstore.open(storage)
    with hsstore.open(location).writer() as w:
        w.add("a", *_sample("a"))
    storage.plan = at("read_bytes", paths.INDEX, Fault("fail"))
    if "://" in location:
        with pytest.raises(HsstoreError, match="injected"):
            ds.refresh()
        assert ds.manifest.version == 1 and not ds.unreadable and len(ds) == 0
    # else: a local disk's EIO is read again, and one a retry gets past is no error at all
    ds.refresh()  # the storage answers again
    assert ds.sample_ids == ["a"] and not ds.unreadable
    assert storage.tally.counts["fail"] == 1

    with hsstore.open(location).writer() as w:
        w.add("b", *_sample("b"))
    seg = hsstore.open(location).manifest.segments[-1].id
    for name in (paths.INDEX, paths.INDEX_COPY):  # the index and its copy
        open_storage(location).delete(paths.segment_file(seg, name))
    ds.refresh()
    assert ds.manifest.version == 3 and ds.sample_ids == ["a"] and seg in ds.unreadable
