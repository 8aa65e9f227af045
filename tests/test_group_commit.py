"""Group commit on the real local storage: writers that lose a race leave intents, and one
version publishes several writers' commits; each writer learns its outcome by its token.

Each schedule is pinned with pauses at named storage calls (tests.faults), so which writer
leads and who waits is decided by the test, not by timing."""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path

import pytest
import torch

import hsstore
from hsstore import LayerSpec
from hsstore.commits import intents
from hsstore.errors import CommitUnknownError, DuplicateSampleError, SegmentRemovedError
from hsstore.spec import paths
from hsstore.storage.locations import open_storage
from tests.faults import Call, Fault, FaultyStorage, at
from tools.synthetic import random_sample

H = 16


def _create(path: Path | str) -> None:
    hsstore.create(path, layers=[LayerSpec(1), LayerSpec(2)], hidden_size=H,
                   dtype=torch.bfloat16)  # fmt: skip


def _delta(path: Path | str, version: int) -> dict:
    return json.loads(open_storage(str(path)).read_bytes(paths.manifest_key(version)))


class _Stops:
    """Pauses a storage at the calls a test names, one after another."""

    def __init__(self, path: Path | str):
        self.storage = FaultyStorage(open_storage(str(path)))
        self.reached = threading.Event()
        self.release = threading.Event()

    def at(self, verb: str, key: str, *, heartbeat: bool = False) -> threading.Event:
        """Stop at the next ``verb`` on ``key``; ``heartbeat``: also stop every lease refresh
        once the writer has left its intent (a stopped process refreshes nothing). Returns the
        previous stop's release, for the caller to set once this one is in place."""
        previous = self.release
        self.reached, self.release = threading.Event(), threading.Event()
        first = at(
            verb, key, Fault("pause", seconds=30, release=self.release, reached=self.reached)
        )
        beat = Fault("pause", seconds=30, release=self.release)  # not the stop waited for
        waiting = threading.Event()

        def plan(call: Call) -> Fault | None:
            if call.verb == "put" and call.key.startswith(paths.INTENTS):
                waiting.set()
            lease = call.verb == "put" and call.key.endswith(paths.WRITING_LOCK)
            if heartbeat and lease and waiting.is_set():
                return beat
            return first(call)

        self.storage.plan = plan
        return previous

    def wait_at(self, verb: str, key: str, *, heartbeat: bool = False) -> None:
        """Let the writer go on from its current stop to the next ``verb`` on ``key``."""
        self.at(verb, key, heartbeat=heartbeat).set()
        assert self.reached.wait(10), f"never reached {verb} {key}"

    def go(self) -> None:
        self.release.set()


def _commit_in_thread(writer, results: dict, name: str) -> threading.Thread:
    def run() -> None:
        try:
            results[name] = writer.commit()
        except BaseException as exc:  # noqa: BLE001 - asserted by the test
            results[name] = exc

    thread = threading.Thread(target=run)
    thread.start()
    return thread


def test_a_leader_publishes_a_waiting_writers_intent_in_its_version(tmp_path):
    path = tmp_path / "ds"
    _create(path)
    a, b = _Stops(path), _Stops(path)
    wa = hsstore.open(a.storage).writer(encode_threads=1)
    wb = hsstore.open(b.storage).writer(encode_threads=1)
    wa.add("a", *random_sample(4, 2, H, seed=1))
    wb.add("b", *random_sample(5, 2, H, seed=2))
    # A and B both hold version 1 and are stopped right before creating version 2.
    a.at("put_if_absent", "manifests/v")
    b.at("put_if_absent", "manifests/v")
    results: dict = {}
    threads = [_commit_in_thread(wa, results, "a"), _commit_in_thread(wb, results, "b")]
    assert a.reached.wait(10) and b.reached.wait(10)
    with hsstore.open(path).writer(encode_threads=1) as wc:  # C takes version 2
        wc.add("c", *random_sample(3, 2, H, seed=3))
    # A loses its create, leaves an intent and is stopped when it lists the intents, so it
    # cannot lead: B, losing too, publishes A's intent with its own commit.
    first = a.release
    a.at("list", paths.INTENTS)
    first.set()
    assert a.reached.wait(10)
    intent_a = json.loads(next((path / paths.INTENTS).glob("*.json")).read_bytes())
    b.go()
    threads[1].join(10)
    assert results["b"].version == 3
    a.go()
    threads[0].join(10)
    assert results["a"].version == 3  # A learnt its outcome from B's version

    v3 = _delta(path, 3)
    assert v3["group"] == [intent_a["commit"]] and v3["commit"] != intent_a["commit"]
    ids = [seg["id"] for seg in v3["add_segments"]]
    assert len(ids) == 2 and ids[1] == intent_a["add_segments"][0]["id"]  # the leader's first
    ds = hsstore.open(path)
    assert sorted(ds.sample_ids) == ["a", "b", "c"] and ds.manifest.version == 3
    assert list((path / paths.INTENTS).iterdir()) == []  # the leader dropped them
    assert hsstore.verify(path, full=True).ok
    for name, seed, n in (("a", 1, 4), ("b", 2, 5), ("c", 3, 3)):
        assert torch.equal(ds.get(name).hidden, random_sample(n, 2, H, seed=seed)[2])
    wa.close()
    wb.close()


# -- the schedules below: A (and B) lose their create of version 2 to C and wait ---------------


# -- the schedules below: A (and B) lose their create of the next version to C and wait ------


def _writer(stops: _Stops, *samples: tuple[str, int], **options):
    """A writer on ``stops``' storage holding ``samples`` (name, seed) of 4 tokens each."""
    w = hsstore.open(stops.storage).writer(encode_threads=1, **options)
    for name, seed in samples:
        w.add(name, *random_sample(4, 2, H, seed=seed))
    return w


def _race(path: Path | str, writers: dict, theirs: tuple[str, int]) -> tuple[dict, dict]:
    """Commit each of ``writers`` ({name: (stops, writer)}) on a thread, all stopped right
    before creating the next version, which C then takes with sample ``theirs``."""
    for stops, _ in writers.values():
        stops.at("put_if_absent", "manifests/v")
    results: dict = {}
    threads = {name: _commit_in_thread(w, results, name) for name, (_, w) in writers.items()}
    for stops, _ in writers.values():
        assert stops.reached.wait(10)
    with hsstore.open(path).writer(encode_threads=1) as wc:
        wc.add(theirs[0], *random_sample(4, 2, H, seed=theirs[1]))
    return results, threads


def _finish(stops: _Stops, threads: dict, name: str) -> None:
    stops.go()
    threads[name].join(10)
    assert not threads[name].is_alive(), f"{name} did not finish"


class _Scene:
    """A and B (unless ``b`` is None) commit samples (name, seed) on threads, both stopped
    right before creating version 2, which C takes with ``c``."""

    def __init__(self, path: Path | str, a, b=(("b", 2),), *, c=("c", 3), **a_options):
        self.path = path
        _create(self.path)
        self.a, self.b = _Stops(self.path), _Stops(self.path)
        self.wa = _writer(self.a, *a, **a_options)
        self.wb = _writer(self.b, *b) if b is not None else None
        racers = {"a": (self.a, self.wa)}
        if self.wb is not None:
            racers["b"] = (self.b, self.wb)
        self.results, self.threads = _race(self.path, racers, c)

    def a_waits(self, *, heartbeat: bool = False) -> tuple[str, dict]:
        """A loses its create, leaves its intent and stops as it first lists the intents (so
        it cannot lead; ``heartbeat``: its leases stop too). Returns A's token and intent."""
        self.a.wait_at("list", paths.INTENTS, heartbeat=heartbeat)
        ((token, intent),) = _intents(self.path).items()
        return token, intent

    def finish(self, name: str):
        """Let ``name`` ("a" or "b") go on to the end; what its commit returned or raised."""
        _finish(self.a if name == "a" else self.b, self.threads, name)
        return self.results[name]

    def close(self) -> None:
        for w in (self.wa, self.wb):
            if w is not None:
                w.close()


def _intents(path: Path | str) -> dict[str, dict]:
    """The intents waiting now, by token."""
    storage = open_storage(str(path))
    try:
        names = storage.list(paths.INTENTS)
    except FileNotFoundError:
        return {}
    return {
        token: json.loads(storage.read_bytes(f"{paths.INTENTS}/{name}"))
        for name in names
        if (token := paths.intent_token(name))
    }


def _intent_key(path: Path | str, token: str) -> str:
    """Where ``token``'s intent is waiting."""
    return intents.waiting(open_storage(str(path)))[token]


def _segment_folders(path: Path) -> set[str]:
    return {p.name for p in (path / paths.SEGMENTS).iterdir() if paths.is_segment_id(p.name)}


def _assert_holds(path: Path | str, expected: dict[str, int]) -> hsstore.Dataset:
    """The dataset holds exactly ``expected`` ({name: seed}), each once and bit-exact, and
    verifies."""
    ds = hsstore.open(path)
    assert sorted(ds.sample_ids) == sorted(expected)
    assert len(ds.sample_ids) == len(set(ds.sample_ids))
    for name, seed in expected.items():
        assert torch.equal(ds.get(name).hidden, random_sample(4, 2, H, seed=seed)[2]), name
    assert hsstore.verify(path, full=True).ok
    return ds


def test_an_intent_sharing_an_id_with_the_leaders_commit_is_refused_when_its_writer_leads(
    tmp_path,
):
    s = _Scene(tmp_path / "ds", a=(("a", 1), ("x", 11)), b=(("x", 12),))
    token_a, intent_a = s.a_waits()
    segment_a = intent_a["add_segments"][0]["id"]
    assert s.finish("b").version == 3  # B holds "x" too and leads: A's intent is left out
    v3 = _delta(s.path, 3)
    assert v3.get("group", []) == [] and v3["commit"] != token_a
    assert segment_a not in [seg["id"] for seg in v3["add_segments"]]
    assert _intents(s.path) == {}  # B dropped A's intent (and its own)
    err = s.finish("a")  # A leads, checks its ids exactly and refuses
    assert isinstance(err, DuplicateSampleError), err
    assert err.sample_id == "x" and "'x'" in str(err) and "nothing" in str(err)
    ds = _assert_holds(s.path, {"c": 3, "x": 12})  # "x" once: B's bytes
    assert ds.manifest.version == 3
    assert segment_a not in _segment_folders(s.path)  # A aborted: its files are gone
    assert _segment_folders(s.path) == {seg.id for seg in ds.manifest.segments}
    assert _intents(s.path) == {}
    s.close()


def test_a_commit_sharing_an_id_with_the_version_that_beat_its_create_leaves_no_intent(
    tmp_path,
):
    """C's version 2 holds "x", which A's commit holds too: A's create of version 2 loses, and
    A refuses before it leaves an intent (one would be checked only after version 2)."""
    s = _Scene(tmp_path / "ds", a=(("a", 1), ("x", 11)), c=("x", 13))
    err = s.finish("a")
    assert isinstance(err, DuplicateSampleError) and err.sample_id == "x", err
    assert _intents(s.path) == {}
    assert s.finish("b").version == 3
    assert _delta(s.path, 3).get("group", []) == []
    _assert_holds(s.path, {"b": 2, "x": 13})  # "x" once: C's bytes
    assert _intents(s.path) == {}
    s.close()


def test_a_writer_that_saw_other_writers_versions_joins_a_group_without_racing_alone(tmp_path):
    """Others published since A last looked: A leaves its intent before any create (and, alone
    in the group, leads it); once a commit of A's saw nobody else publish, A creates its next
    version directly."""
    path = tmp_path / "ds"
    _create(path)
    calls: list[tuple[str, str]] = []

    def record(call: Call) -> None:
        if call.verb in ("put", "put_if_absent") and call.key.startswith(paths.MANIFESTS):
            calls.append((call.verb, call.key))

    wa = hsstore.open(FaultyStorage(open_storage(str(path)), record)).writer(encode_threads=1)
    with hsstore.open(path).writer(encode_threads=1) as wc:  # C takes version 2
        wc.add("c", *random_sample(4, 2, H, seed=3))
    wa.add("a", *random_sample(4, 2, H, seed=1))
    assert wa.commit().version == 3
    creates = [key for verb, key in calls if verb == "put_if_absent" and "/v" in key]
    intent_puts = [i for i, (verb, key) in enumerate(calls) if key.startswith(paths.INTENTS)]
    assert creates == [paths.manifest_key(3)]  # no create of version 2 lost to C
    assert len(intent_puts) == 1 and intent_puts[0] < calls.index(("put_if_absent", creates[0]))
    v3 = _delta(path, 3)
    assert v3.get("group", []) == [] and v3["commit"].startswith(wa.leases.owner)
    for version, seed, intent_calls in ((4, 2, ["put"]), (5, 4, [])):
        calls.clear()
        wa.add(f"a{version}", *random_sample(4, 2, H, seed=seed))
        assert wa.commit().version == version
        assert [verb for verb, key in calls if key.startswith(paths.INTENTS)] == intent_calls
    assert _intents(path) == {}
    _assert_holds(path, {"c": 3, "a": 1, "a4": 2, "a5": 4})
    wa.close()


def test_an_intent_whose_segment_gc_condemned_is_never_published(tmp_path):
    s = _Scene(tmp_path / "ds", a=(("a", 1), ("a2", 4)), lease_ttl_s=0.2)
    token_a, intent_a = s.a_waits(heartbeat=True)  # A stopped whole: its lease lapses
    segment_a = intent_a["add_segments"][0]["id"]
    time.sleep(0.6)
    # gc condemns A's segment (version 3) and is stopped before it sweeps the intents.
    g = _Stops(s.path)
    g.at("list", paths.INTENTS)
    swept: dict = {}
    gc = threading.Thread(target=lambda: swept.update(r=hsstore.gc(g.storage, grace_s=0)))
    gc.start()
    assert g.reached.wait(10)
    assert _delta(s.path, 3)["condemn"] == [segment_a]
    assert segment_a not in _segment_folders(s.path)
    assert s.finish("b").version == 4  # B leads after gc's version, leaving A's intent out
    v4 = _delta(s.path, 4)
    assert v4.get("group", []) == [] and len(v4["add_segments"]) == 1
    assert token_a not in _intents(s.path)
    g.go()
    gc.join(10)
    assert swept["r"].removed_segments == [segment_a]
    err = s.finish("a")
    assert isinstance(err, SegmentRemovedError), err
    assert err.published is None and sorted(err.sample_ids) == ["a", "a2"]
    assert "'a'" in str(err) and "nothing was published" in str(err)
    ds = _assert_holds(s.path, {"b": 2, "c": 3})
    assert ds.manifest.version == 4
    assert _intents(s.path) == {}
    s.close()


@pytest.mark.parametrize("publisher", ["another leader", "its own writer"])
def test_an_unknown_outcome_while_the_intent_waits_is_learnt_by_committing_again(
    tmp_path, monkeypatch, publisher
):
    monkeypatch.setenv("HSSTORE_RESOLVE_TIMEOUT", "0.3")
    by_b = publisher == "another leader"
    s = _Scene(tmp_path / "ds", a=(("a", 1),), b=(("b", 2),) if by_b else None)
    token_a, _ = s.a_waits()
    reads = ("read_bytes", "list", "exists", "stat")
    s.a.storage.plan = lambda call: Fault("fail") if call.verb in reads else None
    err = s.finish("a")  # every read fails for longer than the resolve timeout
    assert isinstance(err, CommitUnknownError), err
    assert token_a in str(err) and "commit again" in str(err)
    assert token_a in _intents(s.path)  # nothing was deleted: a leader may still publish it
    expected = {"a": 1, "c": 3}
    if by_b:
        assert s.finish("b").version == 3 and _delta(s.path, 3)["group"] == [token_a]
        expected["b"] = 2
    else:
        assert not (s.path / paths.manifest_key(3)).exists()
    s.a.storage.plan = None  # the storage answers again
    assert s.wa.commit().version == 3
    v3 = _delta(s.path, 3)
    assert token_a in [v3["commit"], *v3.get("group", [])]
    assert _assert_holds(s.path, expected).manifest.version == 3
    assert _intents(s.path) == {}
    s.close()


def test_a_damaged_intent_is_passed_over_and_its_writer_publishes_its_own_copy(tmp_path):
    s = _Scene(tmp_path / "ds", a=(("a", 1),))
    token_a, _ = s.a_waits()
    intent_file = s.path / _intent_key(s.path, token_a)
    data = bytearray(intent_file.read_bytes())
    data[len(data) // 2] ^= 0x01  # one bit flipped, still text
    intent_file.write_bytes(bytes(data))
    assert s.finish("b").version == 3  # B passes it over and drops it
    assert _delta(s.path, 3).get("group", []) == [] and _intents(s.path) == {}
    assert s.finish("a").version == 4  # A leads and publishes the copy it holds
    v4 = _delta(s.path, 4)
    assert v4["commit"] == token_a and v4.get("group", []) == []
    _assert_holds(s.path, {"a": 1, "b": 2, "c": 3})
    assert _intents(s.path) == {}
    s.close()


@pytest.mark.parametrize("where", ["local", "s3"])
def test_a_writer_that_dies_while_its_intent_waits_still_has_it_published_once(
    tmp_path, request, where
):
    location = tmp_path / "ds" if where == "local" else f"{request.getfixturevalue('s3_url')}/ds"
    s = _Scene(location, a=(("a", 1), ("a2", 4)))
    everyone = {"a": 1, "a2": 4, "b": 2, "c": 3}
    try:
        token_a, intent_a = s.a_waits(heartbeat=True)  # A never runs again (until the end)
        assert s.finish("b").version == 3 and _delta(s.path, 3)["group"] == [token_a]
        ds = _assert_holds(s.path, everyone)
        assert intent_a["add_segments"][0]["id"] in {seg.id for seg in ds.manifest.segments}
        assert _intents(s.path) == {}
        # Its segment is published, so gc never takes it for debris, however dead A is.
        assert hsstore.gc(s.path, grace_s=0).removed_segments == []
        _assert_holds(s.path, everyone)
    finally:
        s.a.go()
    assert s.finish("a").version == 3  # woken, A learns its outcome from B's version
    assert hsstore.open(s.path).manifest.version == 3
    s.close()


def test_gc_deletes_the_intents_no_version_can_publish_and_keeps_a_waiting_writers(tmp_path):
    # P waits and B publishes P's intent, but B's deletes of intents fail: both stay behind.
    s = _Scene(tmp_path / "ds", a=(("p", 5),))
    token_p, _ = s.a_waits()
    stopped_b = s.b.storage.plan
    s.b.storage.plan = lambda call: (
        Fault("fail") if call.verb == "delete" and paths.INTENTS in call.key else stopped_b(call)
    )
    assert s.finish("b").version == s.finish("a").version == 3
    assert _delta(s.path, 3)["group"] == [token_p]
    published = set(_intents(s.path))
    assert token_p in published and len(published) == 2  # P's and B's own
    # A (lease lapses) and D (lease live) lose their creates of version 4 to E and wait.
    a, d = _Stops(s.path), _Stops(s.path)
    wa = _writer(a, ("a", 1), lease_ttl_s=0.2)
    wd = _writer(d, ("d", 6))
    results, threads = _race(s.path, {"a": (a, wa), "d": (d, wd)}, ("e", 7))
    a.wait_at("list", paths.INTENTS, heartbeat=True)
    (token_a,) = set(_intents(s.path)) - published
    d.wait_at("list", paths.INTENTS)
    (token_d,) = set(_intents(s.path)) - published - {token_a}
    time.sleep(0.6)  # A's lease lapses
    keys = {t: _intent_key(s.path, t) for t in (*published, token_a)}
    report = hsstore.gc(s.path, grace_s=0)
    assert len(report.removed_segments) == 1  # A's
    assert sorted(report.removed_files) == sorted(keys.values())
    assert set(_intents(s.path)) == {token_d}  # D's lease is live: it may still be published
    _finish(d, threads, "d")
    assert results["d"].version == 6  # after gc's version 5
    _finish(a, threads, "a")
    assert isinstance(results["a"], SegmentRemovedError), results["a"]
    _assert_holds(s.path, {"b": 2, "c": 3, "d": 6, "e": 7, "p": 5})
    assert _intents(s.path) == {}
    s.close()
    wa.close()
    wd.close()


def test_a_commit_whose_intent_put_lost_its_reply_is_never_reported_failed(tmp_path, monkeypatch):
    """A's intent is written but the reply is lost, and then A cannot read the versions: the
    intent may be published by another leader, so A must not say "nothing was published"."""
    monkeypatch.setenv("HSSTORE_RESOLVE_TIMEOUT", "0.3")
    s = _Scene(tmp_path / "ds", a=(("a", 1),))
    lost = threading.Event()

    def plan(call: Call) -> Fault | None:
        if call.verb == "put" and paths.INTENTS in call.key and not lost.is_set():
            lost.set()
            return Fault("lose")  # the intent is written; A hears an error
        if lost.is_set() and call.verb == "read_bytes" and call.key.startswith("manifests/v"):
            return Fault("fail")
        return None

    s.a.storage.plan = plan
    err = s.finish("a")
    assert lost.is_set() and len(_intents(s.path)) == 1
    if isinstance(err, BaseException):
        assert isinstance(err, CommitUnknownError), f"{type(err).__name__}: {err}"
    assert s.finish("b").version == 3  # B leads and may publish A's intent
    s.a.storage.plan = None
    if isinstance(err, CommitUnknownError):
        assert s.wa.commit().version == 3
    _assert_holds(s.path, {"a": 1, "b": 2, "c": 3})
    assert _intents(s.path) == {}
    s.close()


def test_waiting_writers_take_turns_by_arrival_not_by_token(tmp_path):
    # A writer arriving while a leader builds its group must find itself behind that leader,
    # whatever its random token, or it leads a second group racing the first.
    hsstore.create(tmp_path / "ds", layers=[LayerSpec(1)], hidden_size=H, dtype=torch.float32)
    storage = open_storage(str(tmp_path / "ds"))
    early, late, unstamped = "f" * 32 + ".1", "0" * 32 + ".1", "a" * 32 + ".7"
    storage.put(paths.intent_key(late, 1_796_000_000_001), b"{}")
    storage.put(paths.intent_key(early, 1_796_000_000_000), b"{}")
    storage.put(f"{paths.INTENTS}/{unstamped}.json", b"{}")  # a name with no arrival
    storage.put(f"{paths.INTENTS}/{'0' * 32}.json", b"{}")  # no intent's name
    listed = intents.waiting(storage)
    assert list(listed) == [unstamped, early, late]
    assert listed[early] == paths.intent_key(early, 1_796_000_000_000)
    assert storage.read_bytes(listed[unstamped]) == b"{}"
