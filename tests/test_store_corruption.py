"""Damaged files are reported with the file and the affected sample ids, never returned as data."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

import hsstore
from hsstore import LayerSpec
from hsstore.dataset import batch_reads
from hsstore.spec.sealing import seal_document
from tools.synthetic import random_sample

LENGTHS = [40, 90, 7, 200, 33, 120]


def _build(path: Path, codec: str, *, sample_aligned: bool | None = None) -> hsstore.Dataset:
    ds = hsstore.create(path, layers=[LayerSpec(1), LayerSpec(3)], hidden_size=32, dtype=torch.bfloat16,
                        codec=codec, chunk_bytes=2048, shard_bytes=16384,
                        sample_aligned=sample_aligned)  # fmt: skip
    with ds.writer() as w:
        for i, t in enumerate(LENGTHS):
            w.add(f"s{i}", *random_sample(t, 2, 32, seed=i))
    return hsstore.open(path)


def _shards(ds: hsstore.Dataset) -> list[Path]:
    seg = ds.manifest.segments[0].id
    return sorted(
        (Path(ds.path) / "segments" / seg / "states" / "c").glob("*/0/0"),
        key=lambda p: int(p.parts[-3]),
    )


def _sample_rows(ds: hsstore.Dataset, sid: str) -> tuple[int, int]:
    i = ds.position(sid)
    row = ds.index.column("row_offset")[i].as_py()
    return row, row + ds.num_tokens_of(i)


@pytest.mark.parametrize("codec", ["split-zstd", "blosc-zstd", "none"])
def test_flipped_byte_in_chunk(tmp_path, codec):
    ds = _build(tmp_path / "ds", codec)
    shard = _shards(ds)[0]
    data = bytearray(shard.read_bytes())
    data[5] ^= 0x40  # inside the first chunk of the first shard: rows 0..rows_per_chunk
    shard.write_bytes(bytes(data))
    report = hsstore.verify(tmp_path / "ds")
    assert not report.ok
    assert "s0" in report.bad_samples
    assert any("crc32c" in p.reason and str(shard) in p.where for p in report.problems)
    untouched = [
        f"s{i}"
        for i in range(len(LENGTHS))
        if _sample_rows(ds, f"s{i}")[0] >= ds.manifest.layout.rows_per_shard
    ]
    assert untouched and not set(untouched) & set(report.bad_samples)
    fresh = hsstore.open(tmp_path / "ds")
    with pytest.raises(hsstore.IntegrityError) as info:
        fresh.get("s0")
    assert info.value.sample_id == "s0"


def test_a_chunk_decoded_for_a_checksummed_read_is_not_trusted_by_a_partial_one(tmp_path):
    """Whole-sample reads leave out the chunk crc (the sample checksum covers the decoded
    bytes). A chunk two samples share (unaligned layout) and decoded that way for the first must
    not be handed unchecked to a layer read of the second, which has no sample checksum."""
    ds = _build(tmp_path / "ds", "split-zstd", sample_aligned=False)
    rpc = ds.manifest.layout.rows_per_chunk
    shared = LENGTHS[0] // rpc  # the chunk where s0 ends and s1 begins
    assert LENGTHS[0] % rpc > 0 and shared < ds.manifest.layout.chunks_per_shard
    offset, _ = ds._readers[0].shard_index(0).chunk(shared, 0)
    shard = _shards(ds)[0]
    data = bytearray(shard.read_bytes())
    values = rpc * ds.manifest.num_layers * 32
    low_stream = offset + 16 + 4 + 4  # blosc header, block start, the low-byte stream's length
    assert int.from_bytes(data[low_stream - 4 : low_stream], "little") == values  # stored raw
    row_of_s1 = rpc - 1  # the chunk's last row belongs to s1
    data[low_stream + row_of_s1 * ds.manifest.num_layers * 32] ^= 0x01  # decodes, wrong value
    shard.write_bytes(bytes(data))
    fresh = hsstore.open(tmp_path / "ds")
    assert fresh.get("s0").hidden.shape[0] == LENGTHS[0]  # its own rows are intact
    with pytest.raises(hsstore.IntegrityError, match="crc32c"):
        fresh.read(1, layers=[0])
    with pytest.raises(hsstore.IntegrityError, match="checksum"):
        fresh.get("s1")


def test_truncated_shard(tmp_path):
    ds = _build(tmp_path / "ds", "blosc-zstd")
    shard = _shards(ds)[-1]
    shard.write_bytes(shard.read_bytes()[:-100])
    report = hsstore.verify(tmp_path / "ds")
    assert not report.ok
    assert any("truncated" in p.reason and str(shard) in p.where for p in report.problems)
    last = f"s{len(LENGTHS) - 1}"
    assert last in report.bad_samples
    with pytest.raises(hsstore.IntegrityError, match="truncated"):
        hsstore.open(tmp_path / "ds").get(last)


@pytest.mark.parametrize("codec", ["split-zstd", "none"])
def test_shard_shortened_after_its_index_was_read(tmp_path, codec):
    """A shard that became shorter than the index read before says is refused with a clear
    error naming it and the sample, never read past its end: by a sample's read and by a
    batch's (uncompressed rows go straight into the caller's buffer)."""
    ds = _build(tmp_path / "ds", codec)
    before = ds.get("s0").hidden  # loads the shard index
    ds.close()  # closes the shard's descriptor, so the next read opens the shortened file
    shard = _shards(ds)[0]
    shard.write_bytes(shard.read_bytes()[:64])
    with pytest.raises(hsstore.IntegrityError, match="truncated") as info:
        ds.get("s0")
    assert str(shard) in str(info.value) and info.value.sample_id == "s0"
    batch = torch.empty(sum(LENGTHS), 2, 32, dtype=torch.bfloat16)
    with pytest.raises(hsstore.IntegrityError, match="truncated") as info:
        batch_reads.read_hidden_many_into(ds, batch, [(1, 0), (0, LENGTHS[1])], unchecked=[])
    assert str(shard) in str(info.value) and info.value.sample_id == "s1"
    assert before.shape[0] == LENGTHS[0]


def test_missing_shard(tmp_path):
    ds = _build(tmp_path / "ds", "blosc-zstd")
    shard = _shards(ds)[1]
    os.unlink(shard)
    report = hsstore.verify(tmp_path / "ds")
    assert any("missing" in p.reason and str(shard) in p.where for p in report.problems)
    rps = ds.manifest.layout.rows_per_shard
    hit = {
        f"s{i}"
        for i in range(len(LENGTHS))
        if _sample_rows(ds, f"s{i}")[0] < 2 * rps and _sample_rows(ds, f"s{i}")[1] > rps
    }
    assert hit and hit <= set(report.bad_samples)


def test_corrupted_index_file(tmp_path):
    ds = _build(tmp_path / "ds", "none")
    index = Path(ds.path) / "segments" / ds.manifest.segments[0].id / "index.parquet"
    data = bytearray(index.read_bytes())
    data[len(data) // 2] ^= 0xFF
    index.write_bytes(bytes(data))
    report = hsstore.verify(tmp_path / "ds")
    problems = [p for p in report.problems if str(index) in p.where]
    assert problems and "crc32c" in problems[0].reason
    assert "its copy is intact" in problems[0].reason and not report.bad_samples
    # The index's copy still locates every sample: the dataset opens whole.
    opened = hsstore.open(tmp_path / "ds")
    assert len(opened) == len(LENGTHS) and not opened.unreadable
    assert not report.unreadable_segments
    # Without the copy the damage stays in that segment: the dataset opens without it.
    index.with_name("index-copy.parquet").unlink()
    with pytest.warns(hsstore.DamageWarning, match=f"{len(LENGTHS)} of the {len(LENGTHS)}"):
        opened = hsstore.open(tmp_path / "ds")
    seg = ds.manifest.segments[0].id
    assert len(opened) == 0 and "index.parquet" in opened.unreadable[seg]
    report = hsstore.verify(tmp_path / "ds")
    assert seg in report.unreadable_segments
    problems = [p for p in report.problems if str(index) in p.where]
    assert f"{len(LENGTHS)} samples" in problems[0].reason  # the ids themselves live in that file


def _latest_manifest(path: Path) -> Path:
    return sorted((path / "manifests").glob("v*.json"))[-1]


def test_corrupted_manifest_json(tmp_path):
    _build(tmp_path / "ds", "none")
    man = _latest_manifest(tmp_path / "ds")
    man.write_bytes(man.read_bytes()[:-20])
    # Served from the copy its segments' commit marks keep, saying so; writers refuse.
    with pytest.warns(hsstore.DamageWarning, match="not valid JSON"):
        assert len(hsstore.open(tmp_path / "ds")) == len(LENGTHS)
    with pytest.raises(hsstore.FormatError, match="not valid JSON") as info:
        hsstore.open(tmp_path / "ds").writer()
    assert str(man) in str(info.value)
    report = hsstore.verify(tmp_path / "ds")
    assert any(p.kind == "manifest" and str(man) in p.where for p in report.problems)


def test_schema_invalid_manifest(tmp_path):
    _build(tmp_path / "ds", "none")
    man = tmp_path / "ds" / "manifests" / "v00000001.json"  # the full manifest later ones extend
    doc = json.loads(man.read_text())
    doc["layers"][0]["depth"] = -3
    man.write_bytes(seal_document(doc))  # with a valid checksum: the schema must refuse it
    with pytest.raises(hsstore.SchemaError, match="layers/0/depth"):
        hsstore.open(tmp_path / "ds")
    assert not hsstore.verify(tmp_path / "ds").ok


def test_future_format_version_is_refused(tmp_path):
    _build(tmp_path / "ds", "none")
    man = _latest_manifest(tmp_path / "ds")
    doc = json.loads(man.read_text())
    doc["format_version"] = 99
    man.write_text(json.dumps(doc))
    with pytest.raises(hsstore.UnsupportedVersionError, match="format version 99"):
        hsstore.open(tmp_path / "ds")


def test_not_a_dataset(tmp_path):
    (tmp_path / "empty").mkdir()
    with pytest.raises(hsstore.NotADatasetError, match="not an hsstore dataset"):
        hsstore.open(tmp_path / "empty")
    with pytest.raises(FileNotFoundError):
        hsstore.open(tmp_path / "missing")


def test_clean_dataset_verifies(tmp_path):
    _build(tmp_path / "ds", "blosc-zstd")
    report = hsstore.verify(tmp_path / "ds")
    assert report.ok and report.samples_checked == len(LENGTHS)
    assert report.bytes_read > 0 and report.to_json()["ok"] is True


def test_shard_index_with_valid_crc_but_wrong_sizes_is_refused(tmp_path):
    """A reader trusts nothing it reads: an index that passes its crc must still make sense."""
    import struct

    import numpy as np

    from hsstore.codec.codecs import crc32c

    ds = _build(tmp_path / "ds", "none")
    shard = _shards(ds)[0]
    data = bytearray(shard.read_bytes())
    layout = ds.manifest.layout
    n = layout.chunks_per_shard
    index = np.frombuffer(bytes(data[-(16 * n + 4) : -4]), dtype="<u8").reshape(n, 2).copy()
    index[0, 1] -= 8  # claims a raw chunk shorter than a chunk: reads would run into the next
    body = index.tobytes()
    data[-(16 * n + 4) :] = body + struct.pack("<I", crc32c(body))
    shard.write_bytes(bytes(data))
    with pytest.raises(hsstore.IntegrityError, match="raw chunk"):
        hsstore.open(tmp_path / "ds", verify_reads=False).get("s0")


@pytest.mark.parametrize("field, reason", [(4, "decodes to"), (12, "blosc header says")])
def test_blosc_header_that_disagrees_with_the_chunk_is_refused(tmp_path, field, reason):
    """A chunk whose crc32c is intact but whose blosc header claims another decoded size or
    frame length is refused before c-blosc reads it."""
    import struct

    import numpy as np

    from hsstore.codec.codecs import crc32c

    ds = _build(tmp_path / "ds", "split-zstd")
    shard = _shards(ds)[0]
    data = bytearray(shard.read_bytes())
    n = ds.manifest.layout.chunks_per_shard
    index = np.frombuffer(bytes(data[-(16 * n + 4) : -4]), dtype="<u8").reshape(n, 2)
    offset, nbytes = (int(v) for v in index[0])
    value = struct.unpack_from("<I", data, offset + field)[0]
    struct.pack_into("<I", data, offset + field, value + 16)
    body = bytes(data[offset : offset + nbytes - 4])
    struct.pack_into("<I", data, offset + nbytes - 4, crc32c(body))
    shard.write_bytes(bytes(data))
    with pytest.raises(hsstore.IntegrityError, match=reason):
        hsstore.open(tmp_path / "ds", verify_reads=False).get("s0")
    report = hsstore.verify(tmp_path / "ds")
    assert "s0" in report.bad_samples and any(reason in p.reason for p in report.problems)
