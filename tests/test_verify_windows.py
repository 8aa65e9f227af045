"""verify checks samples a window of many at a time (one read, one hashing call): damage that
only a sample checksum sees is still named sample by sample, and only where it is."""

from __future__ import annotations

import struct
from pathlib import Path

import numpy as np
import pytest
import torch

import hsstore
from hsstore import LayerSpec
from hsstore.codec.codecs import crc32c
from hsstore.dataset import sample_pass
from tools.synthetic import random_sample

ROW_BYTES = 2 * 32 * 2  # two layers of hidden size 32, bf16


def _build(path: Path, samples: int) -> hsstore.Dataset:
    ds = hsstore.create(path, layers=[LayerSpec(1), LayerSpec(2)], hidden_size=32,
                        dtype=torch.bfloat16, codec="none", chunk_bytes=128 * ROW_BYTES,
                        sample_aligned=False)  # fmt: skip
    with ds.writer() as w:
        for i in range(samples):
            w.add(f"s{i}", *random_sample(5 + i % 7, 2, 32, seed=i))
    return hsstore.open(path)


def _damage_behind_the_crc(ds: hsstore.Dataset, sid: str) -> None:
    """Flip a byte of sample ``sid``'s states and make its chunk's crc32c match again: only
    the sample checksum can tell."""
    layout, seg = ds.manifest.layout, ds.manifest.segments[0].id
    row = ds.index.column("row_offset")[ds.position(sid)].as_py()
    chunk = row // layout.rows_per_chunk
    shard, local = divmod(chunk, layout.chunks_per_shard)
    path = Path(ds.path) / "segments" / seg / "states" / "c" / str(shard) / "0" / "0"
    data = bytearray(path.read_bytes())
    n = layout.chunks_per_shard
    index = np.frombuffer(bytes(data[-(16 * n + 4) : -4]), dtype="<u8").reshape(n, 2)
    offset, nbytes = (int(v) for v in index[local])
    data[offset + (row - chunk * layout.rows_per_chunk) * ROW_BYTES + 3] ^= 0x10
    body = bytes(data[offset : offset + nbytes - 4])
    struct.pack_into("<I", data, offset + nbytes - 4, crc32c(body))
    path.write_bytes(bytes(data))


@pytest.mark.parametrize(
    "workers, window_rows",
    [(1, 32), (3, 32), (2, 1)],  # ~4 samples a window; every sample a window of its own
)
def test_a_sample_failing_only_its_checksum_is_named_alone(
    tmp_path, monkeypatch, workers, window_rows
):
    monkeypatch.setattr(sample_pass, "WINDOW_BYTES", window_rows * ROW_BYTES)
    ds = _build(tmp_path / "ds", 60)
    assert hsstore.verify(ds.path, workers=workers).ok
    _damage_behind_the_crc(ds, "s37")
    _damage_behind_the_crc(ds, "s38")  # in the same window or the next: each named
    report = hsstore.verify(ds.path, workers=workers)
    assert set(report.bad_samples) == {"s37", "s38"}
    assert all("sample checksum mismatch" in why for why in report.bad_samples.values())
    assert [p.kind for p in report.problems] == ["sample", "sample"]
    assert report.samples_checked == 60
