"""Every malformed input is reported by name and reason through the CLI; nothing committed is lost."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

import hsstore
from hsstore.cli import main
from tools.convert_fixtures import v1_sample, write_v1_dir

LAYERS, H = [1, 3], 8


class Evil:
    """Any class outside torch's allow-list: a weights_only load must refuse to build it."""


def _good(t: int = 5, seed: int = 99) -> dict:
    return v1_sample(t, len(LAYERS), H, torch.bfloat16, seed)


def _truncated(p: Path) -> None:
    torch.save(_good(50), p)
    p.write_bytes(p.read_bytes()[: p.stat().st_size // 2])


def _save(obj: dict):
    return lambda p: torch.save(obj, p)


def _with(**changes) -> dict:
    s = _good()
    s.update(changes)
    return s


def _nan() -> dict:
    s = _good()
    s["hidden_states"][1][2, 3] = float("nan")
    return s


def _inf() -> dict:
    s = _good()
    s["hidden_states"][0][4, 0] = float("-inf")
    return s


def _short_layer() -> dict:
    s = _good()
    s["hidden_states"][1] = s["hidden_states"][1][:4]
    return s


def _missing_key() -> dict:
    s = _good()
    del s["loss_mask"]
    return s


CASES = {
    "truncated": (_truncated, "truncated or corrupt torch.save archive"),
    "not-zip": (
        lambda p: p.write_bytes(b"this is not a torch file\n" * 4),
        "not a torch.save archive (not a zip file)",
    ),
    "empty": (lambda p: p.write_bytes(b""), "empty file (0 bytes)"),
    "unsafe-pickle": (
        _save({**_good(), "extra": Evil()}),
        "refused by torch.load(weights_only=True)",
    ),
    "missing-key": (_save(_missing_key()), "missing key(s) 'loss_mask'"),
    "not-a-dict": (_save([torch.zeros(3)]), "expected a dict of tensors, found list"),
    "ids-int32": (
        _save(_with(input_ids=torch.arange(5, dtype=torch.int32))),
        "input_ids has dtype torch.int32, expected torch.int64",
    ),
    "mask-bool": (
        _save(_with(loss_mask=torch.ones(5, dtype=torch.bool))),
        "loss_mask has dtype torch.bool, expected torch.int64",
    ),
    "hidden-fp32": (
        _save(_with(hidden_states=[torch.zeros(5, H), torch.zeros(5, H)])),
        "hidden_states[0] has dtype torch.float32, expected torch.bfloat16",
    ),
    "hidden-not-list": (
        _save(_with(hidden_states=torch.zeros(5, 2, H, dtype=torch.bfloat16))),
        "expected a list of [T, H] tensors",
    ),
    "length-mismatch": (_save(_short_layer()), "hidden_states[1] has 4 tokens but input_ids has 5"),
    "mask-length": (
        _save(_with(loss_mask=torch.ones(4, dtype=torch.int64))),
        "loss_mask has 4 tokens but input_ids has 5",
    ),
    "ids-negative": (
        _save(_with(input_ids=torch.tensor([5, -1, 7, 8, 9]))),
        "input_ids hold -1, outside [0, 2^31)",
    ),
    "mask-values": (
        _save(_with(loss_mask=torch.full((5,), 2, dtype=torch.int64))),
        "loss_mask holds values other than 0 and 1",
    ),
    "nan": (_save(_nan()), "hidden states contain NaN"),
    "inf": (_save(_inf()), "hidden states contain Inf"),
}


def run(*args: str):
    return CliRunner().invoke(main, ["convert", *args, "--no-progress"])


@pytest.fixture
def committed(tmp_path):
    """A source of 3 good files already converted (committed) into ds."""
    src, ds = tmp_path / "v1", tmp_path / "ds"
    write_v1_dir(src, [3, 4, 5], layer_ids=LAYERS, hidden_size=H)
    r = run(str(src), str(ds))
    assert r.exit_code == 0, r.output
    before = {s.sample_id: s.hidden.clone() for s in hsstore.open(ds)}
    assert len(before) == 3
    return src, ds, before


def assert_still_there(ds: Path, before: dict) -> hsstore.Dataset:
    d = hsstore.open(ds)
    for sid, hidden in before.items():
        assert torch.equal(d.get(sid).hidden.view(torch.int16), hidden.view(torch.int16))
    assert hsstore.verify(ds).ok
    return d


@pytest.mark.parametrize("case", sorted(CASES))
def test_each_malformed_file_fails_with_its_name_and_reason(committed, case):
    src, ds, before = committed
    make, reason = CASES[case]
    make(src / "data_3.pt")
    torch.save(_good(6, seed=4), src / "data_4.pt")
    r = run(str(src), str(ds))
    assert r.exit_code == 2, r.output
    assert "Traceback" not in r.output
    bad_line = next(ln for ln in r.stderr.splitlines() if ln.startswith("bad input:"))
    assert str(src / "data_3.pt") in bad_line and reason in bad_line
    assert r.stderr.strip().splitlines()[-1].startswith("error: ")
    assert "1 bad input file(s)" in r.stderr
    d = assert_still_there(ds, before)
    assert "data_3" not in d and "data_4" not in d  # fail stops writing at the first bad file


def test_fail_lists_every_bad_file_before_failing(committed):
    src, ds, before = committed
    CASES["truncated"][0](src / "data_3.pt")
    torch.save(_good(6, seed=4), src / "data_4.pt")
    CASES["nan"][0](src / "data_5.pt")
    r = run(str(src), str(ds), "--workers", "2", "--commit-every", "1")
    assert r.exit_code == 2
    bad = [ln for ln in r.stderr.splitlines() if ln.startswith("bad input:")]
    assert len(bad) == 2
    assert "data_3.pt" in bad[0] and "truncated" in bad[0]
    assert "data_5.pt" in bad[1] and "NaN" in bad[1]
    assert "2 bad input file(s)" in r.stderr
    assert_still_there(ds, before)


def test_skip_converts_the_rest_and_records_what_it_skipped(committed):
    src, ds, before = committed
    CASES["not-zip"][0](src / "data_3.pt")
    torch.save(_good(6, seed=4), src / "data_4.pt")
    CASES["unsafe-pickle"][0](src / "data_5.pt")
    r = run(str(src), str(ds), "--on-error", "skip", "--json")
    assert r.exit_code == 0, r.output
    summary = json.loads(r.stdout)
    assert (
        summary["added"] == 1 and summary["already_present"] == 3 and summary["total_samples"] == 4
    )
    assert [s["name"] for s in summary["skipped"]] == ["data_3.pt", "data_5.pt"]
    assert "weights_only" in summary["skipped"][1]["reason"]
    assert sum(ln.startswith("skipped:") for ln in r.stderr.splitlines()) == 2
    d = assert_still_there(ds, before)
    assert "data_4" in d and "data_3" not in d
    recorded = d.manifest.provenance["skipped"]
    assert [s["name"] for s in recorded] == ["data_3.pt", "data_5.pt"]
    # A rerun adds nothing and does not record the same skips twice.
    r = run(str(src), str(ds), "--on-error", "skip")
    assert r.exit_code == 0
    assert hsstore.open(ds).manifest.provenance["skipped"] == recorded


def test_missing_config_needs_layer_ids_on_the_command_line(tmp_path):
    src = tmp_path / "v1"
    write_v1_dir(src, [3, 4], layer_ids=LAYERS, hidden_size=H, with_config=False)
    r = run(str(src), str(tmp_path / "ds"))
    assert r.exit_code == 2 and "--layer-ids" in r.stderr and str(src) in r.stderr
    assert not (tmp_path / "ds").exists()
    r = run(str(src), str(tmp_path / "ds"), "--layer-ids", "1,3", "--num-hidden-layers", "4")
    assert r.exit_code == 0, r.output
    assert [s.depth for s in hsstore.open(tmp_path / "ds").layers] == [2, 4]
    r = run(str(src), str(tmp_path / "ds2"), "--layer-ids", "one,two")
    assert r.exit_code == 2 and "expected integers" in r.output


def test_unknown_source_is_a_clear_error(tmp_path):
    (tmp_path / "src").mkdir()
    r = run(str(tmp_path / "src"), str(tmp_path / "ds"))
    assert r.exit_code == 2 and "cannot tell the format" in r.stderr and "--from" in r.stderr
    r = run(str(tmp_path / "missing"), str(tmp_path / "ds"))
    assert r.exit_code == 2 and "no such file or directory" in r.stderr
