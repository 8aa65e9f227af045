"""I/O errors on a local disk: an EIO that persists is damage and stays in the samples of the
file it hits (open leaves them out or raises naming them, verify lists them, repair drops
exactly them); an EIO that a retry gets past is not damage and costs nothing. Injected by
`tests.faults.FaultyStorage` around the real `LocalStorage`."""

from __future__ import annotations

import errno

import pytest
import torch
from click.testing import CliRunner

import hsstore
from hsstore.cli import main
from hsstore.dataset import integrity
from hsstore.storage import damage
from hsstore.storage.local_store import LocalStorage
from hsstore.storage.locations import open_storage
from tests.faults import Call, Fault, FaultyStorage, at
from tests.test_repair_beside_writer import _build, _sample

READS = ("read_bytes", "read_ranges", "size")


@pytest.fixture(autouse=True)
def quick_retries(monkeypatch):
    monkeypatch.setattr(damage, "EIO_RETRY_WAITS_S", (0.01, 0.02, 0.05))


def _eio_on(location: str, part: str) -> FaultyStorage:
    """Every read of a key containing ``part`` fails with EIO, however often it is tried."""

    def plan(call: Call) -> Fault | None:
        return Fault("fail") if call.verb in READS and part in call.key else None

    return FaultyStorage(open_storage(location), plan)


def _names(seg: int) -> set[str]:
    return {f"c{seg}-s{i}" for i in range(2)}


@pytest.mark.parametrize("file", ["index.parquet", "states/c/"])
def test_a_persistent_eio_costs_exactly_the_samples_of_its_file(tmp_path, file):
    location = str(tmp_path / "ds")
    seg = _build(location, 3).manifest.segments[1]
    # The index and its copy (both unreadable: the samples cannot be located at all).
    faulty = _eio_on(location, f"{seg.id}/{file.replace('.parquet', '')}")
    ds = hsstore.open(faulty)
    if file == "index.parquet":  # no sample of it can be located: the segment is left out
        assert "I/O error" in ds.unreadable[seg.id] and seg.id in ds.unreadable[seg.id]
        assert set(ds.sample_ids) == _names(0) | _names(2)
    else:  # located, but their states do not read: each raises naming itself
        for name in _names(1):
            with pytest.raises(hsstore.IntegrityError, match="I/O error") as info:
                ds.get(name)
            assert info.value.sample_id == name
    for name in _names(0) | _names(2):
        assert torch.equal(ds.get(name).hidden, _sample(name)[2])

    report = hsstore.verify(faulty)
    assert not report.ok
    named = set(report.bad_samples) | {
        s for p in report.problems for s in p.sample_ids
    }  # the samples verify names, whichever way the damage shows
    if file == "index.parquet":
        assert list(report.unreadable_segments) == [seg.id]
    else:
        assert named == _names(1)

    fixed = hsstore.repair(faulty)
    dropped = [r for r in fixed.repairs if r["action"] == "dropped"]
    assert [(r["segment"], r["num_samples"]) for r in dropped] == [(seg.id, 2)]
    assert "I/O error" in dropped[0]["reason"]
    after = hsstore.open(location)  # the disk healthy again: the repaired version stands
    assert set(after.sample_ids) == _names(0) | _names(2)
    assert hsstore.verify(location).ok


def test_a_transient_eio_is_not_damage(tmp_path):
    location = str(tmp_path / "ds")
    seg = _build(location, 3).manifest.segments[1]
    for verb, part in (("read_bytes", "index.parquet"), ("read_ranges", "states/c/")):
        # Two failures in a row, then the disk answers again.
        faulty = FaultyStorage(
            open_storage(location), at(verb, f"{seg.id}/{part}", Fault("fail"), times=2)
        )
        ds = hsstore.open(faulty)
        assert not ds.unreadable
        for name in _names(0) | _names(1) | _names(2):
            assert torch.equal(ds.get(name).hidden, _sample(name)[2])
        faulty = FaultyStorage(
            open_storage(location), at(verb, f"{seg.id}/{part}", Fault("fail"), times=2)
        )
        assert hsstore.verify(faulty).ok
        faulty = FaultyStorage(
            open_storage(location), at(verb, f"{seg.id}/{part}", Fault("fail"), times=2)
        )
        assert hsstore.repair(faulty).version is None
    assert len(hsstore.open(location)) == 6


def test_verify_prints_a_persistent_eio_in_one_line(tmp_path, monkeypatch):
    location = str(tmp_path / "ds")
    seg = _build(location, 2).manifest.segments[0]
    faulty = _eio_on(location, f"{seg.id}/index")  # the index and its copy
    monkeypatch.setattr(integrity, "open_storage", lambda path: faulty)
    result = CliRunner().invoke(main, ["verify", location])
    assert result.exit_code == 1
    lines = [line for line in result.output.splitlines() if "UNREADABLE" in line]
    assert len(lines) == 1 and seg.id in lines[0], result.output
    assert "index.parquet: cannot read: I/O error" in lines[0]
    assert "Traceback" not in result.output


def test_repair_keeps_a_segment_whose_io_errors_stop_before_it_publishes(tmp_path):
    location = str(tmp_path / "ds")
    seg = _build(location, 3).manifest.segments[1]
    # The index fails through two whole rounds of retries (the repair's first check finds
    # it damaged), then reads again: a glitch, which must not cost its samples.
    faulty = FaultyStorage(
        open_storage(location),
        at("read_bytes", f"{seg.id}/index.parquet", Fault("fail"), times=8),
    )
    assert hsstore.repair(faulty).version is None
    assert faulty.tally.counts["fail"] == 8
    assert len(hsstore.open(location)) == 6 and hsstore.verify(location).ok


class FailsMidRead(LocalStorage):
    """The real local storage, whose reads of states fail with EIO on their second range
    (after the first was handed out) the first ``times`` times: a read that fails part-way,
    which no retry of the whole call covers."""

    def __init__(self, root: str, times: int):
        super().__init__(root)
        self.left, self.failures = times, 0

    def read_ranges(self, key, ranges, into=None):
        views = super().read_ranges(key, ranges, into)
        return views if into is not None or "states/c/" not in key else self._failing(key, views)

    def _failing(self, key, views):
        for k, view in enumerate(views):
            if k == 1 and self.left:
                self.left, self.failures = self.left - 1, self.failures + 1
                raise OSError(errno.EIO, "Input/output error", self.path_of(key))
            yield view


@pytest.mark.parametrize("times", [2, 100])
def test_an_eio_part_way_through_a_read_is_retried_from_the_range_it_hit(tmp_path, times):
    location = str(tmp_path / "ds")
    ds = hsstore.create(location, layers=[hsstore.LayerSpec(depth=1), hsstore.LayerSpec(depth=2)],
                        hidden_size=64, dtype=torch.bfloat16, chunk_bytes=1024)  # fmt: skip
    states = {f"s{i}": torch.randn(20 + i, 2, 64).to(torch.bfloat16) for i in range(3)}
    with ds.writer() as w:
        for name, hidden in states.items():  # several chunks per sample: several ranges
            w.add(
                name, torch.arange(len(hidden)), torch.ones(len(hidden), dtype=torch.int64), hidden
            )
    storage = FailsMidRead(location, times)
    ds = hsstore.open(storage)
    if times == 2:  # a glitch: every sample reads, bit for bit
        for name, hidden in states.items():
            assert torch.equal(ds.get(name).hidden, hidden)
        assert storage.failures == 2
    else:  # persistent: damage, named
        with pytest.raises(hsstore.IntegrityError, match="I/O error on each of 4 tries"):
            ds.get("s0")
        assert storage.failures == 4
