"""Many byte ranges read in one call: `pread_spans` (C, no interpreter lock), the storage's
`read_many_into` (the local disk's, and the default every other backend inherits), and a
batch of uncompressed samples read a few MiB at a time (`RawSamplesRead`), on the loader's
pipeline thread where it has one. A range the batch read does not get whole is read again
sample by sample, whose read names the problem."""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import torch

import hsstore
import hsstore.dataset.dataset
import hsstore.loader.fetch as fetch
import hsstore.segment.rows as segment_rows
import hsstore.storage.local_store as local_store
from hsstore import LayerSpec
from hsstore.dataset import batch_reads
from hsstore.errors import IntegrityError
from hsstore.loader import Loader
from hsstore.storage._pread_many import pread_spans
from hsstore.storage.local_store import LocalStorage
from tests.faults import FaultyStorage

H = 32
LAYERS = [LayerSpec(depth=d) for d in (1, 2, 3)]


def _files(root: Path, sizes: dict[str, int]) -> dict[str, bytes]:
    rng = np.random.default_rng(5)
    data = {}
    for name, size in sizes.items():
        data[name] = rng.integers(0, 256, size, dtype=np.uint8).tobytes()
        (root / name).write_bytes(data[name])
    return data


def _spans(rows: list[tuple[int, int, int, int]]) -> np.ndarray:
    return np.array(rows, np.int64).reshape(-1, 4)


def test_pread_spans_reads_every_range_whole_into_its_place(tmp_path):
    data = _files(tmp_path, {"a": 70_000, "b": 5_000})
    fds = {name: os.open(tmp_path / name, os.O_RDONLY) for name in data}
    try:
        rng = np.random.default_rng(0)
        rows, want, at = [], bytearray(), 0
        for _ in range(200):
            name = "ab"[int(rng.integers(0, 2))]
            offset = int(rng.integers(0, len(data[name])))
            n = int(rng.integers(0, len(data[name]) - offset + 1))  # empty ranges too
            rows.append((fds[name], offset, n, at))
            want += data[name][offset : offset + n]
            at += n
        into = bytearray(at + 7)
        assert pread_spans(_spans(rows), into) == len(rows)
        assert bytes(into[:at]) == bytes(want) and into[at:] == bytes(7)
    finally:
        for fd in fds.values():
            os.close(fd)


def test_pread_spans_stops_at_the_first_range_its_file_does_not_hold_whole(tmp_path):
    data = _files(tmp_path, {"a": 1000})
    fd = os.open(tmp_path / "a", os.O_RDONLY)
    closed = os.open(tmp_path / "a", os.O_RDONLY)
    os.close(closed)
    try:
        into = bytearray(400)
        past_the_end = [(fd, 0, 100, 0), (fd, 950, 100, 100), (fd, 0, 10, 200)]
        assert pread_spans(_spans(past_the_end), into) == 1
        assert bytes(into[:100]) == data["a"][:100]
        assert into[200:210] == bytes(10)  # nothing after the range that came back short
        no_descriptor = [(fd, 0, 10, 0), (fd, 10, 10, 10), (closed, 0, 10, 20)]
        assert pread_spans(_spans(no_descriptor), into) == 2
    finally:
        os.close(fd)


@pytest.mark.parametrize(
    "row",
    [(-1, 0, 1, 0), (3, -1, 1, 0), (3, 0, -1, 0), (3, 0, 1, -1), (3, 0, 11, 90), (3, 0, 1, 100),
     (1 << 40, 0, 1, 0)],
    ids=["negative descriptor", "negative offset", "negative length", "negative place",
         "past the buffer's end", "placed past the end", "no such descriptor"],
)  # fmt: skip
def test_a_range_outside_the_buffer_is_refused_before_anything_is_read(tmp_path, row):
    _files(tmp_path, {"a": 1000})
    fd = os.open(tmp_path / "a", os.O_RDONLY)
    try:
        into = bytearray(100)
        rows = [(fd, 0, 10, 0), tuple(fd if x == 3 else x for x in row)]
        with pytest.raises(ValueError, match="outside the buffer"):
            pread_spans(_spans(rows), into)
        assert into == bytes(100)
    finally:
        os.close(fd)


def test_pread_spans_takes_only_quadruples_and_a_writable_buffer():
    with pytest.raises(ValueError, match="quadruples"):
        pread_spans(np.zeros(5, np.int64), bytearray(10))
    with pytest.raises(TypeError):
        pread_spans(np.zeros((1, 4), np.int64), bytes(10))


@pytest.mark.parametrize("past_the_end", [False, True])
def test_every_backend_reads_many_ranges_alike(tmp_path, past_the_end):
    """The local disk's one call and the default (`read_ranges` per run of one object's
    ranges, here through a wrapper that overrides nothing else) read the same bytes and stop
    at the same range."""
    root = tmp_path / "root"
    root.mkdir()
    data = _files(root, {"a": 9000, "b": 300, "c": 4000})
    reads, at = [], 0
    for key, offset, n in [("a", 10, 500), ("a", 600, 20), ("b", 0, 300), ("a", 0, 9000),
                           ("c", 3990, 10), ("c", 0, 1)]:  # fmt: skip
        reads.append((key, offset, n, at))
        at += n
    if past_the_end:
        reads.insert(3, ("b", 250, 100, at))
        at += 100
    got = []
    for storage in (LocalStorage(str(root)), FaultyStorage(LocalStorage(str(root)))):
        into = bytearray(at)
        got.append((storage.read_many_into(reads, memoryview(into)), bytes(into)))
    assert got[0][0] == got[1][0] == (3 if past_the_end else len(reads))
    for count, into in got:
        for key, offset, n, place in reads[:count]:
            assert into[place : place + n] == data[key][offset : offset + n]


def _dataset(path: Path) -> hsstore.Dataset:
    ds = hsstore.create(path, layers=LAYERS, hidden_size=H, dtype=torch.bfloat16,
                        model={"num_hidden_layers": 3, "hidden_size": H}, codec="none",
                        chunk_bytes=8 * len(LAYERS) * H * 2)  # fmt: skip
    g = torch.Generator().manual_seed(2)
    with ds.writer(segment_bytes=60_000) as w:  # several segments and shards
        for i, t in enumerate(torch.randint(3, 50, (40,), generator=g).tolist()):
            states = torch.randn(t, len(LAYERS), H, generator=g).to(torch.bfloat16)
            w.add(f"s{i}", torch.randint(0, 50, (t,), generator=g), torch.ones(t).long(), states)
    ds = hsstore.open(path)
    assert not ds.manifest.codec.compressed and len(ds.manifest.segments) > 1
    return ds


@pytest.fixture(scope="module")
def raw(tmp_path_factory) -> hsstore.Dataset:
    return _dataset(tmp_path_factory.mktemp("raw") / "ds")


def _read_all(ds: hsstore.Dataset, unchecked: list | None) -> torch.Tensor:
    """Every sample into one batch, not in storage order."""
    out = torch.full((ds.num_tokens, len(LAYERS), H), float("nan"), dtype=torch.bfloat16)
    placed, at = [], 0
    for i in reversed(range(len(ds))):
        placed.append((i, at))
        at += ds.num_tokens_of(i)
    assert batch_reads.read_hidden_many_into(ds, out, placed, unchecked=unchecked) == len(ds)
    return out


def _expected(ds: hsstore.Dataset) -> torch.Tensor:
    return torch.cat([ds[i].hidden for i in reversed(range(len(ds)))])


@pytest.mark.parametrize("verified", [True, False])
def test_a_batch_of_uncompressed_samples_takes_no_range_by_range_read(raw, monkeypatch, verified):
    """Samples whose checksums are left to the caller (or not verified) go to the storage a
    few MiB at a time (here a few KiB: many calls), never a `preadv` per range from Python."""
    ds = hsstore.open(raw.path, verify_reads=verified)
    want = _expected(ds)  # (each shard's index read now, as the reads plan)
    monkeypatch.setattr(segment_rows, "READ_MANY_BYTES", 3000)

    def refused(*args):
        raise AssertionError("a range read by itself")

    monkeypatch.setattr(local_store, "_preadv_full", refused)
    unchecked: list[tuple[int, int]] = []
    assert torch.equal(_read_all(ds, unchecked), want)
    assert sorted(i for i, _ in unchecked) == (list(range(len(raw))) if verified else [])
    # Checked as they land instead, samples are read one by one.
    with pytest.raises(AssertionError, match="by itself"):
        _read_all(raw, None)


class _ShortOnce(LocalStorage):
    """The real local disk, whose first batch read stops after ``whole`` ranges, as after a
    read error or a file that came back short."""

    def __init__(self, root: str, whole: int):
        super().__init__(root)
        self.left = [whole]

    def read_many_into(self, reads, into):
        got = super().read_many_into(reads, into)
        if self.left:
            return min(got, self.left.pop())
        return got


def test_samples_a_batch_read_did_not_get_whole_are_read_again_alone(raw, monkeypatch):
    want = _expected(raw)
    alone: list[int] = []
    read_alone = batch_reads._read_alone

    def spy(ds, np_out, i, first):
        alone.append(i)
        return read_alone(ds, np_out, i, first)

    monkeypatch.setattr(batch_reads, "_read_alone", spy)
    ds = hsstore.open(_ShortOnce(raw.path, whole=20))
    unchecked: list[tuple[int, int]] = []
    assert torch.equal(_read_all(ds, unchecked), want)
    batch_reads.check_decoded(ds, want, unchecked)
    # The samples from the one whose range failed on were read alone, each once.
    assert len(alone) == len(set(alone)) and 0 < len(alone) < len(raw)


def _flip_a_byte_of(ds: hsstore.Dataset, victim: int) -> None:
    reader = ds.segment_reader(int(ds.index["segment"][victim].as_py()))
    row = int(ds.index["row_offset"][victim].as_py())
    (key, ranges), *_ = segment_rows.raw_rows_plan(reader, row, row + ds.num_tokens_of(victim))
    with open(ds.storage.path_of(key), "r+b") as f:
        f.seek(ranges[0][0] + 5)
        byte = f.read(1)
        f.seek(-1, 1)
        f.write(bytes([byte[0] ^ 0x10]))


@pytest.mark.parametrize("deferred", [True, False])
def test_a_flipped_byte_in_an_uncompressed_batch_names_its_sample(tmp_path, deferred):
    victim = 17
    _flip_a_byte_of(_dataset(tmp_path / "ds"), victim)
    ds = hsstore.open(tmp_path / "ds")
    unchecked: list[tuple[int, int]] | None = [] if deferred else None
    with pytest.raises(IntegrityError, match=f"s{victim}") as caught:
        out = _read_all(ds, unchecked)
        batch_reads.check_decoded(ds, out, unchecked or [])
    assert "checksum" in str(caught.value)


def test_the_loader_reads_uncompressed_batches_on_its_pipeline_thread(raw, monkeypatch):
    """With one decode thread and a core to spare, the producer plans each batch and the
    pipeline's thread reads it, in a few calls per batch: the batches are the dataset's."""
    monkeypatch.setattr(segment_rows, "HANDED_OFF_READ_BYTES", 5000)
    readers: list[str] = []
    read_many_into = LocalStorage.read_many_into

    def spy(self, reads, into):
        readers.append(threading.current_thread().name)
        return read_many_into(self, reads, into)

    monkeypatch.setattr(LocalStorage, "read_many_into", spy)
    loader = Loader(raw.path, max_tokens=200, shuffle=True, seed=1, num_threads=1,
                    decode_path="pipelined")  # fmt: skip
    seen = []
    for batch in loader:
        states, at = batch["per_layer_hidden_states"][0], 0
        for i, n in zip(batch["sample_index"].tolist(), batch["lengths"].tolist(), strict=True):
            assert torch.equal(states[at : at + n], raw[i].hidden)
            seen.append(i)
            at += n
    loader.close()
    assert sorted(seen) == list(range(len(raw)))
    assert readers and all(name.startswith("hsstore-decode") for name in readers)


def test_the_checker_verifies_samples_while_the_pipeline_reads_the_rest(raw, monkeypatch):
    """Each sample of a batch checked once, on the checker's thread, in parts as the
    pipeline's reads end rather than the whole batch after its last read."""
    monkeypatch.setattr(segment_rows, "HANDED_OFF_READ_BYTES", 1)  # a read per sample
    per_batch: list[list[list[int]]] = []  # the checker's calls for each batch, in order
    check_after, check_decoded = fetch.BatchFetcher._check_after, batch_reads.check_decoded

    def batch_spy(self, *args):
        per_batch.append([])
        return check_after(self, *args)

    def spy(ds, out, unchecked):
        unchecked = list(unchecked)
        assert threading.current_thread().name.startswith("hsstore-check")
        if unchecked:
            per_batch[-1].append([i for i, _ in unchecked])
        return check_decoded(ds, out, unchecked)

    read_many_into = LocalStorage.read_many_into

    def slow_read(self, reads, into):  # the disk slower than the checker, whatever the machine
        time.sleep(0.02)
        return read_many_into(self, reads, into)

    monkeypatch.setattr(fetch.BatchFetcher, "_check_after", batch_spy)
    monkeypatch.setattr(batch_reads, "check_decoded", spy)
    monkeypatch.setattr(LocalStorage, "read_many_into", slow_read)
    loader = Loader(raw.path, max_tokens=400, shuffle=True, seed=2, num_threads=1,
                    decode_path="pipelined")  # fmt: skip
    delivered = [batch["sample_index"].tolist() for batch in loader]
    loader.close()  # (the next epoch's first batches may be decoded and checked by now)
    assert len(delivered) > 1
    for samples, calls in zip(delivered, per_batch, strict=False):
        assert sorted(i for part in calls for i in part) == sorted(samples)
        assert len(calls) > 1 or len(samples) == 1


def test_a_flipped_byte_is_named_by_the_loader_that_checks_as_it_reads(tmp_path, monkeypatch):
    monkeypatch.setattr(segment_rows, "HANDED_OFF_READ_BYTES", 2000)
    _flip_a_byte_of(_dataset(tmp_path / "ds"), 23)
    loader = Loader(tmp_path / "ds", max_tokens=400, shuffle=True, seed=2, num_threads=1,
                    decode_path="pipelined")  # fmt: skip
    with pytest.raises(IntegrityError, match="s23") as caught:
        for _ in loader:
            pass
    loader.close()
    assert "checksum" in str(caught.value)
