"""The read stage: ranges hinted with ``stage`` are read into memory ahead on a thread of the
storage's, served from there to the reads that follow, and never change what a read returns;
a loader with one decode thread and a core to spare stages its reads and checks its samples
beside the decoding, and delivers the same batches."""

from __future__ import annotations

import os
import threading
import time

import numpy as np
import pytest
import torch

import hsstore
from hsstore import LayerSpec
from hsstore.errors import IntegrityError
from hsstore.format.local_store import LocalStorage
from hsstore.format.read_stage import ReadStage
from hsstore.loader import Loader

RANGE = 4096


def _file(tmp_path, nbytes: int = 64 * RANGE, seed: int = 0) -> bytes:
    data = np.random.default_rng(seed).integers(0, 256, nbytes, dtype=np.uint8).tobytes()
    (tmp_path / "f").write_bytes(data)
    return data


def _until(condition, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "the stage did not get there in time"
        time.sleep(0.005)


def _ranges(n: int, first: int = 0) -> list[tuple[int, int]]:
    return [((first + k) * RANGE, RANGE) for k in range(n)]


def test_staged_ranges_are_read_ahead_and_served_from_memory(tmp_path):
    data = _file(tmp_path)
    store = LocalStorage(tmp_path)
    ranges = _ranges(16)
    store.will_read("f", ranges, stage=True)
    stage = store._stage
    _until(lambda: stage.held_bytes == 16 * RANGE)
    # The file changes under the stage (committed files never do): what was read ahead is
    # what the reads get, which shows they came from memory, not from the file.
    (tmp_path / "f").write_bytes(bytes(len(data)))
    got = [bytes(v) for v in store.read_ranges("f", ranges)]
    assert got == [data[o : o + n] for o, n in ranges]
    assert stage.held_bytes == 0
    into = [memoryview(bytearray(RANGE)) for _ in ranges]
    assert [bytes(v) for v in store.read_ranges("f", ranges, into)] == [bytes(RANGE)] * 16


def test_reads_into_buffers_take_staged_ranges_too(tmp_path):
    data = _file(tmp_path)
    store = LocalStorage(tmp_path)
    ranges = _ranges(8, first=3)
    store.will_read("f", ranges, stage=True)
    _until(lambda: store._stage.held_bytes == 8 * RANGE)
    into = [memoryview(bytearray(RANGE + 10)) for _ in ranges]
    got = [bytes(v) for v in store.read_ranges("f", ranges, into)]
    assert got == [data[o : o + n] for o, n in ranges]
    assert store._stage.held_bytes == 0


def test_the_stage_holds_no_more_than_its_budget_and_every_read_is_right(tmp_path):
    data = _file(tmp_path)
    with open(tmp_path / "f", "rb") as f:
        fd = os.dup(f.fileno())
    reads: list[tuple[int, int]] = []

    def read(key, ranges, into):
        reads.extend(ranges)
        return [os.preadv(fd, [buf], offset) for (offset, _), buf in zip(ranges, into)]

    stage = ReadStage(read, budget_bytes=4 * RANGE)
    ranges = _ranges(64)
    stage.hint("f", ranges)
    seen = []
    for offset, nbytes in ranges:
        assert stage.held_bytes <= 4 * RANGE
        view = stage.take("f", offset, nbytes)
        if view is None:  # not read ahead (yet): the read does it itself
            seen.append(data[offset : offset + nbytes])
        else:
            seen.append(bytes(view))
            stage.give_back(view)
    assert seen == [data[o : o + n] for o, n in ranges]
    time.sleep(0.05)
    assert stage.held_bytes == 0  # nothing left behind for a range already read
    assert len(reads) == len(set(reads))  # no range read twice by the stage
    stage.close()
    os.close(fd)


def test_ranges_the_reads_went_past_give_way_to_those_ahead(tmp_path):
    data = _file(tmp_path)
    store = LocalStorage(tmp_path)
    stage = ReadStage(store._read_many, budget_bytes=8 * RANGE)
    stage.hint("f", _ranges(8))  # hinted, then never asked for (an abandoned batch)
    _until(lambda: stage.held_bytes == 8 * RANGE)
    later = _ranges(8, first=40)
    stage.hint("f", later)
    time.sleep(0.05)
    assert stage.held_bytes == 8 * RANGE  # full: nothing more is read yet
    assert stage.take("f", *later[0]) is None  # the reads are past the first eight now
    _until(lambda: stage.held_bytes == 7 * RANGE)  # they gave way to the rest of the later
    for offset, nbytes in later[1:]:
        view = stage.take("f", offset, nbytes)
        assert view is not None and bytes(view) == data[offset : offset + nbytes]
    assert stage.take("f", 0, RANGE) is None
    stage.close()


def test_reads_past_the_end_come_back_short_as_without_the_stage(tmp_path):
    data = _file(tmp_path, nbytes=10 * RANGE)
    store = LocalStorage(tmp_path)
    ranges = [(8 * RANGE, RANGE), (9 * RANGE + 100, RANGE), (12 * RANGE, RANGE)]
    store.will_read("f", ranges, stage=True)
    _until(lambda: store._stage.held_bytes == RANGE)  # only the whole one is kept
    got = [bytes(v) for v in store.read_ranges("f", ranges)]
    assert got == [data[8 * RANGE : 9 * RANGE], data[9 * RANGE + 100 :], b""]


def test_a_closed_stage_lets_go_and_reads_go_to_the_file(tmp_path):
    data = _file(tmp_path)
    store = LocalStorage(tmp_path)
    ranges = _ranges(4)
    store.will_read("f", ranges, stage=True)
    _until(lambda: store._stage.held_bytes == 4 * RANGE)
    store.close()
    assert store._stage.held_bytes == 0
    assert [bytes(v) for v in store.read_ranges("f", ranges)] == [
        data[o : o + n] for o, n in ranges
    ]
    store.will_read("f", ranges, stage=True)  # hints after close change nothing
    assert store._stage.held_bytes == 0


LAYERS = [LayerSpec(depth=1), LayerSpec(depth=2), LayerSpec(depth=4)]
H = 64


def _dataset(path, codec="split-zstd"):
    ds = hsstore.create(
        path,
        layers=LAYERS,
        hidden_size=H,
        dtype=torch.bfloat16,
        model={"name": "toy", "revision": None, "num_hidden_layers": 4, "hidden_size": H},
        codec=codec,
        chunk_bytes=8 * len(LAYERS) * H * 2,  # 8 rows a chunk: samples span several
    )
    g = torch.Generator().manual_seed(1)
    lengths = torch.randint(5, 60, (40,), generator=g).tolist()
    with ds.writer() as w:
        for i, t in enumerate(lengths):
            states = torch.randn(t, len(LAYERS), H, generator=g).to(torch.bfloat16)
            ids = torch.randint(0, 50, (t,), generator=g)
            w.add(f"s{i}", ids, torch.ones(t, dtype=torch.int64), states)
    return hsstore.open(path)


def _batches(path, threads: int) -> tuple[list[dict], set[str]]:
    loader = Loader(path, max_tokens=128, shuffle=True, seed=3, num_threads=threads)
    out, names = [], set()
    for batch in loader:
        names |= {t.name for t in threading.enumerate()}
        out.append({k: v.clone() for k, v in batch.items() if isinstance(v, torch.Tensor)})
    loader.close()
    return out, names


def test_one_decode_thread_stages_and_checks_beside_and_delivers_the_same_batches(tmp_path):
    ds = _dataset(tmp_path / "ds")
    one, names = _batches(ds.path, threads=1)
    two, _ = _batches(ds.path, threads=2)
    if len(os.sched_getaffinity(0)) > 1:  # a core to spare: the helpers run
        assert any(n.startswith("hsstore-check") for n in names)
        assert "hsstore-stage" in names
    else:
        assert not any(n.startswith(("hsstore-check", "hsstore-stage")) for n in names)
    assert len(one) == len(two) > 1
    for a, b in zip(one, two, strict=True):
        assert a.keys() == b.keys()
        for k in a:
            assert torch.equal(a[k], b[k]), k


@pytest.mark.parametrize("threads", [1, 2])
def test_a_corrupted_compressed_sample_is_named_whichever_thread_checks_it(tmp_path, threads):
    ds = _dataset(tmp_path / "ds")
    victim = 7
    reader = ds.segment_reader(0)
    row = int(ds.index.column("row_offset")[victim])
    first_chunk = row // ds.manifest.layout.rows_per_chunk
    (shard,) = (p for p in (tmp_path / "ds").rglob("states/c/0/0/0"))
    offset, nbytes = reader.shard_index(0).entries.reshape(-1, 2)[first_chunk].tolist()
    data = bytearray(shard.read_bytes())
    at = offset + nbytes // 2  # inside the chunk's compressed streams
    data[at : at + 4] = bytes(b ^ 0x5A for b in data[at : at + 4])
    shard.write_bytes(bytes(data))
    loader = Loader(ds.path, max_tokens=128, shuffle=False, num_threads=threads)
    with pytest.raises(IntegrityError) as caught:
        for _ in loader:
            pass
    assert caught.value.sample_id == f"s{victim}"
