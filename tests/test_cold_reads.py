"""Reads of data that is not in the page cache: a read asks the kernel for the bytes it is about
to decode and nothing else (no readahead window around the first page fault), a compressed read
chunk by chunk a little ahead of its decoding, the loader a whole batch ahead."""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch

import hsstore
from hsstore import LayerSpec
from hsstore.loader import Loader
from hsstore.loader.fetch import BatchFetcher
from hsstore.storage import read_ahead
from hsstore.storage.local_store import LocalStorage
from tests.page_cache import PAGE, cached_pages, evict, evictable
from tools.synthetic import llm_like_states


def test_will_read_brings_exactly_the_ranges_into_the_page_cache(tmp_path):
    store = LocalStorage(tmp_path)
    data = np.random.default_rng(0).integers(0, 256, 16 << 20, dtype=np.uint8).tobytes()
    store.write_file("shard", [data])
    store.sync(["shard"])
    if not evictable(tmp_path / "shard"):
        pytest.skip("this file system keeps clean pages cached (tmpfs)")
    # Larger than one hint piece, and two ranges: every byte of both must arrive.
    ranges = [(1 << 20, 3 << 20), (8 << 20, (3 << 19) + 100)]
    store.will_read("shard", ranges)
    wanted = {p for start, n in ranges for p in range(start // PAGE, -(-(start + n) // PAGE))}
    deadline = time.monotonic() + 10
    while not wanted <= set(cached_pages(tmp_path / "shard")):
        assert time.monotonic() < deadline, "hinted pages never arrived"
        time.sleep(0.01)
    got = set(cached_pages(tmp_path / "shard"))
    assert not got & set(range((12 << 20) // PAGE, (16 << 20) // PAGE))  # nothing past them
    (got,) = store.read_ranges("shard", [(9 << 20, 100)])
    assert bytes(got) == data[9 << 20 : (9 << 20) + 100]


@pytest.fixture
def probed(tmp_path) -> Iterator[tuple[Path, int]]:
    """A 4 MiB file on disk and a descriptor of it, on a file system and kernel where the page
    cache can be emptied and probed with `cachestat`."""
    store = LocalStorage(tmp_path)
    store.write_file("f", [bytes(4 << 20)])
    store.sync(["f"])
    if not evictable(tmp_path / "f"):
        pytest.skip("this file system keeps clean pages cached (tmpfs)")
    fd = os.open(tmp_path / "f", os.O_RDONLY)
    try:
        if read_ahead.cachestat_pages(fd, 0) is None:
            pytest.skip("this kernel has no cachestat (Linux 6.5+)")
        yield tmp_path / "f", fd
    finally:
        os.close(fd)


def test_the_page_cache_probe_looks_without_reading(probed):
    """Whether a page is cached is asked of the kernel without reading it: a probe that read
    the page (a non-blocking read starts the read of what it misses) could find it arrived on
    a fast device and call a cold range cached, and its hint would never be given."""
    path, fd = probed
    for _ in range(20):
        evict(path)
        assert not read_ahead.resident(fd, 1 << 20, 1 << 20)
        assert cached_pages(path) == []
    os.pread(fd, 1, 1 << 20)
    assert read_ahead.cached(fd, 1 << 20)


def test_a_range_with_a_cold_middle_is_not_resident(probed):
    """Residency is judged on every page of a range, not on its ends: a range whose middle
    left the page cache is hinted again."""
    _, fd = probed
    os.preadv(fd, [bytearray(4 << 20)], 0)
    assert read_ahead.resident(fd, 0, 4 << 20)
    os.posix_fadvise(fd, 1 << 20, 1 << 20, os.POSIX_FADV_DONTNEED)
    assert read_ahead.cached(fd, 0) and read_ahead.cached(fd, (4 << 20) - 1)
    assert not read_ahead.resident(fd, 0, 4 << 20)
    assert read_ahead.resident(fd, 3 << 20, 1 << 20)


def test_will_read_leaves_cached_ranges_alone_and_takes_no_ranges(tmp_path):
    store = LocalStorage(tmp_path)
    store.write_file("f", [b"x" * 10000])
    store.will_read("f", [])
    store.will_read("f", [(0, 10000)])  # cached: probed, nothing else
    out = memoryview(bytearray(10000))
    assert [bytes(got) for got in store.read_ranges("f", [(0, 10000)], [out])] == [b"x" * 10000]


@pytest.mark.parametrize("codec", ["split-zstd", "none"])
def test_a_cold_read_of_one_sample_reads_only_that_sample(tmp_path, codec):
    """The reads of a sample of ~110 kB from a 20 MB shard file bring in that sample's chunks,
    not the device's readahead window around them (8 MiB on some machines), and decode the
    written bits."""
    root = tmp_path / "ds"
    ds = hsstore.create(root, layers=[LayerSpec(1), LayerSpec(2)], hidden_size=1024,
                        dtype=torch.bfloat16, codec=codec)  # fmt: skip
    samples = [llm_like_states(48, 2, 1024, seed=k) for k in range(100)]
    with ds.writer() as w:
        for k, states in enumerate(samples):
            w.add(f"s{k}", torch.arange(48), torch.ones(48, dtype=torch.int64), states)
    ds = hsstore.open(root, read_threads=1)
    ds.read(0)  # loads the shard index
    ds.close()  # and lets go of the pages it mapped (the next read maps the files again)
    shards = sorted(p for p in root.rglob("*") if p.is_file() and "/states/c/" in p.as_posix())
    assert len(shards) == 1 and shards[0].stat().st_size > 12 << 20
    if not evictable(shards[0]):
        pytest.skip("this file system keeps clean pages cached (tmpfs)")
    k = 60
    out = torch.empty(48, 2, 1024, dtype=torch.bfloat16)
    ds.read_hidden_into(k, out)
    assert torch.equal(out.view(torch.int16), samples[k].view(torch.int16))
    pages = cached_pages(shards[0])
    sample_bytes = 48 * 2 * 1024 * 2
    assert pages and len(pages) * PAGE <= sample_bytes + 64 * PAGE, len(pages)
    ds.close()


@pytest.fixture
def hints(monkeypatch) -> list[tuple[int, int, int]]:
    """The read hints this process gives the kernel, as (fd, offset, nbytes) (each still given)."""
    given: list[tuple[int, int, int]] = []
    advise = os.posix_fadvise

    def logged(fd: int, offset: int, nbytes: int, advice: int) -> None:
        given.append((fd, offset, nbytes))
        advise(fd, offset, nbytes, advice)

    monkeypatch.setattr(os, "posix_fadvise", logged)
    return given


def test_a_cold_compressed_read_asks_for_its_chunks_in_order_a_few_at_a_time(tmp_path, hints):
    """Asked for all at once, a sample's chunks share the disk and arrive together, so the
    decoding waits for the last; asked in order, each arrives while an earlier one decodes.
    The first hint is the first chunk alone, each chunk is asked for once, and a warm read
    asks for nothing."""
    root = tmp_path / "ds"
    ds = hsstore.create(root, layers=[LayerSpec(1), LayerSpec(2)], hidden_size=1024,
                        dtype=torch.bfloat16, codec="split-zstd")  # fmt: skip
    samples = [llm_like_states(t, 2, 1024, seed=t) for t in (704, 900)]
    with ds.writer() as w:
        for k, states in enumerate(samples):
            t = states.shape[0]
            w.add(f"s{k}", torch.arange(t), torch.ones(t, dtype=torch.int64), states)
    ds = hsstore.open(root, read_threads=1)
    reader = ds.segment_reader(0)
    rpc = reader.manifest.layout.rows_per_chunk
    first, last = 704 // rpc, (1604 - 1) // rpc  # sample 1's row chunks
    assert 704 % rpc == 0 and last - first >= 3 and last < reader.manifest.layout.chunks_per_shard
    index = reader.shard_index(0)
    wanted = [index.chunk(c, 0) for c in range(first, last + 1)]
    assert all(nbytes < 1 << 20 for _, nbytes in wanted)  # one hint piece each
    ds.read(0)  # loads the shard index
    ds.close()
    shard = next(p for p in root.rglob("*") if p.is_file() and "/states/c/" in p.as_posix())
    if not evictable(shard):
        pytest.skip("this file system keeps clean pages cached (tmpfs)")
    hints.clear()
    out = torch.empty(900, 2, 1024, dtype=torch.bfloat16)
    ds.read_hidden_into(1, out)
    assert torch.equal(out.view(torch.int16), samples[1].view(torch.int16))
    assert len({fd for fd, _, _ in hints}) == 1  # the one shard
    assert [(offset, nbytes) for _, offset, nbytes in hints] == wanted  # each once, in order
    hints.clear()
    ds.read_hidden_into(1, out)  # warm
    assert hints == []
    ds.close()


def failing(*args: object, **kwargs: object) -> None:
    raise OSError(5, "Input/output error")


@pytest.mark.parametrize("codec", ["split-zstd", "none"])
def test_failing_hints_fail_no_read(tmp_path, codec, monkeypatch):
    """A hint is advice: when the storage cannot take it, reads (per sample, and the loader's,
    which hints a batch ahead) return the written bits all the same."""
    root = tmp_path / "ds"
    ds = hsstore.create(root, layers=[LayerSpec(1), LayerSpec(2)], hidden_size=256,
                        dtype=torch.bfloat16, codec=codec)  # fmt: skip
    samples = [llm_like_states(40 + 30 * k, 2, 256, seed=k) for k in range(6)]
    with ds.writer() as w:
        for k, states in enumerate(samples):
            t = states.shape[0]
            w.add(f"s{k}", torch.arange(t), torch.ones(t, dtype=torch.int64), states)
    # Every read hint, and every probe of whether bytes are in the page cache, fails.
    monkeypatch.setattr(os, "posix_fadvise", failing)
    monkeypatch.setattr(read_ahead, "resident", failing)
    monkeypatch.setattr(read_ahead, "ends_cached", failing)
    ds = hsstore.open(root, read_threads=1)
    for k in (3, 0, 5):
        ds.close()  # maps the files again, so the reads start cold
        got = ds.read(k).hidden
        assert torch.equal(got.view(torch.int16), samples[k].view(torch.int16))
    loader = Loader(ds, max_tokens=300, shuffle=False, num_threads=1, prefetch=1)
    seen = 0
    for batch in loader:  # packed: [1, max_tokens], the samples back to back
        at = 0
        for k, n in zip(batch["sample_index"].tolist(), batch["lengths"].tolist(), strict=True):
            got = batch["per_layer_hidden_states"][0, at : at + n]
            assert torch.equal(got.view(torch.int16), samples[k].view(torch.int16))
            at, seen = at + n, seen + 1
    loader.close()
    assert seen == len(samples)


def test_the_loader_reads_its_next_batch_from_disk_while_it_decodes_this_one(tmp_path, hints):
    """While the loader decodes a batch, the chunks of the next are already asked of the disk:
    by the time the first batch is handed over, the kernel has a hint for every page of the
    second (uncompressed, so no per-sample hint is involved). What a hint brings in is
    `test_will_read_brings_exactly_the_ranges_into_the_page_cache`'s to check."""
    root = tmp_path / "ds"
    ds = hsstore.create(root, layers=[LayerSpec(1), LayerSpec(2)], hidden_size=1024,
                        dtype=torch.bfloat16, codec="none")  # fmt: skip
    samples = [llm_like_states(48, 2, 1024, seed=k) for k in range(100)]
    with ds.writer() as w:
        for k, states in enumerate(samples):
            w.add(f"s{k}", torch.arange(48), torch.ones(48, dtype=torch.int64), states)
    loader = Loader(root, max_tokens=4 * 48, shuffle=False, num_threads=1, prefetch=1)
    shard = next(p for p in root.rglob("*") if p.is_file() and "/states/c/" in p.as_posix())
    if not evictable(shard):
        pytest.skip("this file system keeps clean pages cached (tmpfs)")
    reader = loader.source.ds._readers[0]
    rpc = reader.manifest.layout.rows_per_chunk
    chunks = reader.shard_index(0).entries[60 * 48 // rpc : -(-64 * 48 // rpc), 0]  # samples 60-63
    far = set(range(int(chunks[0, 0]) // PAGE, -(-int(chunks[-1].sum()) // PAGE)))
    tokens = np.full(4, 48)
    held = threading.Event()

    def batches():
        yield np.arange(4), tokens  # the start of the shard
        yield np.arange(60, 64), tokens  # 11 MB further on, 7 MB before its end
        held.wait(30)  # the loader asks for the batch after that before it decodes 60-63

    def hinted() -> set[int]:
        return {
            p for _, offset, n in hints for p in range(offset // PAGE, -(-(offset + n) // PAGE))
        }

    hints.clear()
    fetcher = BatchFetcher(loader.source, loader.choice, loader.shape, batches(), num_threads=1)
    try:
        first = next(fetcher)
        assert first.sample_index.tolist() == [0, 1, 2, 3]
        assert far <= hinted(), "the next batch's chunks were not asked of the disk ahead"
        held.set()
        second = next(fetcher)
        assert second.sample_index.tolist() == [60, 61, 62, 63]
        rows = second.hidden.reshape(-1, 2, 1024)
        assert torch.equal(rows.view(torch.int16), torch.cat(samples[60:64]).view(torch.int16))
    finally:
        held.set()
        fetcher.close()


def test_will_read_refuses_positions_and_layers_a_read_would_refuse(tmp_path):
    root = tmp_path / "ds"
    ds = hsstore.create(root, layers=[LayerSpec(1), LayerSpec(2)], hidden_size=64,
                        dtype=torch.bfloat16)  # fmt: skip
    with ds.writer() as w:
        for k in range(3):
            w.add(f"s{k}", torch.arange(5), torch.ones(5, dtype=torch.int64),
                  llm_like_states(5, 2, 64, seed=k))  # fmt: skip
    ds = hsstore.open(root)
    ds.will_read([])
    ds.will_read(np.array([2, 0, -1]), layers=[1])  # negative positions count from the end
    with pytest.raises(IndexError, match="sample 3 out of range"):
        ds.will_read([0, 3])
    with pytest.raises(IndexError, match="layer position 2 out of range"):
        ds.will_read([0], layers=[2])
    assert torch.equal(ds.read(2, layers=[1]).hidden, ds.read(2).hidden[:, 1:])


def test_will_read_on_object_storage_does_nothing_and_reads_stay_right(s3_url):
    ds = hsstore.create(s3_url, layers=[LayerSpec(1)], hidden_size=64, dtype=torch.bfloat16)
    states = llm_like_states(40, 1, 64, seed=1)
    with ds.writer() as w:
        w.add("s0", torch.arange(40), torch.ones(40, dtype=torch.int64), states)
    ds = hsstore.open(s3_url)
    ds.will_read([0])
    assert torch.equal(ds[0].hidden.view(torch.int16), states.view(torch.int16))


def test_a_hint_over_a_damaged_shard_index_leaves_the_report_to_the_read(tmp_path):
    root = tmp_path / "ds"
    ds = hsstore.create(root, layers=[LayerSpec(1)], hidden_size=64, dtype=torch.bfloat16)
    with ds.writer() as w:
        w.add("s0", torch.arange(40), torch.ones(40, dtype=torch.int64), llm_like_states(40, 1, 64))
    shard = next(p for p in root.rglob("*") if p.is_file() and "/states/c/" in p.as_posix())
    data = bytearray(shard.read_bytes())
    data[-8] ^= 0xFF  # inside the shard index, under its crc32c
    shard.write_bytes(bytes(data))
    ds = hsstore.open(root)
    ds.will_read([0])
    with pytest.raises(hsstore.IntegrityError, match="shard index"):
        ds.read(0)
