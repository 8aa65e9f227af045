"""`hsstore inspect`: exit codes, the documented JSON (validated against its schema), --plot,
foreign directories, and one-line errors for bad input."""

from __future__ import annotations

import json
import math
from pathlib import Path

import jsonschema
import pytest
import torch
from audit_helpers import LAYERS, Tiny, clean_rows, make_tiny, write_dataset
from click.testing import CliRunner

import hsstore
from hsstore.cli import main
from hsstore.interop.formats.speculators_v1 import write_sample
from tools.convert_fixtures import v1_data_config

SCHEMA = json.loads((Path(__file__).parents[1] / "schemas" / "inspect.schema.json").read_text())


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Tiny:
    return make_tiny(tmp_path_factory.mktemp("tiny"))


@pytest.fixture(scope="module")
def clean(tiny, tmp_path_factory) -> Path:
    return write_dataset(tmp_path_factory.mktemp("clean") / "ds", clean_rows(tiny.samples))


def inspect(*args: str):
    return CliRunner().invoke(main, ["inspect", *map(str, args)])


def parsed(res) -> dict:
    doc = json.loads(res.stdout)
    jsonschema.Draft202012Validator(SCHEMA).validate(doc)
    return doc


def test_clean_dataset_text_report_exits_0(clean):
    res = inspect(clean)
    assert res.exit_code == 0, res.output
    for part in ("lengths", "loss tokens", "on disk", "after 4 +final_norm", "verdict: OK"):
        assert part in res.stdout


def test_clean_json_matches_schema_and_content(clean, tiny):
    doc = parsed(inspect(clean, "--json", "--model", tiny.model_dir, "--model-samples", "1"))
    assert doc["verdict"] == "OK" and doc["counts"]["FAIL"] == 0
    assert next(c for c in doc["checks"] if c["name"] == "model_recompute")["verdict"] == "OK"
    assert doc["summary"]["samples"] == len(tiny.samples)
    assert doc["summary"]["tokens"] == sum(len(s.input_ids) for s in tiny.samples)
    assert [x["depth"] for x in doc["summary"]["layers"]] == [1, 2, 3, LAYERS]
    assert {c["name"] for c in doc["checks"]} == set(
        SCHEMA["$defs"]["check"]["properties"]["name"]["enum"]
    )
    assert doc["lm_head"]["tables"][0]["layer"] == 3
    ds = hsstore.open(clean)
    for entry, ws in zip(doc["layers"], ds.layer_stats(), strict=True):
        assert entry["write_time"]["rows"] == ws.rows


def test_faulty_dataset_exits_1_and_json_says_why(tiny, tmp_path):
    rows = clean_rows(tiny.samples)
    sid, ids, mask, h = rows[0]
    h = h.clone()
    h[3, 0] = math.nan
    rows[0] = (sid, ids, mask, h)
    path = write_dataset(tmp_path / "ds", rows)
    res = inspect(path, "--json")
    assert res.exit_code == 1
    doc = parsed(res)
    assert doc["verdict"] == "FAIL"
    assert next(c for c in doc["checks"] if c["name"] == "nonfinite")["verdict"] == "FAIL"
    assert doc["layers"][0]["read"]["nan"] >= 1
    assert inspect(path).exit_code == 1


def test_corrupted_bytes_fail_inspect(clean, tmp_path):
    import shutil

    path = tmp_path / "ds"
    shutil.copytree(clean, path)
    ds = hsstore.open(path)
    shard = next((path / "segments" / ds.manifest.segments[0].id / "states" / "c").glob("0/0/0"))
    shard.chmod(0o644)
    data = bytearray(shard.read_bytes())
    data[len(data) // 3] ^= 0x55
    shard.write_bytes(bytes(data))
    res = inspect(path, "--full", "--json")
    assert res.exit_code == 1
    check = next(c for c in parsed(res)["checks"] if c["name"] == "samples_readable")
    assert check["verdict"] == "FAIL" and check["details"]["samples"]


def test_plot_writes_a_png(clean, tmp_path):
    out = tmp_path / "fig.png"
    res = inspect(clean, "--plot", out)
    assert res.exit_code == 0, res.output
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def _v1_dir(root: Path, tiny: Tiny, truncate: int | None = None) -> Path:
    """The tiny samples as a speculators v1 directory (ids 0..3 = depths 1..4, pre-norm)."""
    root.mkdir()
    for i, s in enumerate(tiny.samples):
        hidden = torch.stack([s.states[d] for d in range(1, LAYERS + 1)], dim=1)
        if truncate is not None and i == truncate:
            hidden = hidden[:-3]  # rows dropped, as a prefix cache or chunked prefill does
        write_sample(root / f"data_{i}.pt", s.input_ids, s.loss_mask, hidden)
    cfg = v1_data_config(list(range(LAYERS)), hidden.shape[-1], len(tiny.samples))
    (root / "data_config.json").write_text(json.dumps(cfg))
    return root


def test_speculators_v1_directory_is_audited_read_only(tiny, tmp_path):
    src = _v1_dir(tmp_path / "v1", tiny)
    before = sorted(p.name for p in src.iterdir())
    res = inspect(src, "--json", "--lm-head", tiny.model_dir)
    assert res.exit_code == 0, res.output
    doc = parsed(res)
    assert doc["summary"]["format"] == "speculators-v1"
    assert [x["source_id"] for x in doc["summary"]["layers"]] == list(range(LAYERS))
    verdicts = {c["name"]: c["verdict"] for c in doc["checks"]}
    assert verdicts["lm_head_alignment"] == "OK" and verdicts["final_norm_exact"] == "OK"
    assert verdicts["token_ids_in_vocab"] == "OK"  # vocab size taken from the model's head
    assert sorted(p.name for p in src.iterdir()) == before


def test_speculators_v1_truncated_rows_fail(tiny, tmp_path):
    src = _v1_dir(tmp_path / "v1", tiny, truncate=2)
    res = inspect(src, "--json")
    assert res.exit_code == 1
    check = next(c for c in parsed(res)["checks"] if c["name"] == "samples_readable")
    assert check["verdict"] == "FAIL"
    assert [s["sample_id"] for s in check["details"]["samples"]] == ["data_2"]
    assert "data_2.pt" in check["details"]["samples"][0]["error"]


def _one_line_error(res, *needles: str) -> None:
    assert res.exit_code == 2, res.output
    assert res.stdout == ""
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error:"), res.stderr
    for n in needles:
        assert n in lines[0]


def test_missing_path_exits_2(tmp_path):
    _one_line_error(inspect(tmp_path / "nope"), "nope")


def test_not_a_dataset_exits_2(tmp_path):
    (tmp_path / "junk").mkdir()
    (tmp_path / "junk" / "notes.txt").write_text("hello")
    _one_line_error(inspect(tmp_path / "junk"), "junk", "not")


def test_bad_lm_head_dirs_exit_2(clean, tmp_path):
    _one_line_error(inspect(clean, "--lm-head", tmp_path / "none"), "none")
    empty = tmp_path / "empty"
    empty.mkdir()
    (empty / "config.json").write_text("{}")
    _one_line_error(inspect(clean, "--lm-head", empty), "safetensors")


def test_lm_head_of_another_width_exits_2(clean, tmp_path):
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                      num_attention_heads=2, num_key_value_heads=2, vocab_size=64)  # fmt: skip
    LlamaForCausalLM(cfg).save_pretrained(tmp_path / "other")
    _one_line_error(inspect(clean, "--lm-head", tmp_path / "other"), "hidden size 32")


def test_bad_option_is_a_usage_error(clean):
    assert inspect(clean, "--sample", "0").exit_code == 2


def test_formats_without_layer_records_take_layer_ids(tmp_path):
    from tools.convert_fixtures import write_arrow_dir

    src = tmp_path / "arrow"
    write_arrow_dir(src, [30, 40, 50], num_layers=4)
    _one_line_error(inspect(src), "--layer-ids")
    res = inspect(src, "--layer-ids", "1,2,3,4", "--json")
    assert res.exit_code in (0, 1), res.output
    doc = parsed(res)
    assert doc["summary"]["format"] == "speculators-arrow"
    assert [x["source_id"] for x in doc["summary"]["layers"]] == [1, 2, 3, 4]
    assert doc["summary"]["lengths"]["max"] == 50


def test_damaged_token_column_fails_instead_of_crashing(clean, tmp_path):
    import shutil

    path = tmp_path / "ds"
    shutil.copytree(clean, path)
    seg = hsstore.open(path).manifest.segments[0].id
    column = next((path / "segments" / seg / "input_ids" / "c").glob("*"))
    column.chmod(0o644)
    data = bytearray(column.read_bytes())
    data[len(data) // 2] ^= 0x10
    column.write_bytes(bytes(data))
    res = inspect(path, "--json")
    assert res.exit_code == 1, res.output
    check = next(c for c in parsed(res)["checks"] if c["name"] == "samples_readable")
    assert check["verdict"] == "FAIL" and "input_ids" in check["reason"]
