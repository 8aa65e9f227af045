"""A manifest cannot change silently: checksums, layout checks against decoded chunk sizes,
layer semantics, bounded documents, duplicate segments, rollback of the newest version, and
what `verify` covers beyond the data files."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from click.testing import CliRunner

import hsstore
from hsstore import LayerSpec
from hsstore.cli import main
from hsstore.loader import Loader
from hsstore.spec.sealing import seal_document
from tools.synthetic import random_sample

H = 64
LENGTHS = [40, 90, 7, 33]
LAYERS = [LayerSpec(1), LayerSpec(2), LayerSpec(4)]


def _build(path: Path, codec: str = "blosc-zstd", commits: int = 2) -> hsstore.Dataset:
    ds = hsstore.create(path, layers=LAYERS, hidden_size=H, dtype=torch.bfloat16, codec=codec,
                        model={"num_hidden_layers": 4}, chunk_bytes=4096, shard_bytes=32768)  # fmt: skip
    for c in range(commits):
        with ds.writer() as w:
            for i, t in enumerate(LENGTHS):
                w.add(f"c{c}-s{i}", *random_sample(t, len(LAYERS), H, seed=10 * c + i))
    # Without version 1's copy (checkpoint 1), so an edit of version 1 is all a reader has
    # (tests/test_recovery.py reads through the copy).
    (path / "manifests" / "c00000001.json").unlink()
    return hsstore.open(path)


def _manifests(path: Path) -> Path:
    return path / "manifests"


def _rewrite_as_format_1(path: Path) -> dict:
    """Turn a dataset into what format 1 wrote: one full manifest without a checksum."""
    obj = hsstore.open(path).manifest.to_json()
    obj.update(format_version=1, version=1)
    del obj["kind"]
    for f in _manifests(path).iterdir():
        f.unlink()
    _write_doc(path / "manifests" / "v00000001.json", obj)
    return obj


def _write_doc(file: Path, obj: dict, *, reseal: bool = False) -> None:
    if reseal:  # a hand edit that also recomputes the checksum
        file.write_bytes(seal_document(obj))
    else:
        file.write_text(json.dumps(obj, indent=1))


def _edit(path: Path, name: str, change, *, reseal: bool = False) -> Path:
    file = _manifests(path) / name
    obj = json.loads(file.read_text())
    change(obj)
    _write_doc(file, obj, reseal=reseal)
    return file


# -- item 1: a layout edit never produces wrong numbers --------------------------------------
@pytest.mark.parametrize("codec", ["split-zstd", "blosc-zstd", "blosc-lz4", "none"])
@pytest.mark.parametrize("field", ["rows_per_chunk", "hidden_size"])
def test_layout_edit_in_unchecksummed_manifest_never_reads_wrong_numbers(tmp_path, codec, field):
    truth = _build(tmp_path / "ds", codec)
    expected = [truth.read(i, layers=[0, 2]).hidden for i in range(len(truth))]
    obj = _rewrite_as_format_1(tmp_path / "ds")
    assert hsstore.open(tmp_path / "ds").read(1, layers=[0, 2]).hidden.equal(expected[1])

    def bump(o: dict) -> None:
        if field == "hidden_size":
            o["hidden_size"] += 1
            o["model"]["hidden_size"] = None
        else:
            o["layout"]["rows_per_chunk"] += 1

    _edit(tmp_path / "ds", "v00000001.json", bump)
    assert obj["layout"]["rows_per_chunk"] > 1
    # A sample-aligned index no longer fits the edited chunk size: refused when opened.
    refused_at_open = field == "rows_per_chunk" and obj["layout"].get("sample_aligned", False)
    if refused_at_open:
        with pytest.raises(hsstore.IntegrityError, match="chunk boundary"):
            hsstore.open(tmp_path / "ds", verify_reads=False)
    else:
        ds = hsstore.open(tmp_path / "ds", verify_reads=False)
        for i in range(len(ds)):
            with pytest.raises(hsstore.IntegrityError):
                ds.read(i, layers=[0, 2])
    with pytest.raises(hsstore.IntegrityError):
        loader = Loader(tmp_path / "ds", max_tokens=256, aux_layers=[0, 1], verifier=False,
                        shuffle=False, num_threads=1)  # fmt: skip
        for _ in loader:
            pass
    assert not hsstore.verify(tmp_path / "ds").ok


@pytest.mark.parametrize(
    "change",
    [
        lambda o: o["layout"].__setitem__("rows_per_chunk", o["layout"]["rows_per_chunk"] + 1),
        lambda o: o.__setitem__("hidden_size", 65),
        lambda o: o["layers"][1].__setitem__("depth", 3),  # item 3: layer semantics
        lambda o: o["model"].__setitem__("num_hidden_layers", 5),
    ],
    ids=["rows_per_chunk", "hidden_size", "layer_depth", "num_hidden_layers"],
)
def test_any_edit_of_a_manifest_is_caught_by_its_checksum(tmp_path, change):
    _build(tmp_path / "ds")
    file = _edit(tmp_path / "ds", "v00000001.json", change)
    with pytest.raises(hsstore.IntegrityError, match="checksum mismatch") as info:
        hsstore.open(tmp_path / "ds")
    assert str(file) in str(info.value)
    report = hsstore.verify(tmp_path / "ds")
    assert any(p.kind == "manifest" and "checksum" in p.reason for p in report.problems)
    result = CliRunner().invoke(main, ["inspect", str(tmp_path / "ds")])
    assert result.exit_code != 0 and "checksum mismatch" in result.output
    assert "Traceback" not in result.output


def test_a_delta_is_checksummed_too(tmp_path):
    _build(tmp_path / "ds")
    latest = sorted(_manifests(tmp_path / "ds").glob("v*.json"))[-1]
    file = _edit(tmp_path / "ds", latest.name, lambda o: o["add_segments"][0].__setitem__(
        "num_tokens", o["add_segments"][0]["num_tokens"] + 1))  # fmt: skip
    # Caught, and read from the copy its segment's commit mark keeps; writers refuse it.
    with pytest.warns(hsstore.DamageWarning, match="checksum mismatch"):
        hsstore.open(tmp_path / "ds")
    with pytest.raises(hsstore.IntegrityError, match="checksum mismatch"):
        hsstore.open(tmp_path / "ds").writer()
    assert str(file) in hsstore.verify(tmp_path / "ds").problems[0].where


# -- item 6: verify and gc never raise on bad manifest values ---------------------------------
@pytest.mark.parametrize(
    "change, reason",
    [
        (lambda o: o.__setitem__("hidden_size", 64.0), "hidden_size"),
        (lambda o: o.__setitem__("hidden_size", 1e300), "hidden_size"),
        (lambda o: o["layout"].__setitem__("rows_per_chunk", 2**40), "rows_per_chunk"),
        (lambda o: o["layout"].__setitem__("chunks_per_shard", 2**40), "chunks_per_shard"),
        (lambda o: o["segments"][0]["files"].__setitem__("states/c/x/0/0", {"size": 1}), "unknown file"),
        (lambda o: o["segments"][0]["files"].__setitem__("states/c/99/0/0", {"size": 1}), "shard 99"),
        (lambda o: o["provenance"].__setitem__("deep", _nested(500)), "nested"),
        (lambda o: o["segments"].append(o["segments"][0]), "listed twice"),
        (lambda o: o["layers"][0].__setitem__("depth", 9), "exceeds model.num_hidden_layers"),
        (lambda o: o["segments"][0].__setitem__("num_rows", 1), "1 rows for"),
    ],
    ids=["float", "1e300", "2^40_rows", "2^40_chunks", "files_key", "shard_range", "deep",
         "segment_twice", "depth_above_model", "rows_below_tokens"],
)  # fmt: skip
@pytest.mark.parametrize("reseal", [False, True], ids=["format1", "resealed"])
def test_bad_manifest_values_give_one_clean_error(tmp_path, change, reason, reseal):
    _build(tmp_path / "ds", commits=1)
    if reseal:  # a format 2 manifest edited by hand, checksum recomputed
        version = hsstore.open(tmp_path / "ds").manifest.version
        obj = hsstore.open(tmp_path / "ds").manifest.to_json()
        obj["version"] = 1
        for f in _manifests(tmp_path / "ds").iterdir():
            f.unlink()
        assert version == 2
        _write_doc(_manifests(tmp_path / "ds") / "v00000001.json", obj, reseal=True)
    else:
        _rewrite_as_format_1(tmp_path / "ds")
    _edit(tmp_path / "ds", "v00000001.json", change, reseal=reseal)
    with pytest.raises(hsstore.FormatError, match=reason):
        hsstore.open(tmp_path / "ds")
    report = hsstore.verify(tmp_path / "ds")
    assert not report.ok and reason in report.problems[0].reason
    with pytest.raises(hsstore.FormatError):
        hsstore.gc(tmp_path / "ds", grace_s=0)
    result = CliRunner().invoke(main, ["verify", str(tmp_path / "ds")])
    assert result.exit_code in (1, 2) and "Traceback" not in result.output
    assert reason in result.output


def _nested(depth: int) -> list:
    out: list = []
    for _ in range(depth):
        out = [out]
    return out


@pytest.mark.parametrize("reseal", [False, True], ids=["format1", "format2"])
def test_provenance_nested_past_the_parser_limit_is_one_clean_error(tmp_path, reseal):
    _build(tmp_path / "ds", commits=1)
    if not reseal:
        _rewrite_as_format_1(tmp_path / "ds")
    file = _manifests(tmp_path / "ds") / "v00000001.json"
    text = file.read_text()
    assert text.count('"provenance": {}') + text.count('"provenance":{}') == 1
    deep = '"provenance": {"d": ' + "[" * 200_000 + "]" * 200_000 + "}"
    file.write_text(text.replace('"provenance": {}', deep).replace('"provenance":{}', deep))
    with pytest.raises(hsstore.FormatError, match="nested too deeply"):
        hsstore.open(tmp_path / "ds")
    assert "nested too deeply" in hsstore.verify(tmp_path / "ds").problems[0].reason
    with pytest.raises(hsstore.FormatError):
        hsstore.gc(tmp_path / "ds", grace_s=0)


# -- item 7: one segment listed twice (across a delta) ----------------------------------------
def test_a_delta_repeating_a_committed_segment_is_refused(tmp_path):
    ds = _build(tmp_path / "ds")
    first = ds.manifest.segments[0].to_json()
    latest = sorted(_manifests(tmp_path / "ds").glob("v*.json"))[-1]

    def repeat(obj: dict) -> None:
        obj["add_segments"].append(first)
        obj.pop("sample_digest")  # else refused first for holding too few hashes

    _edit(tmp_path / "ds", latest.name, repeat, reseal=True)
    with pytest.raises(hsstore.FormatError, match="listed twice"):
        hsstore.open(tmp_path / "ds")
    assert "listed twice" in hsstore.verify(tmp_path / "ds").problems[0].reason


# -- item 8: rollback of the newest version ----------------------------------------------------
def test_deleting_the_newest_manifest_is_detected_and_gc_keeps_its_segment(tmp_path):
    ds = _build(tmp_path / "ds", commits=3)
    newest_segment = ds.manifest.segments[-1].id
    newest = sorted(_manifests(tmp_path / "ds").glob("v*.json"))[-1]
    newest.unlink()
    with pytest.warns(hsstore.DamageWarning, match="rebuilt exactly"):  # from its mark's copy
        hsstore.open(tmp_path / "ds")
    with pytest.raises(hsstore.IntegrityError, match="deleted or rolled back"):
        hsstore.open(tmp_path / "ds").writer()
    report = hsstore.verify(tmp_path / "ds")
    assert any("rolled back" in p.reason for p in report.problems)
    with pytest.raises(hsstore.IntegrityError, match="rolled back"):
        hsstore.gc(tmp_path / "ds", grace_s=0)
    assert (tmp_path / "ds" / "segments" / newest_segment).is_dir()
    result = CliRunner().invoke(main, ["gc", str(tmp_path / "ds"), "--grace", "0"])
    assert result.exit_code == 2 and "rolled back" in result.output
    assert (tmp_path / "ds" / "segments" / newest_segment).is_dir()


def test_a_writer_does_not_publish_over_a_rolled_back_version(tmp_path):
    ds = _build(tmp_path / "ds", commits=2)
    w = ds.writer()
    sorted(_manifests(tmp_path / "ds").glob("v*.json"))[-1].unlink()
    w.add("late", *random_sample(5, len(LAYERS), H, seed=99))
    with pytest.raises(hsstore.IntegrityError, match="rolled back"):
        w.commit()
    w.close()


# -- item 8: what verify covers ---------------------------------------------------------------
@pytest.mark.parametrize("key", ["zarr.json", "segments/zarr.json"])
def test_verify_checks_the_group_documents(tmp_path, key):
    _build(tmp_path / "ds", commits=1)
    (tmp_path / "ds" / key).write_text('{"zarr_format": 2}')
    report = hsstore.verify(tmp_path / "ds")
    assert [p.where for p in report.problems] == [str(tmp_path / "ds" / key)]
    (tmp_path / "ds" / key).unlink()
    assert "missing" in hsstore.verify(tmp_path / "ds").problems[0].reason


def test_verify_finds_an_older_format_1_manifest_pointing_at_a_removed_segment(tmp_path):
    ds = _build(tmp_path / "ds", commits=1)
    obj = _rewrite_as_format_1(tmp_path / "ds")
    extra = dict(obj["segments"][0], id="f" * 32)
    older = json.loads(json.dumps(obj))
    older["segments"].append(extra)
    older["num_samples"] += extra["num_samples"]
    older["num_tokens"] += extra["num_tokens"]
    _write_doc(_manifests(tmp_path / "ds") / "v00000001.json", older)
    newer = dict(obj, version=2)
    _write_doc(_manifests(tmp_path / "ds") / "v00000002.json", newer)
    assert len(hsstore.open(tmp_path / "ds")) == len(ds)
    report = hsstore.verify(tmp_path / "ds")
    assert len(report.problems) == 1 and "f" * 32 in report.problems[0].reason
    assert report.problems[0].where.endswith("v00000001.json")


def _segment_dir(ds: hsstore.Dataset, k: int = 0) -> Path:
    return Path(ds.path) / "segments" / ds.manifest.segments[k].id


@pytest.mark.parametrize("relpath", ["stats.json", "states/zarr.json", "zarr.json"])
def test_damaged_metadata_file_does_not_mark_readable_samples_bad(tmp_path, relpath):
    ds = _build(tmp_path / "ds", commits=1)
    file = _segment_dir(ds) / relpath
    file.chmod(0o644)
    data = bytearray(file.read_bytes())
    data[len(data) // 2] ^= 0x20
    file.write_bytes(bytes(data))
    report = hsstore.verify(tmp_path / "ds")
    assert [p.where for p in report.problems] == [str(file)]
    assert report.bad_samples == {} and report.samples_checked == len(LENGTHS)


def test_damaged_index_names_the_sample_ids_it_affects(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    ds = _build(tmp_path / "ds", commits=1)
    file = _segment_dir(ds) / "index.parquet"
    file.chmod(0o644)
    data = bytearray(file.read_bytes())
    # Damage the checksum column's data: the file's crc32c fails, the sample ids still decode.
    column = pq.ParquetFile(pa.BufferReader(bytes(data))).metadata.row_group(0).column(4)
    assert column.path_in_schema == "checksum"
    data[column.data_page_offset + column.total_compressed_size // 2] ^= 0x01
    file.write_bytes(bytes(data))
    (_segment_dir(ds) / "index-copy.parquet").unlink()  # no intact copy to read instead
    report = hsstore.verify(tmp_path / "ds")
    index_problems = [p for p in report.problems if p.where == str(file)]
    assert len(index_problems) == 1 and "crc32c" in index_problems[0].reason
    assert index_problems[0].sample_ids == ds.sample_ids
    assert set(report.bad_samples) == set(ds.sample_ids)


def test_verify_reports_a_missing_middle_version(tmp_path):
    _build(tmp_path / "ds", commits=3)
    (_manifests(tmp_path / "ds") / "v00000002.json").unlink()
    report = hsstore.verify(tmp_path / "ds")
    assert any("version 2 is missing" in p.reason for p in report.problems)


def test_sample_ids_survive_verify_round_trip(tmp_path):
    ds = _build(tmp_path / "ds", commits=2)
    assert hsstore.verify(tmp_path / "ds").ok
    assert len(set(ds.sample_ids)) == len(ds) == 2 * len(LENGTHS)
    got = ds.read(3).hidden
    assert np.array_equal(got.view(torch.int16).numpy(),
                          random_sample(33, 3, H, seed=3)[2].view(torch.int16).numpy())  # fmt: skip


@pytest.mark.parametrize(
    "shift, reason",
    [(1, "chunk boundary"), (-1, "overlap")],
    ids=["off_the_chunk_grid", "into_the_previous_sample"],
)
def test_an_index_row_that_does_not_fit_the_layout_is_refused(tmp_path, shift, reason):
    """An index (with a consistent manifest) pointing a sample elsewhere than where the aligned
    layout put it would serve padding or another sample's states: refused, in one line."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from hsstore.codec.codecs import crc32c

    ds = _build(tmp_path / "ds", commits=1)
    assert ds.manifest.layout.sample_aligned
    obj = _rewrite_as_format_1(tmp_path / "ds")
    file = _segment_dir(ds) / "index.parquet"
    with pq.ParquetFile(file) as index_file:
        table = index_file.read(use_threads=False)
    rows = table.column("row_offset").to_pylist()
    assert rows[1] > rows[0] + table.column("num_tokens")[0].as_py() - 1  # room to shift into
    rows[1] += shift
    table = table.set_column(1, table.schema.field(1), pa.array(rows, pa.int64()))
    file.chmod(0o644)
    pq.write_table(table, file, compression="zstd")
    data = file.read_bytes()
    obj["segments"][0]["files"]["index.parquet"] = {"size": len(data), "crc32c": crc32c(data)}
    _write_doc(_manifests(tmp_path / "ds") / "v00000001.json", obj)
    with pytest.raises(hsstore.IntegrityError, match=reason):
        hsstore.open(tmp_path / "ds")
    result = CliRunner().invoke(main, ["verify", str(tmp_path / "ds")])
    assert result.exit_code in (1, 2) and "Traceback" not in result.output
    assert reason in result.output
