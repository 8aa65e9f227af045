"""Group commit on the real local storage: writers that lose a race leave intents, and one
version publishes several writers' commits; each writer learns its outcome by its token.

Each schedule is pinned with pauses at named storage calls (tests.faults), so which writer
leads and who waits is decided by the test, not by timing."""

from __future__ import annotations

import json
import threading
from pathlib import Path

import torch

import hsstore
from hsstore import LayerSpec
from hsstore.spec import paths
from hsstore.storage.local_store import LocalStorage
from tests.faults import Fault, FaultyStorage, at
from tools.synthetic import random_sample

H = 16


def _create(path: Path) -> None:
    hsstore.create(path, layers=[LayerSpec(1), LayerSpec(2)], hidden_size=H,
                   dtype=torch.bfloat16)  # fmt: skip


def _delta(path: Path, version: int) -> dict:
    return json.loads((path / paths.manifest_key(version)).read_bytes())


class _Stops:
    """Pauses a storage at the calls a test names, one after another."""

    def __init__(self, path: Path):
        self.storage = FaultyStorage(LocalStorage(str(path)))
        self.reached = threading.Event()
        self.release = threading.Event()

    def at(self, verb: str, key: str) -> None:
        self.reached, self.release = threading.Event(), threading.Event()
        self.storage.plan = at(
            verb, key, Fault("pause", seconds=30, release=self.release, reached=self.reached)
        )

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
