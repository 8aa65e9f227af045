"""The commit protocol under the ordinary faults of a cluster, each at one exact storage call:
a reply lost after the server acted, a resent request refused with 412, a writer paused while
gc runs, a gc machine whose clock runs ahead, gc beside a writer at its defaults, an outage.

Every test runs the real backend under `tests.faults.FaultyStorage` and ends with the same
checks: the dataset opens, verify passes, and each sample reads back bit-exact exactly when
its commit said it was published.
"""

from __future__ import annotations

import os
import threading
import time
import uuid

import pytest
import torch

import hsstore
from hsstore import LayerSpec
from hsstore.commits import lease
from hsstore.errors import CommitUnknownError, HsstoreError, SegmentRemovedError
from hsstore.spec import paths
from hsstore.storage.locations import open_storage
from tests.faults import Call, Fault, FaultyStorage, at, clock_shift
from tests.wire_proxy import WireProxy, once
from tools.synthetic import random_sample

TTL = 0.4


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


def _check(location: str, published: set[str], unpublished: set[str] = frozenset()) -> None:
    """Opens, verifies, holds every published sample bit-exact and none of the others."""
    ds = hsstore.open(location)
    report = hsstore.verify(location)
    assert report.ok, report.problems
    have = set(ds.sample_ids)
    assert published <= have, f"lost: {sorted(published - have)}"
    assert not (unpublished & have), f"reported unpublished but there: {unpublished & have}"
    for name in published:
        s = ds.get(name)
        ids, mask, hidden = _sample(name)
        assert torch.equal(s.hidden, hidden) and torch.equal(s.input_ids.long(), ids)


def _faulty(location: str, plan) -> FaultyStorage:
    return FaultyStorage(open_storage(location), plan)


# -- 1: a lost reply --------------------------------------------------------------------------
@pytest.mark.parametrize("kind", ["resend", "lose"])
def test_a_lost_reply_to_the_manifest_create_is_recognised_as_our_commit(location, kind):
    """The create lands, its reply is lost; resent, the server answers 412 (``resend``), or
    the client gives up (``lose``). The writer reads the version back, finds its own token,
    and reports the commit published: it never deletes the segment it has just published."""
    _make(location)
    storage = _faulty(location, at("put_if_absent", "manifests/v00000002", Fault(kind)))
    w = hsstore.open(storage).writer(lease_ttl_s=TTL)
    w.add("a", *_sample("a"))
    published = w.commit()
    w.close()
    assert published is not None and published.version == 2
    assert storage.tally.counts[kind] == 1
    _check(location, {"a"})


@pytest.mark.parametrize("key", [".writing", "index.parquet", "zarr.json", "states/c/"])
def test_a_resent_segment_or_lease_create_is_not_a_412_failure(location, key):
    """The same lost reply on the lease's create or a segment file's: the object holds our own
    bytes, so the writer goes on."""
    _make(location)
    verb = "put_if_absent" if key == ".writing" else "write_file"
    storage = _faulty(location, at(verb, key, Fault("resend")))
    w = hsstore.open(storage).writer(lease_ttl_s=TTL)
    w.add("a", *_sample("a"))
    assert w.commit() is not None
    w.close()
    if verb == "put_if_absent" or not location.startswith("/"):
        assert storage.tally.counts["resend"] == 1
    _check(location, {"a"})


# -- 2: a paused writer -----------------------------------------------------------------------
@pytest.mark.parametrize("where", ["before_create", "inside_last_lease_write"])
def test_a_writer_paused_past_its_ttl_while_gc_runs_publishes_nothing_and_says_so(
    location, where, monkeypatch
):
    """The whole writer stops (its heartbeat too) after its last check; gc judges the segment
    dead, condemns it in a version and deletes it. The writer resumes, reads gc's version while
    resolving its create, and refuses, naming the sample: the dataset stays openable."""
    # A lease written moments before the publish is not written again then: with no share
    # counted as fresh, the commit's lease write is always there to pause in.
    monkeypatch.setattr(lease, "FRESH_SHARE", 0.0)
    _make(location)
    release, reached = threading.Event(), threading.Event()
    stop = Fault("pause", release=release, reached=reached)
    armed = [False]

    def plan(call: Call) -> Fault | None:
        if not armed[0]:
            return None
        if call.verb == "put" and call.key.endswith(paths.WRITING_LOCK):
            return stop  # the heartbeat stops with the process
        if where == "before_create" and call.verb == "put_if_absent" and "manifests/v" in call.key:
            return stop
        return None

    storage = _faulty(location, plan)
    w = hsstore.open(storage).writer(lease_ttl_s=TTL)
    w.add("a", *_sample("a"))
    w.flush()
    armed[0] = True
    outcome: list[object] = []
    t = threading.Thread(target=lambda: outcome.append(_try(w.commit)))
    t.start()
    assert reached.wait(10)
    time.sleep(1.5 * TTL + 2.2 * storage.clock_resolution_s)
    report = hsstore.gc(location, grace_s=0)
    assert len(report.removed_segments) == 1
    release.set()
    t.join(30)
    assert not t.is_alive()
    w.close()
    err = outcome[0]
    assert isinstance(err, SegmentRemovedError), err
    assert err.sample_ids == ("a",) and err.published is None
    _check(location, set(), {"a"})


def _try(fn):
    try:
        return fn()
    except Exception as exc:  # noqa: BLE001 - the test inspects it
        return exc


# -- 3: skewed clocks -------------------------------------------------------------------------
def test_gc_on_a_machine_whose_clock_runs_ahead_keeps_a_live_writers_segment(tmp_path):
    """Default ttl and grace (60 s); gc's clock 150 s ahead. Ages are judged on the storage's
    own clock (the mtime of a probe file), so the live lease stays live."""
    root = str(tmp_path / "ds")
    _make(root)
    w = hsstore.open(root).writer()
    w.add("a", *_sample("a"))
    w.flush()
    with clock_shift(150):
        report = hsstore.gc(root)
    assert report.removed_segments == [] and len(report.live_segments) == 1
    assert w.commit() is not None
    w.close()
    _check(root, {"a"})


def test_gc_on_a_machine_whose_clock_runs_behind_still_removes_debris(tmp_path):
    root = str(tmp_path / "ds")
    _make(root)
    w = hsstore.open(root).writer(lease_ttl_s=TTL)
    w.add("a", *_sample("a"))
    w.flush()
    w.leases.release_all()  # the writer died
    time.sleep(0.2)
    with clock_shift(-3600):
        report = hsstore.gc(root, grace_s=0.1)
    assert len(report.removed_segments) == 1
    _check(root, set(), {"a"})


# -- 4: gc beside a writer, default settings --------------------------------------------------
def test_gc_at_its_defaults_never_removes_a_segment_folder_being_created(tmp_path):
    """The moment between a writer making its segment's folder and its lease landing in it."""
    root = tmp_path / "ds"
    _make(str(root))
    fresh = root / "segments" / uuid.uuid4().hex
    fresh.mkdir()
    report = hsstore.gc(str(root))
    assert report.removed_segments == [] and fresh.is_dir()


@pytest.mark.parametrize("grace", [60.0, 0.0])
def test_one_sample_commits_beside_a_looping_gc_raise_nothing_raw(tmp_path, grace):
    """Writers commit one sample at a time while gc loops. At the default grace nothing fails;
    at ``--grace 0`` (temp files of leases and manifests taken young) a commit may only fail
    naming its samples, and every reported commit is there."""
    root = str(tmp_path / "ds")
    _make(root)
    stop = threading.Event()
    gc_errors: list[BaseException] = []

    def loop() -> None:
        while not stop.is_set():
            try:
                hsstore.gc(root, grace_s=grace)
            except HsstoreError:
                continue
            except BaseException as exc:  # noqa: BLE001 - counted as a failure below
                gc_errors.append(exc)

    t = threading.Thread(target=loop)
    t.start()
    published, refused, raw = set(), set(), []
    try:
        for i in range(20):
            name = f"s{i}"
            try:
                with hsstore.open(root).writer() as w:
                    w.add(name, *_sample(name))
                published.add(name)
            except SegmentRemovedError as exc:
                assert grace == 0 and exc.sample_ids == (name,)
                refused.add(name)
            except Exception as exc:  # noqa: BLE001 - what the test is about
                raw.append(exc)
    finally:
        stop.set()
        t.join(30)
    assert raw == [] and gc_errors == []
    _check(root, published, refused)


# -- 9: "failed" commits that landed ----------------------------------------------------------
class _Outage:
    """Every call fails for ``seconds`` after the manifest create (which lands, its reply
    lost): the storage went away just as the server acted."""

    def __init__(self, seconds: float):
        self.seconds = seconds
        self.until = 0.0

    def __call__(self, call: Call) -> Fault | None:
        if self.until == 0.0 and call.verb == "put_if_absent" and "manifests/v0" in call.key:
            self.until = time.monotonic() + self.seconds
            return Fault("lose")
        if time.monotonic() < self.until:
            return Fault("fail")
        return None


def test_a_commit_whose_reply_was_lost_in_an_outage_reports_it_landed(location):
    _make(location)
    storage = _faulty(location, _Outage(1.0))
    w = hsstore.open(storage).writer(lease_ttl_s=5)
    w.add("a", *_sample("a"))
    published = w.commit()  # resolved once the storage answers again
    w.close()
    assert published is not None and published.version == 2 and "a" in hsstore.open(location)
    _check(location, {"a"})


def test_an_outage_longer_than_the_resolve_window_is_resolved_by_committing_again(
    location, monkeypatch
):
    monkeypatch.setenv("HSSTORE_RESOLVE_TIMEOUT", "0.3")
    _make(location)
    storage = _faulty(location, _Outage(1.5))
    w = hsstore.open(storage).writer(lease_ttl_s=5)
    w.add("a", *_sample("a"))
    with pytest.raises(CommitUnknownError, match="commit again"):
        w.commit()
    time.sleep(1.5)
    published = w.commit()  # the same commit: learns it landed, raises no DuplicateSampleError
    w.close()
    assert published is not None and published.version == 2
    _check(location, {"a"})


def test_a_create_that_failed_before_it_was_sent_is_sent_again(location):
    _make(location)
    storage = _faulty(location, at("put_if_absent", "manifests/v00000002", Fault("fail")))
    w = hsstore.open(storage).writer(lease_ttl_s=TTL)
    w.add("a", *_sample("a"))
    assert w.commit().version == 2
    w.close()
    _check(location, {"a"})


def test_a_published_segment_removed_behind_the_protocol_is_named(tmp_path):
    """Something that ignores the protocol (a hand deletion, an old gc) removes a segment just
    as its commit lands: the writer's check after publishing names exactly its samples."""
    root = str(tmp_path / "ds")
    _make(root)
    real = open_storage(root)

    def plan(call: Call) -> Fault | None:
        if call.verb == "put_if_absent" and "manifests/v00000002" in call.key:
            seg = next(n for n in real.list(paths.SEGMENTS) if n != "zarr.json")
            os.remove(os.path.join(root, paths.segment_file(seg, "index.parquet")))
        return None

    w = hsstore.open(FaultyStorage(real, plan)).writer(lease_ttl_s=TTL)
    w.add("a", *_sample("a"))
    w.add("b", *_sample("b"))
    with pytest.raises(SegmentRemovedError, match="version 2 was published") as caught:
        w.commit()
    w.close()
    assert set(caught.value.sample_ids) == {"a", "b"} and caught.value.published == 2


# -- 1 on the wire: obstore's own retries behind a proxy that loses replies ----------------
@pytest.mark.parametrize("action", ["drop", "reset", "stall"])
@pytest.mark.parametrize(
    ("method", "part"),
    [
        ("PUT", "manifests/v00000002.json"),
        ("PUT", "/.writing"),
        ("PUT", "/index.parquet"),
        ("PUT", "/zarr.json"),
    ],
)
def test_replies_lost_on_the_wire(remote, monkeypatch, action, method, part):
    """The server stores the object, the proxy drops (or resets, or stalls) its answer, obstore
    resends and gets 412 (409 on Azure) for a conditional create: the writer goes on and its
    commit is reported published. On S3, GCS (through its gateway) and Azure Blob."""
    _make(remote.url)
    proxy = WireProxy(remote.server.endpoint, once(action, method, part), stall_s=0.5)
    try:
        for name, value in remote.server.env().items():  # the same server, through the proxy
            monkeypatch.setenv(name, value.replace(remote.server.endpoint, proxy.endpoint))
        w = hsstore.open(remote.url).writer(lease_ttl_s=5)
        w.add("a", *_sample("a"))
        published = w.commit()
        w.close()
    finally:
        proxy.close()
    assert [a[0] for a in proxy.acted] == [action], proxy.acted
    assert published is not None and published.version == 2
    for name, value in remote.server.env().items():
        monkeypatch.setenv(name, value)
    _check(remote.url, {"a"})
