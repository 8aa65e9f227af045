"""Lost versions are never silent, the hint is only a hint, and `verify --full` reads the whole
history: on a local disk and on S3 (the real server), with files deleted or damaged through the
real storage."""

from __future__ import annotations

import json

import pytest
import torch
from click.testing import CliRunner

import hsstore
from hsstore import LayerSpec
from hsstore.cli import main
from hsstore.commits import commit
from hsstore.commits.history import mark_key
from hsstore.spec import paths
from hsstore.spec.sealing import seal_document
from hsstore.storage.locations import open_storage
from tools.synthetic import random_sample

H = 16
LAYERS = [LayerSpec(1), LayerSpec(2)]


def _build(location, commits: int = 3) -> hsstore.Dataset:
    ds = hsstore.create(location, layers=LAYERS, hidden_size=H, dtype=torch.bfloat16)
    for c in range(commits):
        with ds.writer(encode_threads=1) as w:
            for i in range(2):
                w.add(f"c{c}-s{i}", *random_sample(5 + i, len(LAYERS), H, seed=10 * c + i))
    return hsstore.open(location)


def _samples(ds: hsstore.Dataset) -> dict[str, bytes]:
    return {s.sample_id: s.hidden.view(torch.int16).numpy().tobytes() for s in ds}


@pytest.fixture(params=["local", "s3"])
def location(request, tmp_path):
    if request.param == "local":
        return str(tmp_path / "ds")
    return request.getfixturevalue("s3_url")


def _strip_copies(storage, ds: hsstore.Dataset) -> None:
    """Commit marks as a writer that kept no copy of its version file left them."""
    for seg in ds.manifest.segments:
        mark = json.loads(storage.read_bytes(mark_key(seg.id)))
        del mark["delta"]
        storage.put(mark_key(seg.id), json.dumps(mark).encode())


# -- item 5: deleting the newest version(s) ---------------------------------------------------
@pytest.mark.parametrize("copies", [True, False], ids=["marks-with-copies", "marks-without"])
@pytest.mark.parametrize("case", ["with-hint", "hint-behind", "two-newest"])
def test_a_lost_newest_version_is_refused_kept_by_gc_and_restored_by_repair(location, case, copies):
    """With the copies commit marks keep, a lost newest version is served rebuilt (saying
    so) and written back by repair; without them it is refused until repair lists its
    segments again. Either way writers and gc refuse, and nothing committed is lost."""
    ds = _build(location)
    truth = _samples(ds)
    storage = open_storage(location)
    if not copies:
        _strip_copies(storage, ds)
    newest = ds.manifest.version
    lost = [newest, newest - 1] if case == "two-newest" else [newest]
    for v in lost:
        storage.delete(paths.manifest_key(v))
    if case == "with-hint" or case == "two-newest":
        storage.delete(paths.LATEST_HINT)  # deleted together: the hint holds no evidence
    else:  # a crash before the announce: the hint still names the version before
        storage.delete(paths.LATEST_HINT)
        storage.put(paths.LATEST_HINT, f"{newest - 1}\n".encode())
    lost_segments = [s.id for s in ds.manifest.segments[-len(lost) :]]

    if copies:
        with pytest.warns(hsstore.DamageWarning, match="rebuilt exactly.*hsstore repair"):
            served = hsstore.open(location)
        assert _samples(served) == truth and served.manifest.version == newest
    else:
        with pytest.raises(hsstore.IntegrityError, match="deleted or rolled back"):
            hsstore.open(location)
    report = hsstore.verify(location)
    assert not report.ok
    assert any(seg in p.reason for p in report.problems for seg in lost_segments)
    with pytest.raises(hsstore.IntegrityError):  # no writer reuses the lost version number
        ds.writer()
    with pytest.raises(hsstore.IntegrityError):
        hsstore.gc(location, grace_s=0)
    result = CliRunner().invoke(main, ["gc", location, "--grace", "0"])
    assert result.exit_code == 2 and "rolled back" in result.output
    for seg in lost_segments:
        assert storage.exists(paths.segment_file(seg, paths.INDEX))

    fixed = hsstore.repair(location)
    again = hsstore.open(location)
    assert _samples(again) == truth  # nothing committed was lost
    if copies:  # written back byte for byte: no decision to record
        assert fixed.version is None and fixed.repairs == []
        assert {storage.path_of(paths.manifest_key(v)) for v in lost} <= set(fixed.files_restored)
    else:
        restored = {r["segment"] for r in fixed.repairs if r["action"] == "restored"}
        assert restored == set(lost_segments)
        assert again.manifest.provenance["repairs"][0]["action"] == "restored"
    assert hsstore.verify(location).ok
    with again.writer(encode_threads=1) as w:  # commits go on, gc too
        w.add("after", *random_sample(4, len(LAYERS), H, seed=99))
    assert hsstore.gc(location, grace_s=0).removed_segments == []
    assert len(hsstore.open(location)) == len(truth) + 1


def test_a_replaced_newest_version_is_refused(tmp_path):
    """Deleted, then published again by a writer that never saw it: the hint names the
    original's checksum, so the replacement is told apart."""
    ds = _build(tmp_path / "ds", commits=2)
    newest = ds.manifest.version
    key = tmp_path / "ds" / paths.manifest_key(newest)
    doc = __import__("json").loads(key.read_bytes())
    doc["committed_at"] = "2000-01-01T00:00:00.000+00:00"
    key.write_bytes(seal_document(doc))
    with pytest.raises(hsstore.IntegrityError, match="replaced"):
        hsstore.open(tmp_path / "ds")
    assert any("replaced" in p.reason for p in hsstore.verify(tmp_path / "ds").problems)


# -- item 6: the hint is only a hint -----------------------------------------------------------
def test_every_single_bit_flip_of_the_hint_is_ignored_and_reported(tmp_path):
    ds = _build(tmp_path / "ds", commits=2)
    hint_file = tmp_path / "ds" / paths.LATEST_HINT
    good = hint_file.read_bytes()
    reported = 0
    for bit in range(len(good) * 8):
        data = bytearray(good)
        data[bit // 8] ^= 1 << (bit % 8)
        hint_file.write_bytes(bytes(data))
        assert len(hsstore.open(tmp_path / "ds")) == len(ds)  # never a false "rolled back"
        problems = hsstore.verify(tmp_path / "ds", workers=1).problems
        if problems:
            assert [p.where for p in problems] == [str(hint_file)]
        else:  # only a flip of the final newline can leave the same text once stripped
            assert bit >= len(good) * 8 - 8
        reported += bool(problems)
    assert reported >= len(good) * 8 - 8
    hint_file.write_bytes(b"\x00garbage")
    report = hsstore.verify(tmp_path / "ds")
    assert [p.where for p in report.problems] == [str(hint_file)]
    assert "hint" in report.problems[0].reason
    with ds.writer(encode_threads=1) as w:  # a commit goes through and rewrites the hint
        w.add("x", *random_sample(3, len(LAYERS), H, seed=5))
    assert hsstore.verify(tmp_path / "ds").ok
    hsstore.gc(tmp_path / "ds", grace_s=0)


@pytest.mark.parametrize("damage", ["empty", "missing", "flipped"])
def test_a_bad_hint_still_lets_a_true_rollback_be_refused(location, damage):
    ds = _build(location, commits=2)
    storage = open_storage(location)
    hint = storage.read_bytes(paths.LATEST_HINT)
    storage.delete(paths.LATEST_HINT)
    if damage == "empty":
        storage.put(paths.LATEST_HINT, b"")
    elif damage == "flipped":
        storage.put(paths.LATEST_HINT, bytes([hint[0] ^ 0x04]) + hint[1:])
    opened = hsstore.open(location)  # the listing decides
    assert len(opened) == len(ds)
    report = hsstore.verify(location)
    if damage == "missing":
        assert report.ok and any("no version hint" in n for n in report.notes)
    else:
        assert [p.where for p in report.problems] == [storage.path_of(paths.LATEST_HINT)]
    storage.delete(paths.manifest_key(ds.manifest.version))
    # The segment's commit mark tells of the lost version: it is served from the mark's copy,
    # saying so, and no writer builds on the rolled-back listing.
    with pytest.warns(hsstore.DamageWarning, match="rebuilt exactly"):
        assert len(hsstore.open(location)) == len(ds)
    with pytest.raises(hsstore.IntegrityError, match="rolled back"):
        hsstore.open(location).writer()


# -- item 7: verify reads below the newest checkpoint with --full ------------------------------
@pytest.fixture(scope="module")
def long_history(tmp_path_factory):
    path = tmp_path_factory.mktemp("long") / "ds"
    ds = hsstore.create(path, layers=LAYERS, hidden_size=H, dtype=torch.bfloat16)
    with ds.writer(encode_threads=1) as w:
        for i in range(commit.CHECKPOINT_EVERY + 6):
            w.add(f"s{i}", *random_sample(3, len(LAYERS), H, seed=i))
            w.commit()
    return path


def test_verify_full_finds_a_truncated_delta_below_the_newest_checkpoint(long_history, tmp_path):
    import shutil

    path = tmp_path / "ds"
    shutil.copytree(long_history, path)
    v30 = path / paths.manifest_key(30)
    v30.write_bytes(v30.read_bytes()[:-20])
    plain = hsstore.verify(path)
    assert plain.ok and "--full" in plain.history  # its scope is said, not implied
    full = hsstore.verify(path, full=True)
    assert [p.where for p in full.problems] == [str(v30)]
    result = CliRunner().invoke(main, ["verify", str(path), "--full"])
    assert result.exit_code == 1 and str(v30) in result.output
    result = CliRunner().invoke(main, ["verify", str(path)])
    assert result.exit_code == 0 and "--full" in result.output


def test_verify_full_checks_the_hash_chain(long_history, tmp_path):
    import json
    import shutil

    path = tmp_path / "ds"
    shutil.copytree(long_history, path)
    assert hsstore.verify(path, full=True).ok
    v30 = path / paths.manifest_key(30)
    doc = json.loads(v30.read_bytes())
    doc["committed_at"] = "2000-01-01T00:00:00.000+00:00"  # replaced, resealed: reads fine
    v30.write_bytes(seal_document(doc))
    problems = hsstore.verify(path, full=True).problems
    assert [p.where for p in problems] == [str(path / paths.manifest_key(31))]
    assert "hash chain" in problems[0].reason
