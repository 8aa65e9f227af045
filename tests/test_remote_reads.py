"""The read-request path: ranged reads (local, s3://, gs://, az://) and the local cache
of a remote dataset (bounded, and never serving a damaged copy)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

import hsstore
from hsstore import LayerSpec
from hsstore.errors import IntegrityError
from hsstore.storage.local_store import LocalStorage
from hsstore.storage.locations import open_storage
from hsstore.storage.object_store import ObjectStorage
from hsstore.storage.store import Storage
from hsstore.storage.store_cache import DIGEST_SUFFIX
from tools.synthetic import random_sample

N = 24


def _make(location: str | Storage, codec: str = "blosc-zstd") -> None:
    ds = hsstore.create(location, layers=[LayerSpec(d) for d in range(1, 5)], hidden_size=32,
                        dtype=torch.bfloat16, codec=codec, chunk_bytes=2048, shard_bytes=16384,
                        layers_per_chunk=2)  # fmt: skip
    with ds.writer(segment_bytes=1 << 16) as w:
        for i in range(N):
            w.add(f"s-{i}", *random_sample(20 + (i * 13) % 90, 4, 32, seed=i))


def _all_reads(storage: Storage) -> list[torch.Tensor]:
    """Every sample whole, one layer alone, and a layer from each layer chunk."""
    ds = hsstore.open(storage)
    got = []
    for i in range(N):
        got.append(ds[i].hidden.view(torch.int16).clone())
        got.append(ds.read(i, layers=[2]).hidden.view(torch.int16).clone())
        got.append(ds.read(i, layers=[0, 3]).hidden.view(torch.int16).clone())
    return got


def _check_ranges(storage: Storage, key: str, *, past_end: bool) -> None:
    """`read_ranges` returns each range's bytes in the order asked, as views and into buffers:
    ranges back to back, a few bytes apart, far apart, one byte, and (``past_end``) one that
    runs past the end of the object, which comes back short."""
    blob = os.urandom(10_000)
    storage.write_file(key, [blob])
    ranges = [(10, 3500), (3510, 1), (3515, 999), (8000, 1500), (4514, 7)]
    if past_end:
        ranges.append((9990, 50))
    expected = [blob[offset : offset + nbytes] for offset, nbytes in ranges]
    assert [bytes(v) for v in storage.read_ranges(key, ranges)] == expected
    bufs = [memoryview(bytearray(nbytes)) for _, nbytes in ranges]
    assert [bytes(v) for v in storage.read_ranges(key, ranges, bufs)] == expected
    assert [bytes(b[: len(e)]) for b, e in zip(bufs, expected, strict=True)] == expected


def test_local_read_ranges_returns_each_range_in_order(tmp_path):
    _check_ranges(LocalStorage(tmp_path), "segments/x/states/c/0/0/0", past_end=True)


def test_object_store_read_ranges_batches_splits_and_fills_each_range(remote_url, monkeypatch):
    import hsstore.storage.object_store as object_store

    monkeypatch.setattr(object_store, "SPLIT_BYTES", 1000)
    monkeypatch.setattr(object_store, "GAP_BYTES", 4)
    storage = open_storage(remote_url)
    assert isinstance(storage, ObjectStorage)
    for batch_bytes in (1, 3000, 1 << 20):  # one range per batch, a few, all of them
        storage.batch_bytes = batch_bytes
        _check_ranges(storage, f"segments/x/states/c/0/0/{batch_bytes}", past_end=True)


def test_reads_are_bit_identical_on_object_stores_whatever_the_batches(remote_url, tmp_path):
    _make(remote_url)
    local_root = str(tmp_path / "local")
    _make(local_root)
    expected = _all_reads(LocalStorage(local_root))
    remote = open_storage(remote_url)
    assert isinstance(remote, ObjectStorage)
    for batch_bytes in (1, 3000, remote.batch_bytes):
        remote.batch_bytes = batch_bytes
        got = _all_reads(remote)
        assert all(torch.equal(a, b) for a, b in zip(got, expected, strict=True))


@pytest.mark.parametrize("cached", [False, True])
def test_many_ranges_of_several_objects_come_back_whole_and_in_place(
    remote_url, tmp_path, monkeypatch, cached
):
    """`read_many_into` on an object store: a `read_ranges` per run of one object's ranges,
    or, with a cache, one call of the local disk over the local copies; either way the bytes
    asked, up to the first range an object does not hold whole."""
    storage = ObjectStorage(remote_url, cache_dir=str(tmp_path / "cache") if cached else None)
    blobs = {f"segments/x/states/c/0/0/{k}": os.urandom(5000 + k) for k in range(3)}
    for key, blob in blobs.items():
        storage.write_file(key, [blob])
    keys = list(blobs)
    reads, at = [], 0
    for k, offset, nbytes in [(0, 10, 100), (0, 200, 50), (1, 0, 5001), (2, 4990, 12), (0, 0, 1)]:
        reads.append((keys[k], offset, nbytes, at))
        at += nbytes
    local_calls = []
    read_many_into = LocalStorage.read_many_into
    monkeypatch.setattr(LocalStorage, "read_many_into",
                        lambda self, *a: local_calls.append(a) or read_many_into(self, *a))  # fmt: skip
    into = bytearray(at + 100)
    assert storage.read_many_into(reads, memoryview(into)) == len(reads)
    for key, offset, nbytes, place in reads:
        assert into[place : place + nbytes] == blobs[key][offset : offset + nbytes]
    assert len(local_calls) == int(cached)
    past_the_end = [*reads[:3], (keys[1], 4990, 100, at), *reads[3:]]
    assert storage.read_many_into(past_the_end, memoryview(bytearray(at + 100))) == 3


def _cached_files(cache: Path) -> list[Path]:
    return [
        p
        for p in cache.rglob("*")
        if p.is_file() and "/states/c/" in str(p) and not p.name.endswith(DIGEST_SUFFIX)
    ]


def test_cache_stays_within_its_byte_budget(remote_url, tmp_path):
    _make(remote_url)
    expected = _all_reads(open_storage(remote_url))
    cache = tmp_path / "cache"
    budget = 40_000
    storage = ObjectStorage(remote_url, cache_dir=str(cache), cache_bytes=budget)
    got = _all_reads(storage)
    assert all(torch.equal(a, b) for a, b in zip(got, expected, strict=True))
    total_shards = sum(
        info.size
        for seg in hsstore.open(remote_url).manifest.segments
        for rel, info in seg.files.items()
        if rel.startswith("states/c/")
    )
    assert total_shards > 2 * budget  # so eviction had to happen
    on_disk = sum(p.stat().st_size for p in cache.rglob("*") if p.is_file())
    digests = sum(p.stat().st_size for p in cache.rglob(f"*{DIGEST_SUFFIX}"))
    assert 0 < on_disk - digests <= budget
    assert len(list(cache.rglob(f"*{DIGEST_SUFFIX}"))) == len(_cached_files(cache))


def _flip_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 3] ^= 0x40
    path.write_bytes(bytes(data))


@pytest.mark.parametrize("codec", ["blosc-zstd", "none"])
def test_damaged_cached_file_is_fetched_again(remote_url, tmp_path, codec):
    _make(remote_url, codec)
    expected = _all_reads(open_storage(remote_url))
    cache = tmp_path / "cache"
    _all_reads(ObjectStorage(remote_url, cache_dir=str(cache)))
    files = _cached_files(cache)
    assert files
    for path in files:
        _flip_byte(path)
    damaged = {p: p.read_bytes() for p in files}
    # A later run (a new storage, as in a new process) checks each copy before using it.
    got = _all_reads(ObjectStorage(remote_url, cache_dir=str(cache)))
    assert all(torch.equal(a, b) for a, b in zip(got, expected, strict=True))
    assert all(p.read_bytes() != damaged[p] for p in files)


def test_cached_file_damaged_while_in_use_fails_clearly(remote_url, tmp_path):
    _make(remote_url)
    cache = tmp_path / "cache"
    storage = ObjectStorage(remote_url, cache_dir=str(cache))
    _all_reads(storage)
    for path in _cached_files(cache):
        _flip_byte(path)
    storage.close()  # drop open descriptors so the damaged bytes are what a read sees
    ds = hsstore.open(storage)
    with pytest.raises(IntegrityError) as err:
        for i in range(N):
            ds[i]
    assert remote_url in str(err.value) and "\n" not in str(err.value)
