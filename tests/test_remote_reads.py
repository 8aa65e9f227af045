"""The read-request path: coalesced chunk reads (local, s3://, gs://, az://) and the local cache
of a remote dataset (bounded, and never serving a damaged copy)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

import hsstore
from hsstore import LayerSpec
from hsstore.errors import IntegrityError
from hsstore.format.locations import open_storage
from hsstore.format.object_store import ObjectStorage
from hsstore.format.store import LocalStorage, Storage
from hsstore.format.store_cache import DIGEST_SUFFIX
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


class CountingStorage(LocalStorage):
    """Local storage that counts the read requests the segment reader makes (without memory
    maps, so that chunks are read by request)."""

    def __init__(self, root: str, coalesce_bytes: int):
        super().__init__(root)
        self.coalesce_bytes = coalesce_bytes
        self.single_reads = 0
        self.range_calls = 0

    def read_into(self, key: str, offset: int, out: memoryview) -> int:
        if "/states/" in key:
            self.single_reads += 1
        return super().read_into(key, offset, out)

    def map(self, key: str) -> None:
        return None  # every chunk is a request, as on a storage that cannot map files

    def read_ranges_into(self, key: str, requests: list[tuple[int, memoryview]]) -> list[int]:
        self.range_calls += 1
        return super().read_ranges_into(key, requests)


def test_coalesced_reads_are_bit_identical_to_per_chunk_reads_locally(tmp_path):
    root = str(tmp_path / "ds")
    _make(root)
    per_chunk = CountingStorage(root, coalesce_bytes=0)
    expected = _all_reads(per_chunk)
    assert per_chunk.range_calls == 0
    for cap in (1, 3000, 64 << 20):  # one chunk per call, a few, a whole shard
        coalesced = CountingStorage(root, coalesce_bytes=cap)
        got = _all_reads(coalesced)
        assert len(got) == len(expected)
        assert all(torch.equal(a, b) for a, b in zip(got, expected, strict=True))
        assert coalesced.range_calls > 0
        # read_into is left for the shard indexes (and runs a pread each per range)
        if cap == 64 << 20:
            assert coalesced.range_calls < per_chunk.single_reads / 2


def test_coalesced_reads_are_bit_identical_on_object_stores(remote_url, tmp_path):
    _make(remote_url)
    local_root = str(tmp_path / "local")
    _make(local_root)
    expected = _all_reads(LocalStorage(local_root))
    remote = open_storage(remote_url)
    assert isinstance(remote, ObjectStorage) and remote.coalesce_bytes > 0
    for cap in (1, 3000, remote.coalesce_bytes):
        remote.coalesce_bytes = cap
        got = _all_reads(remote)
        assert all(torch.equal(a, b) for a, b in zip(got, expected, strict=True))


def test_read_ranges_into_splits_long_ranges_and_fills_each_buffer(remote_url, monkeypatch):
    import hsstore.format.object_store as object_store

    monkeypatch.setattr(object_store, "SPLIT_BYTES", 1000)
    storage = open_storage(remote_url)
    blob = os.urandom(10_000)
    storage.write_file("segments/x/states/c/0/0/0", [blob])
    bufs = [memoryview(bytearray(n)) for n in (3500, 1, 999, 2000)]
    offsets = [10, 5000, 6001, 8000]
    got = storage.read_ranges_into("segments/x/states/c/0/0/0", list(zip(offsets, bufs)))
    assert got == [3500, 1, 999, 2000]
    for off, buf in zip(offsets, bufs, strict=True):
        assert bytes(buf) == blob[off : off + len(buf)]


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
