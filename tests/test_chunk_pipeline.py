"""The loader's chunk pipeline: with one decode thread and a core to spare, the producer plans
and reads each batch's compressed chunks and a thread of their own decodes them. Batches are
the bytes the dataset holds, and a failure on either side names the sample."""

from __future__ import annotations

import threading
from pathlib import Path

import numpy as np
import pytest
import torch

import hsstore
import hsstore.loader.chunk_pipeline as chunk_pipeline
from hsstore import LayerSpec
from hsstore.codec.codecs import ChunkCodec
from hsstore.errors import IntegrityError
from hsstore.loader import Loader
from hsstore.segment.row_reads import HandedOff
from hsstore.spec.dtypes import storage_view
from hsstore.storage import damage
from hsstore.storage.local_store import LocalStorage
from tests.faults import Call, Fault, FaultyStorage

H = 32
LAYERS = [LayerSpec(depth=d) for d in (1, 2, 3, 4)]
ROWS_PER_CHUNK = 8


def _loader(*args, **options) -> Loader:
    """A loader on the pipelined path whatever this machine's cores: with one decode thread,
    the fetcher then runs the chunk pipeline."""
    return Loader(*args, decode_path="pipelined", **options)


def _dataset(path: Path, tier: str | None = None) -> hsstore.Dataset:
    ds = hsstore.create(
        path,
        layers=LAYERS,
        hidden_size=H,
        dtype=torch.bfloat16,
        model={"name": "toy", "revision": None, "num_hidden_layers": 4, "hidden_size": H},
        codec="split-zstd",
        tier=tier,
        chunk_bytes=ROWS_PER_CHUNK * len(LAYERS) * H * 2,  # samples span several chunks
    )
    g = torch.Generator().manual_seed(1)
    lengths = torch.randint(5, 60, (40,), generator=g).tolist()
    with ds.writer() as w:
        for i, t in enumerate(lengths):
            states = torch.randn(t, len(LAYERS), H, generator=g).to(torch.bfloat16)
            ids = torch.randint(0, 50, (t,), generator=g)
            w.add(f"s{i}", ids, torch.ones(t, dtype=torch.int64), states)
    return hsstore.open(path)


@pytest.fixture(scope="module")
def compressed(tmp_path_factory) -> hsstore.Dataset:
    return _dataset(tmp_path_factory.mktemp("pipeline") / "ds")


def _epoch(path, threads: int) -> tuple[list[dict], set[str]]:
    loader = _loader(path, max_tokens=128, shuffle=True, seed=3, num_threads=threads)
    out, names = [], set()
    for batch in loader:
        names |= {t.name for t in threading.enumerate()}
        out.append({k: v.clone() for k, v in batch.items() if isinstance(v, torch.Tensor)})
    loader.close()
    return out, names


def _assert_same(a: list[dict], b: list[dict]) -> None:
    assert len(a) == len(b) > 1
    for x, y in zip(a, b, strict=True):
        assert x.keys() == y.keys()
        for k in x:
            assert torch.equal(x[k], y[k]), k


def test_one_decode_thread_decodes_on_its_own_thread_and_delivers_the_same_batches(compressed):
    one, names = _epoch(compressed.path, threads=1)
    two, two_names = _epoch(compressed.path, threads=2)
    assert any(n.startswith("hsstore-decode") for n in names)  # the pipeline's thread
    assert any(n.startswith("hsstore-check") for n in names)  # and the checker beside it
    _assert_same(one, two)
    # And the bytes are the dataset's own: the first batch's samples, back to back.
    raw = one[0]
    assert raw["sample_index"].numel() > 1


def test_some_layers_of_an_uncompressed_dataset_go_through_buffers_made_on_first_need(tmp_path):
    path = tmp_path / "raw"
    ds = hsstore.create(path, layers=LAYERS, hidden_size=H, dtype=torch.bfloat16, codec="none")
    g = torch.Generator().manual_seed(2)
    with ds.writer() as w:
        for i in range(12):
            states = torch.randn(20, len(LAYERS), H, generator=g).to(torch.bfloat16)
            w.add(f"s{i}", torch.arange(20), torch.ones(20, dtype=torch.int64), states)
    ds = hsstore.open(path)
    opts = {"max_tokens": 64, "shuffle": False, "aux_layers": [0, 2], "verifier": False}
    loader = _loader(path, num_threads=1, **opts)
    got = [batch["per_layer_hidden_states"].clone() for batch in loader]
    loader.close()
    want = torch.cat([ds.read(i).hidden[:, [0, 2]] for i in range(len(ds))])
    assert torch.equal(torch.cat([b[0, : 3 * 20] for b in got]), want)


def test_batches_decode_around_the_caches_and_inline_checked_reads_into_them(
    compressed, monkeypatch
):
    """Whole chunks reach a batch the checker hashes later, on another core, through the
    codec's stores around the caches; a sample read whose checksum takes each chunk as it
    lands decodes into the cache. Either way the bytes are the dataset's."""
    calls: list[tuple[str, bool]] = []
    decode_into = ChunkCodec.decode_into

    def spy(self, encoded, out, *, stream=False, **kwargs):
        calls.append((threading.current_thread().name, stream))
        return decode_into(self, encoded, out, stream=stream, **kwargs)

    monkeypatch.setattr(ChunkCodec, "decode_into", spy)
    batches, _ = _epoch(compressed.path, threads=1)
    streamed = {s for name, s in calls if name.startswith("hsstore-decode")}
    assert True in streamed  # (a sample's last chunk, cut by its end, goes through scratch)
    for batch in batches:
        states = batch["per_layer_hidden_states"][0]
        at = 0
        for i, n in zip(batch["sample_index"].tolist(), batch["lengths"].tolist(), strict=True):
            assert torch.equal(states[at : at + n], compressed[i].hidden)
            at += n
    calls.clear()
    for i in range(len(compressed)):
        compressed.read_hidden_into(i, torch.empty_like(compressed[i].hidden))
    assert calls and not any(s for _, s in calls)


def test_fp8_batches_are_dequantized_after_the_decode_thread_is_done(tmp_path):
    """An fp8 tier's batches decode in stored form and become values on the pipeline's thread,
    once its chunks are decoded: the same values as with a pool of decode threads."""
    ds = _dataset(tmp_path / "fp8", tier="fp8-token")
    assert ds.manifest.scaled and ds.manifest.codec.compressed
    one, names = _epoch(ds.path, threads=1)
    two, _ = _epoch(ds.path, threads=2)
    assert any(n.startswith("hsstore-decode") for n in names)
    _assert_same(one, two)
    assert all(b["hidden_states"].dtype == torch.bfloat16 for b in one)


@pytest.mark.parametrize("buffer_bytes", [1, 3000])
def test_chunks_larger_than_the_buffers_decode_all_the_same(compressed, monkeypatch, buffer_bytes):
    """Buffers smaller than a chunk (each chunk then gets one of its own) or than a shard's
    run of chunks (runs are cut) change nothing delivered."""
    reference, _ = _epoch(compressed.path, threads=2)
    monkeypatch.setattr(chunk_pipeline, "BUFFER_BYTES", buffer_bytes)
    got, _ = _epoch(compressed.path, threads=1)
    _assert_same(got, reference)


def test_a_run_cut_into_parts_keeps_every_chunk_in_order(compressed):
    reader = compressed.segment_reader(0)
    rows = int(compressed.index.column("num_tokens")[3])
    first = int(compressed.index.column("row_offset")[3])
    runs = []
    out = np.zeros((rows, len(LAYERS), H), dtype=np.uint16)
    reader.read_rows(first, first + rows, None, out, HandedOff(runs.append))
    assert runs and not out.any()  # planned, not yet read
    for run in runs:
        parts = run.split(2 * run.plan[0][3])
        assert [e for p in parts for e in p.plan] == run.plan
        assert all(p.nbytes <= 2 * run.plan[0][3] or len(p.plan) == 1 for p in parts)
        for part in parts:
            part.decode(iter(part.storage.read_ranges(part.key, part.ranges)))
    assert np.array_equal(out, storage_view(compressed.read(3).hidden))


def _chunk_of(ds: hsstore.Dataset, sample: int) -> tuple[Path, int, int]:
    """The shard file, offset and size of the first chunk of ``sample``'s rows."""
    reader = ds.segment_reader(0)
    chunk = int(ds.index.column("row_offset")[sample]) // ds.manifest.layout.rows_per_chunk
    (shard,) = Path(ds.path).rglob("states/c/0/0/0")
    offset, nbytes = reader.shard_index(0).entries.reshape(-1, 2)[chunk].tolist()
    return shard, offset, nbytes


@pytest.mark.parametrize("threads", [1, 2])
def test_a_corrupted_compressed_sample_is_named_whichever_thread_checks_it(tmp_path, threads):
    ds = _dataset(tmp_path / "ds")
    shard, offset, nbytes = _chunk_of(ds, 7)
    data = bytearray(shard.read_bytes())
    at = offset + nbytes // 2  # inside the chunk's compressed streams
    data[at : at + 4] = bytes(b ^ 0x5A for b in data[at : at + 4])
    shard.write_bytes(bytes(data))
    loader = _loader(ds.path, max_tokens=128, shuffle=False, num_threads=threads)
    with pytest.raises(IntegrityError) as caught:
        for _ in loader:
            pass
    assert caught.value.sample_id == "s7"


def test_a_chunk_the_decode_thread_cannot_decode_names_its_sample(tmp_path):
    ds = _dataset(tmp_path / "ds")
    shard, offset, nbytes = _chunk_of(ds, 7)
    data = bytearray(shard.read_bytes())
    data[offset : offset + 16] = bytes(16)  # the frame's header: the codec refuses it
    shard.write_bytes(bytes(data))
    with pytest.raises(IntegrityError) as caught:
        for _ in _loader(ds.path, max_tokens=128, shuffle=False, num_threads=1):
            pass
    assert caught.value.sample_id == "s7"
    assert str(shard) in str(caught.value)


def test_a_read_failing_on_the_producer_names_its_sample(tmp_path, monkeypatch):
    """The producer's reads of a batch's chunks fail on and on (a disk's persistent EIO, shard
    indexes already in memory): the loader raises the damage, naming the first sample."""
    monkeypatch.setattr(damage, "EIO_RETRY_WAITS_S", (0.01, 0.02))
    broken = threading.Event()

    def plan(call: Call) -> Fault | None:
        failing = broken.is_set() and call.verb == "read_ranges" and "states/c/" in call.key
        return Fault("fail") if failing else None

    _dataset(tmp_path / "ds")
    ds = hsstore.open(FaultyStorage(LocalStorage(str(tmp_path / "ds")), plan))
    for i in range(len(ds)):  # every shard's index read while the disk is healthy
        ds.read(i)
    broken.set()
    with pytest.raises(IntegrityError, match="I/O error") as caught:
        for _ in _loader(ds, max_tokens=128, shuffle=False, num_threads=1):
            pass
    assert caught.value.sample_id == "s0"


def test_closing_mid_epoch_stops_the_decode_thread(compressed):
    loader = _loader(compressed.path, max_tokens=128, shuffle=True, seed=1, num_threads=1)
    batches = iter(loader)
    next(batches)
    assert any(t.name.startswith("hsstore-decode") for t in threading.enumerate())
    loader.close()
    assert not any(t.name.startswith("hsstore-decode") for t in threading.enumerate())
