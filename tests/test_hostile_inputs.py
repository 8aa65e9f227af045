"""Hostile input: every case becomes one line naming the file or sample, exit 2, never a hang.

The CLI cases run the real command in a child process with a time limit, because what they
guard against is a hang (a FIFO, /dev/zero, a zero-width state) or a process-wide limit (a full
disk); nothing committed before the bad input may be lost.
"""

from __future__ import annotations

import gc
import json
import os
import resource
import signal
import struct
import subprocess
import sys
import zipfile
import zlib
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from torch.utils import serialization

import hsstore
from hsstore import LayerSpec
from hsstore.cli import main
from hsstore.errors import BadInputError, FormatError
from hsstore.interop.formats.safe_load import INFLATE_FLOOR_BYTES, load_torch_file
from hsstore.interop.formats.speculators_v1 import SpeculatorsV1Reader
from hsstore.spec.layout import Layout
from tools.convert_fixtures import v1_sample, write_specforge_dir, write_v1_dir

REPO = Path(__file__).resolve().parents[1]
CLI = "from hsstore.cli import main; main()"
LAYER_IDS, H = [1, 3], 8


def cli(*args: str, timeout: float = 90, preexec_fn=None) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    return subprocess.run(
        [sys.executable, "-c", CLI, *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=REPO,
        env=env,
        preexec_fn=preexec_fn,
    )


def problem_lines(r: subprocess.CompletedProcess) -> list[str]:
    """The lines a failed command printed about problems; never a traceback."""
    assert "Traceback" not in r.stderr, r.stderr
    return [ln for ln in r.stderr.splitlines() if ln.startswith(("error: ", "bad input: "))]


def assert_one_error(r: subprocess.CompletedProcess, *needles: str) -> str:
    assert r.returncode == 2, (r.returncode, r.stdout, r.stderr)
    lines = problem_lines(r)
    assert len(lines) == 1, r.stderr
    for needle in needles:
        assert needle in lines[0], lines[0]
    return lines[0]


def convert_cli(src: Path, dst: Path, *extra: str, **kw) -> subprocess.CompletedProcess:
    return cli("convert", str(src), str(dst), "--no-progress", *extra, **kw)


def v1_source(tmp_path: Path, lengths=(3, 4)) -> Path:
    src = tmp_path / "v1"
    write_v1_dir(src, list(lengths), layer_ids=LAYER_IDS, hidden_size=H)
    (src / "sample_lengths.json").unlink()  # the damaged files below change lengths
    return src


# ------------------------------------------------------------------ item 4: sizes that never end


@pytest.mark.timeout(60)
@pytest.mark.parametrize("hidden_size", [0, -1, -4096, True, 8.0, 2**40])
def test_create_refuses_a_hidden_size_that_is_not_a_positive_int(tmp_path, hidden_size):
    with pytest.raises(BadInputError, match="hidden_size") as err:
        hsstore.create(
            tmp_path / "ds", layers=[LayerSpec(1)], hidden_size=hidden_size, dtype=torch.bfloat16
        )
    assert str(tmp_path / "ds") in str(err.value)
    assert not (tmp_path / "ds").exists()


@pytest.mark.timeout(60)
@pytest.mark.parametrize("field", ["num_layers", "hidden_size", "itemsize", "chunk_bytes"])
def test_layout_choose_refuses_non_positive_sizes(field):
    sizes = {"num_layers": 2, "hidden_size": 8, "itemsize": 2, "chunk_bytes": 1 << 20}
    sizes[field] = 0
    with pytest.raises(FormatError, match=field):
        Layout.choose(**sizes)


def _zero_width_source(tmp_path: Path) -> Path:
    src = tmp_path / "v1"
    write_v1_dir(src, [5], layer_ids=LAYER_IDS, hidden_size=H)
    empty = torch.zeros(5, 0, dtype=torch.bfloat16)
    sample = v1_sample(5, 2, H, torch.bfloat16, 0)
    torch.save({**sample, "hidden_states": [empty, empty.clone()]}, src / "data_0.pt")
    cfg = json.loads((src / "data_config.json").read_text())
    cfg["model"]["hidden_size"] = 0
    (src / "data_config.json").write_text(json.dumps(cfg))
    return src


def test_convert_of_zero_width_states_fails_in_one_line(tmp_path):
    src = _zero_width_source(tmp_path)
    r = convert_cli(src, tmp_path / "ds", timeout=60)
    assert_one_error(r, str(src / "data_0.pt"), "width 0")
    assert not (tmp_path / "ds").exists()


def test_inspect_of_zero_width_states_fails_in_one_line(tmp_path):
    src = _zero_width_source(tmp_path)
    assert_one_error(cli("inspect", str(src), timeout=60), str(src / "data_0.pt"), "width 0")


def _plant_unreadable(path: Path, kind: str) -> None:
    if kind == "fifo":
        os.mkfifo(path)
    else:
        path.symlink_to("/dev/zero")


@pytest.mark.parametrize("kind", ["fifo", "dev-zero-link"])
def test_convert_refuses_a_file_that_is_not_regular(tmp_path, kind):
    src = v1_source(tmp_path, lengths=(3,))
    _plant_unreadable(src / "data_1.pt", kind)
    dst = tmp_path / "ds"
    r = convert_cli(src, dst, timeout=60)
    assert r.returncode == 2, r.stderr
    bad = [ln for ln in problem_lines(r) if ln.startswith("bad input: ")]
    assert len(bad) == 1 and str(src / "data_1.pt") in bad[0]
    assert "not a regular file" in bad[0]
    assert hsstore.open(dst).sample_ids == ["data_0"]  # the good file before it is committed


@pytest.mark.parametrize("kind", ["fifo", "dev-zero-link"])
def test_inspect_names_a_file_that_is_not_regular(tmp_path, kind):
    src = v1_source(tmp_path, lengths=(3,))
    _plant_unreadable(src / "data_1.pt", kind)
    r = cli("inspect", str(src), timeout=60)
    assert r.returncode == 1, r.stderr  # the audit ran and failed the unreadable sample
    assert "Traceback" not in r.stderr
    failed = [ln for ln in r.stdout.splitlines() if "samples_readable" in ln]
    assert failed and "FAIL" in failed[0] and str(src / "data_1.pt") in failed[0]
    assert "not a regular file" in failed[0]


# ------------------------------------------------------------------ item 5: samples and writers


def _tokens(t: int) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.arange(t), torch.ones(t, dtype=torch.int64)


def _small_dataset(path: Path) -> hsstore.Dataset:
    return hsstore.create(path, layers=[LayerSpec(1)], hidden_size=H, dtype=torch.bfloat16)


@pytest.mark.parametrize(
    ("sample_id", "source", "reason"),
    [
        ("bad-\udcff", None, "lone surrogate"),
        ("ok-id", 7, "source must be a string"),
        ("ok-id", b"file.pt", "source must be a string"),
        ("ok-id", "file-\ud800.pt", "lone surrogate"),
        ("x" * 5000, None, "more than 4096"),
    ],
)
def test_add_refuses_what_a_commit_could_not_store_and_keeps_the_good(
    tmp_path, sample_id, source, reason
):
    ds = _small_dataset(tmp_path / "ds")
    hidden = torch.randn(4, 1, H).bfloat16()
    with ds.writer() as w:
        w.add("good-0", *_tokens(4), hidden)
        with pytest.raises(BadInputError, match=reason) as err:
            w.add(sample_id, *_tokens(4), hidden, source=source)
        assert str(tmp_path / "ds") in str(err.value)
        w.add("good-1", *_tokens(4), hidden)
    back = hsstore.open(tmp_path / "ds")
    assert back.sample_ids == ["good-0", "good-1"]
    assert torch.equal(back.get("good-1").hidden.view(torch.int16), hidden.view(torch.int16))


@pytest.mark.parametrize("how", ["close", "drop"])
def test_a_finished_writer_does_not_keep_its_segment_locked(tmp_path, how):
    ds = _small_dataset(tmp_path / "ds")
    w = ds.writer()
    w.add("never-committed", *_tokens(4), torch.randn(4, 1, H).bfloat16())
    segments = tmp_path / "ds" / "segments"
    pending = [p.name for p in segments.iterdir() if p.is_dir()]
    assert len(pending) == 1
    assert hsstore.gc(tmp_path / "ds", grace_s=0).live_segments == pending  # still writing
    if how == "close":
        w.close()
    else:
        del w
        gc.collect()
    report = hsstore.gc(tmp_path / "ds", grace_s=0)
    assert report.removed_segments == pending and report.live_segments == []
    assert not (segments / pending[0]).exists()


# ------------------------------------------------------------------ item 6: data_config.json


@pytest.mark.parametrize("value", ["abc", 8.0, [8], None])
def test_a_bad_hidden_size_in_data_config_is_one_line(tmp_path, value):
    src = v1_source(tmp_path, lengths=(3,))
    cfg = json.loads((src / "data_config.json").read_text())
    if value is None:
        cfg["model"] = "not an object"
    else:
        cfg["model"]["hidden_size"] = value
    (src / "data_config.json").write_text(json.dumps(cfg))
    r = convert_cli(src, tmp_path / "ds", timeout=60)
    assert_one_error(r, str(src / "data_config.json"))
    if value == "abc":
        r = cli("inspect", str(src), timeout=60)
        assert_one_error(r, str(src / "data_config.json"), "model.hidden_size is 'abc'")


def test_a_length_that_is_not_a_count_is_one_line(tmp_path):
    src = v1_source(tmp_path, lengths=(3,))
    (src / "sample_lengths.json").write_text(json.dumps({"0": "3"}))
    with pytest.raises(BadInputError, match="length of sample '0' is '3'") as err:
        SpeculatorsV1Reader(src)
    assert str(src / "sample_lengths.json") in str(err.value)


def test_a_deeply_nested_data_config_is_one_line(tmp_path):
    src = v1_source(tmp_path, lengths=(3,))
    (src / "data_config.json").write_text("[" * 100_000 + "]" * 100_000)
    with pytest.raises(BadInputError, match="nested too deeply") as err:
        SpeculatorsV1Reader(src)
    assert str(src / "data_config.json") in str(err.value)


def _gzip_bomb(path: Path, expanded_bytes: int) -> None:
    """A gzip stream of zeros: a few hundred KiB on disk, ``expanded_bytes`` once inflated."""
    deflate = zlib.compressobj(1, zlib.DEFLATED, 31)
    block = bytes(1 << 20)
    with open(path, "wb") as f:
        for _ in range(expanded_bytes >> 20):
            f.write(deflate.compress(block))
        f.write(deflate.flush())


def test_a_gzip_bomb_is_refused_before_it_is_inflated(tmp_path):
    src = tmp_path / "sf"
    write_specforge_dir(src, [3, 4], num_aux=1, hidden_size=H, compress=True)
    bomb = src / "rows_0-2" / "data_1.ckpt.gz"
    _gzip_bomb(bomb, INFLATE_FLOOR_BYTES + (32 << 20))
    assert bomb.stat().st_size < 2 << 20
    with pytest.raises(BadInputError, match="decompression bomb") as err:
        load_torch_file(bomb)
    assert str(bomb) in str(err.value)
    r = convert_cli(
        src, tmp_path / "ds", "--layer-ids", "1", "--num-hidden-layers", "4", timeout=120
    )
    assert r.returncode == 2, r.stderr
    bad = [ln for ln in problem_lines(r) if ln.startswith("bad input: ")]
    assert len(bad) == 1 and str(bomb) in bad[0] and "decompression bomb" in bad[0]
    assert hsstore.open(tmp_path / "ds").sample_ids == ["data_0"]


# ------------------------------------------------------------------ item 7: damaged .pt, layer ids


def _flip_tensor_bit(path: Path) -> str:
    """Flip one bit inside the first tensor's bytes; returns that zip member's name."""
    with zipfile.ZipFile(path) as zf:
        info = next(i for i in zf.infolist() if "/data/" in i.filename)
    raw = bytearray(path.read_bytes())
    # The member's data follows its local header: 30 bytes, then its name and extra field.
    name_len, extra_len = struct.unpack_from("<HH", raw, info.header_offset + 26)
    raw[info.header_offset + 30 + name_len + extra_len + info.file_size // 2] ^= 0x10
    path.write_bytes(bytes(raw))
    return info.filename


def test_convert_refuses_a_pt_whose_zip_crc_fails(tmp_path):
    src = v1_source(tmp_path, lengths=(3, 4, 5))
    member = _flip_tensor_bit(src / "data_1.pt")
    dst = tmp_path / "ds"
    r = convert_cli(src, dst, timeout=60)
    assert r.returncode == 2, r.stderr
    bad = [ln for ln in problem_lines(r) if ln.startswith("bad input: ")]
    assert len(bad) == 1 and str(src / "data_1.pt") in bad[0]
    assert member in bad[0] and "CRC" in bad[0]
    assert hsstore.open(dst).sample_ids == ["data_0"]

    # A file saved without CRCs (torch lets a writer turn them off) has nothing to check and
    # still reads bit for bit.
    sample = v1_sample(6, 2, H, torch.bfloat16, 7)
    serialization.config.save.compute_crc32 = False
    try:
        torch.save(sample, src / "data_1.pt")
    finally:
        serialization.config.save.compute_crc32 = True
    with zipfile.ZipFile(src / "data_1.pt") as zf:
        assert {i.CRC for i in zf.infolist()} == {0}
    item = SpeculatorsV1Reader(src).read(1)
    for k, layer in enumerate(sample["hidden_states"]):
        assert torch.equal(item.hidden[:, k].view(torch.int16), layer.view(torch.int16))


@pytest.mark.parametrize(
    "args",
    [
        ["--layer-ids", "1,999999999999"],
        ["--layer-ids", "1,3", "--num-hidden-layers", "999999999999"],
    ],
)
def test_convert_refuses_layer_ids_outside_any_model(tmp_path, args):
    src = tmp_path / "v1"
    write_v1_dir(src, [3], layer_ids=LAYER_IDS, hidden_size=H, with_config=False)
    r = convert_cli(src, tmp_path / "ds", *args, timeout=60)
    assert_one_error(r, str(src))
    assert not (tmp_path / "ds").exists()


@pytest.mark.parametrize(
    ("layers", "model", "reason"),
    [
        ([LayerSpec(2), LayerSpec(2)], None, "same state"),
        ([LayerSpec(4, final_norm=True), LayerSpec(4, final_norm=True)], None, "same state"),
        ([LayerSpec(2), LayerSpec(5)], {"num_hidden_layers": 4}, "depth 5"),
        ([{"depth": 999999999999}], None, "layer depth"),
        ([LayerSpec(1)], {"num_hidden_layers": 999999999999}, "num_hidden_layers"),
    ],
)
def test_create_refuses_bad_layer_lists(tmp_path, layers, model, reason):
    with pytest.raises(BadInputError, match=reason) as err:
        hsstore.create(
            tmp_path / "ds", layers=layers, hidden_size=H, dtype=torch.bfloat16, model=model
        )
    assert str(tmp_path / "ds") in str(err.value)
    assert not (tmp_path / "ds").exists()


def test_layer_spec_refuses_an_implausible_depth():
    with pytest.raises(ValueError, match="layer depth"):
        LayerSpec(999999999999)


# ------------------------------------------------------------------ item 10: a full disk


def _file_size_limit(nbytes: int):
    """Make the child's writes past ``nbytes`` per file fail with EFBIG, as a full disk would.

    (A real full disk needs a mount, which CI runners rarely allow; the error path is the same.)
    """

    def apply() -> None:
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # else the kernel kills the child
        resource.setrlimit(resource.RLIMIT_FSIZE, (nbytes, nbytes))

    return apply


def test_a_full_disk_names_the_path_and_keeps_what_was_committed(tmp_path):
    first, more, dst = tmp_path / "first", tmp_path / "more", tmp_path / "ds"
    write_v1_dir(first, [300, 300], layer_ids=LAYER_IDS, hidden_size=256)
    r = convert_cli(first, dst, timeout=60)
    assert r.returncode == 0, r.stderr
    before = {s.sample_id: s.hidden.clone() for s in hsstore.open(dst)}
    write_v1_dir(more, [300, 300, 300, 300], layer_ids=LAYER_IDS, hidden_size=256, seed=10)
    for i in range(2):  # keep data_2 and data_3: new sample ids for the dataset
        (more / f"data_{i}.pt").unlink()

    r = convert_cli(more, dst, timeout=60, preexec_fn=_file_size_limit(64 << 10))
    line = assert_one_error(r)
    assert line.startswith(f"error: {dst}{os.sep}segments{os.sep}"), line  # the file it failed on
    assert "File too large" in line
    back = hsstore.open(dst)
    assert sorted(back.sample_ids) == sorted(before)
    for sid, hidden in before.items():
        assert torch.equal(back.get(sid).hidden.view(torch.int16), hidden.view(torch.int16))
    assert hsstore.verify(dst).ok


@pytest.mark.parametrize(
    ("option", "value"), [("--commit-every", "0"), ("--workers", "-3"), ("--commit-gb", "0")]
)
def test_convert_refuses_counts_below_one_as_a_usage_error(tmp_path, option, value):
    src = v1_source(tmp_path, lengths=(3,))
    r = CliRunner().invoke(main, ["convert", str(src), str(tmp_path / "ds"), option, value])
    assert r.exit_code == 2, r.output
    assert r.exception is None or isinstance(r.exception, SystemExit)
    assert f"Invalid value for '{option}'" in r.output
    assert not (tmp_path / "ds").exists()


def test_a_full_disk_during_export_names_the_file(tmp_path):
    src, ds, out = tmp_path / "v1", tmp_path / "ds", tmp_path / "out"
    write_v1_dir(src, [300, 300], layer_ids=LAYER_IDS, hidden_size=256)
    assert convert_cli(src, ds, timeout=60).returncode == 0
    r = convert_cli(
        ds, out, "--to", "speculators-v1", timeout=60, preexec_fn=_file_size_limit(64 << 10)
    )
    line = assert_one_error(r, "File too large")
    assert line.startswith(f"error: {out}{os.sep}data_"), line
    assert not [p for p in out.iterdir() if p.name.endswith(".tmp")]  # no partial file left
