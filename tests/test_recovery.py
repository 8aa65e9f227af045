"""Recovery from lost or damaged metadata: every metadata file's facts are held twice, so one
deleted, truncated or flipped file never locks a dataset nor costs a sample. A reader serves
what survives and says so (a `DamageWarning` and a log record naming the file and `hsstore
repair`); writers and gc refuse until `hsstore repair` writes the files back; repair recovers
every sample whose bytes survive. Real files on disk, damaged by real deletion, truncation and
byte flips; the CLI through its real entry point."""

from __future__ import annotations

import json
import logging
import os
import shutil
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch

import hsstore
from hsstore import LayerSpec
from hsstore.commits.history import mark_key
from hsstore.loader import Loader
from hsstore.spec import paths
from tools.synthetic import random_sample

H = 16
LAYERS = [LayerSpec(1), LayerSpec(2)]
COMMITS = 6


@pytest.fixture(scope="module")
def pristine(tmp_path_factory) -> Path:
    """Six commits of ten samples each (version 1 creates, versions 2..7 add)."""
    path = tmp_path_factory.mktemp("pristine") / "ds"
    ds = hsstore.create(path, layers=LAYERS, hidden_size=H, dtype=torch.bfloat16,
                        chunk_bytes=1024, shard_bytes=4096)  # fmt: skip
    for c in range(COMMITS):
        with ds.writer(encode_threads=1) as w:
            for i in range(10):
                w.add(f"c{c}-s{i}", *random_sample(5 + i, len(LAYERS), H, seed=10 * c + i))
    return path


@pytest.fixture
def ds_path(pristine, tmp_path) -> Path:
    path = tmp_path / "ds"
    shutil.copytree(pristine, path)
    return path


def _bits(path: Path) -> dict[str, bytes]:
    return {s.sample_id: s.hidden.view(torch.int16).numpy().tobytes() for s in hsstore.open(path)}


def _damage(file: Path, how: str) -> None:
    if how == "deleted":
        file.unlink()
    elif how == "truncated":
        file.write_bytes(file.read_bytes()[: file.stat().st_size // 2])
    else:  # one flipped byte
        data = bytearray(file.read_bytes())
        data[len(data) // 3] ^= 0x20
        file.write_bytes(bytes(data))


def _cli(*args: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    return subprocess.run([sys.executable, "-c", "from hsstore.cli import main; main()", *args],
                          capture_output=True, text=True, env=env, timeout=300)  # fmt: skip


def _segments(path: Path) -> list[str]:
    return [s.id for s in hsstore.open(path).manifest.segments]


@pytest.mark.parametrize("how", ["deleted", "truncated", "flipped"])
def test_a_lost_middle_version_is_served_and_written_back(pristine, ds_path, how, caplog):
    truth = _bits(pristine)
    v3 = ds_path / paths.manifest_key(3)
    original = v3.read_bytes()
    _damage(v3, how)
    with (
        caplog.at_level(logging.WARNING, logger="hsstore"),
        pytest.warns(hsstore.DamageWarning, match="v00000003.json.*hsstore repair"),
    ):
        assert _bits(ds_path) == truth  # every sample, bit-exact, no repair needed
    assert any("v00000003.json" in r.getMessage() for r in caplog.records)
    with pytest.raises(hsstore.HsstoreError, match="hsstore repair"):
        hsstore.open(ds_path).writer()  # writers need the history whole
    with pytest.raises(hsstore.HsstoreError):
        hsstore.gc(ds_path, grace_s=0)  # gc never judges segments against a broken history
    assert not hsstore.verify(ds_path).ok
    fixed = hsstore.repair(ds_path)
    assert fixed.version is None and str(v3) in fixed.files_restored
    assert v3.read_bytes() == original  # byte for byte, from the copy in a commit mark
    assert hsstore.verify(ds_path, full=True).ok
    assert _bits(ds_path) == truth


def test_the_cli_on_a_lost_middle_version(pristine, ds_path):
    (ds_path / paths.manifest_key(3)).unlink()
    verify = _cli("verify", str(ds_path))
    assert verify.returncode == 1 and "v00000003.json: manifest version 3 is missing" in (
        verify.stdout
    )
    inspect = _cli("inspect", str(ds_path))
    assert inspect.returncode == 0 and "WARN  samples_readable" in inspect.stdout
    warning = [line for line in inspect.stderr.splitlines() if line.startswith("warning:")]
    assert len(warning) == 1 and "hsstore repair" in warning[0], inspect.stderr
    repair = _cli("repair", str(ds_path))
    assert repair.returncode == 0 and "wrote back" in repair.stdout, repair.stderr
    assert _cli("verify", str(ds_path)).returncode == 0


def test_a_version_without_a_copy_is_rebuilt_from_commit_marks(pristine, ds_path):
    """Marks written before they kept a copy name only their segment: the version is rebuilt
    from them (what else it recorded is lost and said to be), and repair bridges it with a
    checkpoint and records the decision."""
    truth = _bits(pristine)
    for seg in _segments(ds_path):
        mark = json.loads((ds_path / mark_key(seg)).read_text())
        del mark["delta"]
        (ds_path / mark_key(seg)).write_text(json.dumps(mark))
    (ds_path / paths.manifest_key(4)).unlink()
    with pytest.warns(hsstore.DamageWarning, match=r"version\(s\) 4 rebuilt from the segments"):
        assert _bits(ds_path) == truth
    fixed = hsstore.repair(ds_path)
    assert [r["action"] for r in fixed.repairs] == ["accepted"]
    assert "version 4" in fixed.repairs[0]["reason"] and fixed.repairs[0]["num_samples"] == 10
    assert (ds_path / paths.checkpoint_key(4)).exists()
    assert hsstore.verify(ds_path).ok  # the gap is bridged: a note, not a problem
    again = hsstore.open(ds_path)  # no warning: the history folds again
    assert again.rebuilt is None and _bits(ds_path) == truth
    with again.writer(encode_threads=1) as w:
        w.add("after", *random_sample(4, len(LAYERS), H, seed=99))
    assert len(hsstore.open(ds_path)) == len(truth) + 1


@pytest.mark.parametrize("how", ["deleted", "truncated", "flipped"])
def test_version_1_is_read_from_its_checkpoint_copy(pristine, ds_path, how):
    truth = _bits(pristine)
    v1 = ds_path / paths.manifest_key(1)
    original = v1.read_bytes()
    _damage(v1, how)
    with pytest.warns(hsstore.DamageWarning, match="v00000001.json"):
        assert _bits(ds_path) == truth
    assert str(v1) in hsstore.repair(ds_path).files_restored
    assert v1.read_bytes() == original and hsstore.verify(ds_path, full=True).ok


@pytest.mark.parametrize("how", ["deleted", "truncated", "flipped"])
def test_a_lost_index_is_read_from_its_copy_and_written_back(pristine, ds_path, how):
    truth = _bits(pristine)
    seg = _segments(ds_path)[2]
    index = ds_path / paths.segment_file(seg, paths.INDEX)
    original = index.read_bytes()
    _damage(index, how)
    opened = hsstore.open(ds_path)
    assert not opened.unreadable and _bits(ds_path) == truth
    report = hsstore.verify(ds_path)
    assert [p.where for p in report.problems] == [str(index)] and not report.bad_samples
    assert "its copy is intact" in report.problems[0].reason
    fixed = hsstore.repair(ds_path)
    assert fixed.version is None and str(index) in fixed.files_restored
    assert index.read_bytes() == original and hsstore.verify(ds_path).ok


def test_a_segment_whose_index_and_copy_are_lost_is_left_out_loudly(pristine, ds_path, caplog):
    truth = _bits(pristine)
    seg = _segments(ds_path)[2]
    for name in (paths.INDEX, paths.INDEX_COPY):
        (ds_path / paths.segment_file(seg, name)).unlink()
    with (
        caplog.at_level(logging.WARNING, logger="hsstore"),
        pytest.warns(hsstore.DamageWarning) as caught,
    ):
        opened = hsstore.open(ds_path)
    line = str(caught[0].message)
    assert "10 of the 60 committed samples" in line and "hsstore repair" in line
    assert f"{seg}/index.parquet" in line
    assert [r.getMessage() for r in caplog.records] == [line]
    assert len(opened) == 50
    inspect = _cli("inspect", str(ds_path))
    assert inspect.returncode == 1 and "FAIL  samples_readable" in inspect.stdout
    assert "10 of the 60 committed samples" in inspect.stdout
    with warnings.catch_warnings():
        warnings.simplefilter("error", hsstore.DamageWarning)  # its report says it, no warning
        fixed = hsstore.repair(ds_path)  # the ids are lost with both copies: dropped, on record
    assert [(r["action"], r["segment"]) for r in fixed.repairs] == [("dropped", seg)]
    assert _bits(ds_path) == {k: v for k, v in truth.items() if not k.startswith("c2-")}


@pytest.mark.parametrize(
    "relpath", ["zarr.json", "states/zarr.json", "stats.json", "input_ids/zarr.json"]
)
@pytest.mark.parametrize("how", ["deleted", "truncated"])
def test_segment_metadata_loss_costs_no_sample(pristine, ds_path, relpath, how):
    truth = _bits(pristine)
    seg = _segments(ds_path)[1]
    _damage(ds_path / paths.segment_file(seg, relpath), how)
    assert _bits(ds_path) == truth  # reads do not need it
    assert not hsstore.verify(ds_path).ok
    fixed = hsstore.repair(ds_path)  # the samples are written again into a whole segment
    assert fixed.samples_rewritten == 10 and fixed.dropped_samples == []
    assert hsstore.verify(ds_path).ok and _bits(ds_path) == truth


def test_lost_commit_marks_and_hint_are_written_back(pristine, ds_path):
    segs = _segments(ds_path)
    for seg in segs[:3]:
        (ds_path / mark_key(seg)).unlink()
    (ds_path / paths.LATEST_HINT).unlink()
    (ds_path / paths.checkpoint_key(1)).unlink()
    assert hsstore.verify(ds_path).ok  # redundancy lost, nothing damaged
    fixed = hsstore.repair(ds_path)
    assert fixed.hint_rewritten
    assert {str(ds_path / mark_key(s)) for s in segs[:3]} <= set(fixed.files_restored)
    assert str(ds_path / paths.checkpoint_key(1)) in fixed.files_restored
    assert all("delta" in json.loads((ds_path / mark_key(s)).read_text()) for s in segs)


def test_a_set_of_losses_at_once(pristine, ds_path):
    """A middle and the newest version, version 1, the hint, a mark and an index together."""
    truth = _bits(pristine)
    segs = _segments(ds_path)
    for key in (paths.manifest_key(3), paths.manifest_key(7), paths.manifest_key(1),
                paths.LATEST_HINT, mark_key(segs[0]),
                paths.segment_file(segs[4], paths.INDEX)):  # fmt: skip
        (ds_path / key).unlink()
    with pytest.warns(hsstore.DamageWarning, match="3 manifest file"):
        assert _bits(ds_path) == truth
    hsstore.repair(ds_path)
    assert hsstore.verify(ds_path, full=True).ok and _bits(ds_path) == truth
    assert hsstore.open(ds_path).rebuilt is None


def test_a_lost_checkpoint_of_a_pruned_history(pristine, ds_path):
    """gc --keep-versions leaves one checkpoint as the base; lost, the pruned versions are
    rebuilt from the marks and version 1's copy."""
    truth = _bits(pristine)
    hsstore.gc(ds_path, keep_versions=2, grace_s=60)
    base = ds_path / paths.checkpoint_key(COMMITS)
    assert base.exists()
    base.unlink()
    with pytest.warns(hsstore.DamageWarning, match="rebuilt exactly"):
        assert _bits(ds_path) == truth
    fixed = hsstore.repair(ds_path)  # writes the pruned versions back from the copies
    assert fixed.repairs == [] and str(ds_path / paths.manifest_key(1)) in fixed.files_restored
    assert hsstore.verify(ds_path).ok and _bits(ds_path) == truth
    assert hsstore.open(ds_path).rebuilt is None


def test_the_loader_refuses_a_view_that_leaves_samples_out(pristine, ds_path):
    """Training must not silently run on part of the data: the Loader refuses, naming the
    count, the file, `hsstore repair` and the option; with skip_damaged it trains on the rest."""
    seg = _segments(ds_path)[2]
    for name in (paths.INDEX, paths.INDEX_COPY):
        (ds_path / paths.segment_file(seg, name)).unlink()
    options = {"max_tokens": 256, "shuffle": False, "num_threads": 1}
    with (
        pytest.warns(hsstore.DamageWarning),
        pytest.raises(hsstore.IntegrityError, match="10 of the 60 committed samples") as info,
    ):
        Loader(ds_path, **options)
    assert f"{seg}/index.parquet" in str(info.value) and "hsstore repair" in str(info.value)
    assert "skip_damaged=True" in str(info.value)
    loader = Loader(ds_path, skip_damaged=True, **options)
    assert loader.left_out == 10
    delivered = sum(len(batch["lengths"]) for batch in loader)
    assert delivered == 50
