"""`hsstore demo`: the README's main command runs the whole pipeline and says so."""

from __future__ import annotations

import json

from click.testing import CliRunner

import hsstore
from hsstore.cli import main


def test_demo_runs_end_to_end(tmp_path):
    out = tmp_path / "demo"
    result = CliRunner().invoke(main, ["demo", str(out), "--json"])
    assert result.exit_code == 0, result.output
    summary = json.loads(result.output[result.output.index("{") :])
    ds = hsstore.open(out / "dataset")
    assert summary["extract"]["samples_written"] == len(ds) > 0
    assert summary["verify_ok"] is True and summary["inspect_verdict"] == "OK"
    assert summary["v1_files"] == len(ds) == len(list((out / "speculators_v1").glob("data_*.pt")))
    batch = summary["batch"]
    k = len(ds.layers) - 1
    assert batch["hidden_states"] == [1, 256, k * ds.hidden_size]
    assert batch["verifier_last_hidden_states"] == [1, 256, ds.hidden_size]
    again = CliRunner().invoke(main, ["demo", str(out)])
    assert again.exit_code == 2 and "already exists" in again.output
