"""One read of a large compressed sample decodes shares of its chunks on several threads: the
same bits and the same checks as a read on one thread, also in a forked child."""

from __future__ import annotations

import multiprocessing
import pickle
import threading
from pathlib import Path

import numpy as np
import pytest
import torch

import hsstore
from hsstore import LayerSpec
from hsstore.dataset import batch_reads
from hsstore.segment import row_reads
from tools.synthetic import random_sample

# 128-byte rows, 16-row chunks, 128-row shards: the 520-row sample spans 33 chunks in 5 shards.
LENGTHS = [300, 17, 520, 64, 1]
BIG = "s2"


@pytest.fixture(autouse=True)
def small_shares(monkeypatch):
    """Shares of a few chunks, so these small samples are split as LLM-sized ones are."""
    monkeypatch.setattr(row_reads, "PARALLEL_MIN_BYTES", 1024)


def _build(
    path: Path | str, dtype: torch.dtype = torch.bfloat16, *, sample_aligned: bool | None = None
) -> list[torch.Tensor]:
    ds = hsstore.create(path, layers=[LayerSpec(1), LayerSpec(3)], hidden_size=32, dtype=dtype,
                        codec="split-zstd", chunk_bytes=2048, shard_bytes=16384,
                        sample_aligned=sample_aligned)  # fmt: skip
    states = []
    with ds.writer() as w:
        for i, t in enumerate(LENGTHS):
            ids, mask, hidden = random_sample(t, 2, 32, seed=i)
            if dtype == torch.float8_e4m3fn:
                scale = torch.rand(t, generator=torch.Generator().manual_seed(i)) + 0.5
                hidden = (hidden.float() / scale[:, None, None]).to(dtype)
                w.add(f"s{i}", ids, mask, hidden, scales=scale)
            else:
                w.add(f"s{i}", ids, mask, hidden)
            states.append(hidden)
    return states


def _shares_of(ds: hsstore.Dataset, sample_id: str, threads: int) -> list[tuple[int, int]]:
    i = ds.position(sample_id)
    row = ds.index.column("row_offset")[i].as_py()
    return row_reads.shares_of(ds.segment_reader(0), row, row + ds.num_tokens_of(i), threads)


@pytest.mark.parametrize("threads", [2, 3, 4])
@pytest.mark.parametrize("verify", [True, False])
@pytest.mark.parametrize("aligned", [None, False])  # unaligned: shares start and end mid-chunk
def test_a_split_read_returns_the_bits_written(tmp_path, threads, verify, aligned):
    written = _build(tmp_path / "ds", sample_aligned=aligned)
    ds = hsstore.open(tmp_path / "ds", read_threads=threads, verify_reads=verify)
    assert len(_shares_of(ds, BIG, threads)) == threads
    for i, want in enumerate(written):
        got = ds.read(i).hidden
        assert torch.equal(got.view(torch.int16), want.view(torch.int16)), f"s{i}"
        out = torch.full_like(want, float("nan"))
        ds.read_hidden_into(i, out)
        assert torch.equal(out.view(torch.int16), want.view(torch.int16)), f"s{i} into out"
    assert any(t.name.startswith("hsstore-read") for t in threading.enumerate())


def test_a_split_read_from_object_storage(remote_url):
    """On an object store each share fetches its own chunks: requests of several shares are in
    flight at once."""
    written = _build(remote_url)
    ds = hsstore.open(remote_url, read_threads=4)
    assert len(_shares_of(ds, BIG, 4)) == 4
    for i, want in enumerate(written):
        assert torch.equal(ds.read(i).hidden.view(torch.int16), want.view(torch.int16)), f"s{i}"


def test_a_busy_pool_leaves_the_shares_to_the_caller(tmp_path):
    """With every pool thread held by other work, a split read neither waits for the pool nor
    fails: the caller takes back the shares still queued and decodes them itself."""
    written = _build(tmp_path / "ds")
    ds = hsstore.open(tmp_path / "ds", read_threads=4)
    pool = row_reads._READ_POOL.get(3)
    release = threading.Event()
    holders = [pool.submit(release.wait, 60) for _ in range(3)]
    try:
        finished = threading.Event()
        result: list[torch.Tensor] = []

        def read() -> None:
            result.append(ds.get(BIG).hidden)
            finished.set()

        threading.Thread(target=read, daemon=True).start()
        assert finished.wait(30), "the read waited for the busy pool"
        assert not any(h.done() for h in holders)  # the pool was busy all along
        assert torch.equal(result[0].view(torch.int16), written[2].view(torch.int16))
    finally:
        release.set()


def test_shares_cover_the_rows_once_on_chunk_boundaries(tmp_path):
    _build(tmp_path / "ds")
    ds = hsstore.open(tmp_path / "ds")
    rpc = ds.manifest.layout.rows_per_chunk
    i = ds.position(BIG)
    row = ds.index.column("row_offset")[i].as_py()
    shares = _shares_of(ds, BIG, 4)
    assert shares[0][0] == row and shares[-1][1] == row + LENGTHS[2]
    for (_, hi), (lo, _) in zip(shares, shares[1:], strict=False):
        assert hi == lo and lo % rpc == 0
    assert len(_shares_of(ds, "s4", 4)) == 1  # one row: nothing to split


def _no_pool(helpers: int):
    raise AssertionError("asked the read pool for threads")


def test_one_thread_and_batch_reads_never_use_the_pool(tmp_path, monkeypatch):
    """read_threads=1 decodes on the caller only; so do batch reads, whose caller (the loader)
    runs its own threads."""
    written = _build(tmp_path / "ds")
    monkeypatch.setattr(row_reads._READ_POOL, "get", _no_pool)
    ds = hsstore.open(tmp_path / "ds", read_threads=1)
    assert torch.equal(ds.get(BIG).hidden.view(torch.int16), written[2].view(torch.int16))
    ds4 = hsstore.open(tmp_path / "ds", read_threads=4)
    out = torch.empty(LENGTHS[2], 2, 32, dtype=torch.bfloat16)
    assert batch_reads.read_hidden_many_into(ds4, out, [(ds4.position(BIG), 0)]) == 1
    assert torch.equal(out.view(torch.int16), written[2].view(torch.int16))
    with pytest.raises(AssertionError, match="read pool"):
        ds4.get(BIG)  # the check above can fail


def test_fp8_dataset_split_read_dequantizes_the_same(tmp_path):
    _build(tmp_path / "ds", dtype=torch.float8_e4m3fn)
    one = hsstore.open(tmp_path / "ds", read_threads=1).get(BIG)
    four = hsstore.open(tmp_path / "ds", read_threads=4).get(BIG)
    assert torch.equal(one.hidden.view(torch.uint8), four.hidden.view(torch.uint8))
    assert torch.equal(one.dequantized(), four.dequantized())


def _flip_near_the_end(ds: hsstore.Dataset, sample_id: str) -> Path:
    """Flip a byte of the raw (mantissa) stream of the sample's last full chunk: in the last
    share, which a helper thread decodes."""
    layout = ds.manifest.layout
    i = ds.position(sample_id)
    last_row = ds.index.column("row_offset")[i].as_py() + ds.num_tokens_of(i) - 1
    chunk = last_row // layout.rows_per_chunk - 1
    shard = chunk // layout.chunks_per_shard
    offset, _ = ds._readers[0].shard_index(shard).chunk(chunk % layout.chunks_per_shard, 0)
    path = Path(ds.path) / "segments" / ds.manifest.segments[0].id / "states" / "c" / str(shard)
    path = path / "0" / "0"
    data = bytearray(path.read_bytes())
    low_stream = offset + 16 + 4 + 4  # blosc header, block start, the low stream's length
    values = layout.rows_per_chunk * ds.manifest.num_layers * ds.hidden_size
    assert int.from_bytes(data[low_stream - 4 : low_stream], "little") == values  # stored raw
    data[low_stream + 5] ^= 0x01
    path.write_bytes(bytes(data))
    return path


@pytest.mark.parametrize("verify", [True, False])
def test_damage_in_a_helper_threads_share_is_reported(tmp_path, verify):
    """Damage in a share decoded on a pool thread surfaces in the caller, as on one thread:
    a sample checksum mismatch (verified reads) or a chunk crc32c mismatch (unverified)."""
    _build(tmp_path / "ds")
    ds = hsstore.open(tmp_path / "ds", read_threads=4, verify_reads=verify)
    assert len(_shares_of(ds, BIG, 4)) == 4
    shard = _flip_near_the_end(ds, BIG)
    ds = hsstore.open(tmp_path / "ds", read_threads=4, verify_reads=verify)
    with pytest.raises(hsstore.IntegrityError) as info:
        ds.get(BIG)
    assert info.value.sample_id == BIG
    if verify:
        assert "sample checksum mismatch" in str(info.value)
    else:
        assert "crc32c mismatch" in str(info.value) and str(shard) in str(info.value)
    assert ds.get("s0").num_tokens == LENGTHS[0]  # the other samples still read


def test_read_threads_below_one_is_refused(tmp_path):
    _build(tmp_path / "ds")
    with pytest.raises(hsstore.BadInputError, match="read_threads"):
        hsstore.open(tmp_path / "ds", read_threads=0)


def test_read_threads_survive_pickling(tmp_path):
    _build(tmp_path / "ds")
    ds = hsstore.open(tmp_path / "ds", read_threads=3)
    assert pickle.loads(pickle.dumps(ds)).read_threads == 3


def _read_in_child(path: str, queue) -> None:
    ds = hsstore.open(path, read_threads=4)
    # numpy, not torch, sums: torch's OpenMP pool hangs in a child forked after the parent used it
    queue.put(int(ds.get(BIG).hidden.view(torch.int16).numpy().astype(np.int64).sum()))


def test_a_forked_child_reads_after_the_parent_used_the_pool(tmp_path):
    """The parent's pool threads do not exist in a forked child: it makes its own."""
    written = _build(tmp_path / "ds")
    ds = hsstore.open(tmp_path / "ds", read_threads=4)
    ds.get(BIG)  # the parent's pool is running
    ctx = multiprocessing.get_context("fork")
    queue = ctx.Queue()
    child = ctx.Process(target=_read_in_child, args=(str(tmp_path / "ds"), queue))
    child.start()
    try:
        got = queue.get(timeout=60)
    finally:
        child.join(timeout=10)
        if child.exitcode is None:
            child.kill()
    assert child.exitcode == 0
    assert got == int(written[2].view(torch.int16).numpy().astype(np.int64).sum())
