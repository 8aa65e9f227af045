"""v1 -> hsstore -> v1 is bit-identical; SpecForge and speculators 0.5+ convert exactly."""

from __future__ import annotations

import json

import pytest
import torch
from click.testing import CliRunner

import hsstore
from hsstore.cli import main
from hsstore.errors import BadInputError, IncompatibleDatasetError
from hsstore.interop.convert import convert, convert_to_hsstore, export_to_v1
from tools.convert_fixtures import write_arrow_dir, write_specforge_dir, write_v1_dir


def bits(t: torch.Tensor) -> bytes:
    return t.contiguous().view(torch.uint8).numpy().tobytes()


CASES = [
    (torch.bfloat16, [1], [1, 4096, 3]),
    (torch.float16, [1, 3, 5], [2, 1, 700, 33]),
    (torch.bfloat16, [0, 2, 4, 6, 7], [5, 64, 1]),
]


@pytest.mark.parametrize(("dtype", "layer_ids", "lengths"), CASES)
def test_v1_to_hsstore_to_v1_is_bit_identical(tmp_path, dtype, layer_ids, lengths):
    src, ds_path, out = tmp_path / "v1", tmp_path / "ds", tmp_path / "back"
    write_v1_dir(src, lengths, layer_ids=layer_ids, hidden_size=16, dtype=dtype)
    res = convert(src, ds_path, progress=False, commit_every=2, workers=2)
    assert (res.source_format, res.added, res.total_samples) == (
        "speculators-v1",
        len(lengths),
        len(lengths),
    )

    ds = hsstore.open(ds_path)
    assert ds.sample_ids == [f"data_{i}" for i in range(len(lengths))]
    assert ds.index.column("source").to_pylist() == [f"data_{i}.pt" for i in range(len(lengths))]
    assert [(s.depth, s.final_norm, s.source_convention, s.source_id) for s in ds.layers] == [
        (v + 1, False, "speculators", v) for v in layer_ids
    ]
    assert ds.manifest.model.num_hidden_layers == max(layer_ids) + 1
    assert ds.manifest.provenance["source_format"] == "speculators-v1"

    res = convert(ds_path, out, progress=False)
    assert (res.dest_format, res.added) == ("speculators-v1", len(lengths))
    for i in range(len(lengths)):
        a = torch.load(src / f"data_{i}.pt", mmap=True, weights_only=True)
        b = torch.load(out / f"data_{i}.pt", mmap=True, weights_only=True)
        assert set(b) == set(a)
        assert b["input_ids"].dtype == b["loss_mask"].dtype == torch.int64
        assert torch.equal(a["input_ids"], b["input_ids"]) and torch.equal(
            a["loss_mask"], b["loss_mask"]
        )
        assert len(a["hidden_states"]) == len(b["hidden_states"])
        for x, y in zip(a["hidden_states"], b["hidden_states"]):
            assert x.dtype == y.dtype and bits(x) == bits(y)
    assert json.loads((out / "sample_lengths.json").read_text()) == json.loads(
        (src / "sample_lengths.json").read_text()
    )
    assert json.loads((out / "data_config.json").read_text()) == json.loads(
        (src / "data_config.json").read_text()
    )


def test_export_numbers_by_storage_order_and_resumes(tmp_path):
    src, ds_path, out = tmp_path / "v1", tmp_path / "ds", tmp_path / "out"
    write_v1_dir(src, [3, 4, 5], layer_ids=[1, 3])
    (src / "data_1.pt").rename(src / "data_7.pt")  # a gap: data_0, data_2, data_7
    (src / "sample_lengths.json").unlink()
    convert_to_hsstore(src, ds_path, progress=False)
    export_to_v1(ds_path, out, progress=False)
    assert sorted(p.name for p in out.glob("data_*.pt")) == ["data_0.pt", "data_1.pt", "data_2.pt"]
    assert json.loads((out / "sample_lengths.json").read_text()) == {"0": 3, "1": 5, "2": 4}
    again = export_to_v1(ds_path, out, progress=False)
    assert (again.added, again.already_present) == (0, 3)


def test_export_refuses_what_v1_cannot_hold(tmp_path):
    write_specforge_dir(tmp_path / "sf", [3, 4], num_aux=3, hidden_size=8)
    convert_to_hsstore(
        tmp_path / "sf", tmp_path / "ds", layer_ids=[1, 3, 5], num_hidden_layers=8, progress=False
    )
    r = CliRunner().invoke(main, ["convert", str(tmp_path / "ds"), str(tmp_path / "out")])
    assert r.exit_code == 2
    assert "cannot export to speculators v1" in r.stderr and "before the final norm" in r.stderr
    assert not (tmp_path / "out").exists()  # refused before anything was written


@pytest.mark.parametrize("compress", [False, True])
def test_specforge_into_hsstore(tmp_path, compress):
    recs = write_specforge_dir(
        tmp_path / "sf", [7, 1, 129], num_aux=3, hidden_size=8, compress=compress
    )
    r = CliRunner().invoke(
        main,
        [
            "convert",
            str(tmp_path / "sf"),
            str(tmp_path / "ds"),
            "--layer-ids",
            "1,15,28",
            "--num-hidden-layers",
            "32",
            "--model",
            "tiny/qwen",
            "--json",
            "--no-progress",
        ],
    )
    assert r.exit_code == 0, r.output
    summary = json.loads(r.stdout)
    assert (summary["source_format"], summary["added"], summary["skipped"]) == ("specforge", 3, [])
    ds = hsstore.open(tmp_path / "ds")
    assert ds.manifest.model.name == "tiny/qwen"
    assert [(s.depth, s.final_norm) for s in ds.layers] == [
        (2, False),
        (16, False),
        (29, False),
        (32, True),
    ]
    for i, rec in enumerate(recs):
        s = ds.get(f"data_{i}")
        t = rec["input_ids"].shape[0]
        assert bits(s.hidden[:, :3, :]) == bits(rec["aux_hidden_state"][0].reshape(t, 3, 8))
        assert bits(s.hidden[:, 3, :]) == bits(rec["hidden_state"][0])
        assert torch.equal(s.loss_mask, rec["loss_mask"])


def test_speculators_arrow_into_hsstore(tmp_path):
    rows = write_arrow_dir(
        tmp_path / "a", [4, 1, 90], num_layers=4, hidden_size=8, dtype=torch.float16
    )
    res = convert(tmp_path / "a", tmp_path / "ds", layer_ids=[2, 16, 29, 32], progress=False)
    assert res.source_format == "speculators-arrow" and res.added == 3
    ds = hsstore.open(tmp_path / "ds")
    assert [s.depth for s in ds.layers] == [2, 16, 29, 32] and ds.dtype == torch.float16
    for i, row in enumerate(rows):
        s = ds.get(f"hs_{i}")
        assert bits(s.hidden) == bits(row["hidden"]) and torch.equal(s.input_ids, row["input_ids"])


def test_rerun_adds_nothing_and_mismatched_destinations_are_refused(tmp_path):
    write_v1_dir(tmp_path / "v1", [3, 4], layer_ids=[1, 3])
    convert(tmp_path / "v1", tmp_path / "ds", progress=False)
    again = convert(tmp_path / "v1", tmp_path / "ds", progress=False)
    assert (again.added, again.already_present, again.total_samples) == (0, 2, 2)

    write_v1_dir(tmp_path / "other", [3], layer_ids=[1, 2])
    with pytest.raises(
        IncompatibleDatasetError, match=r"does not match: it has layers \[after 2, after 4\]"
    ):
        convert(tmp_path / "other", tmp_path / "ds", progress=False)
    (tmp_path / "junk").mkdir()
    (tmp_path / "junk" / "notes.txt").write_text("x")
    with pytest.raises(BadInputError, match="not an hsstore dataset"):
        convert(tmp_path / "v1", tmp_path / "junk", progress=False)
    assert len(hsstore.open(tmp_path / "ds")) == 2


def test_inspect_reports_the_layer_semantics_of_the_v1_config(tmp_path):
    write_v1_dir(tmp_path / "v1", [5, 6], layer_ids=[1, 4, 6], hidden_size=8)
    convert(tmp_path / "v1", tmp_path / "ds", progress=False)
    r = CliRunner().invoke(main, ["inspect", str(tmp_path / "ds"), "--json"])
    # 1 = a data check flagged the synthetic states; what matters here is the layer report.
    assert r.exit_code in (0, 1), r.output
    layers = json.loads(r.stdout)["summary"]["layers"]
    assert [
        (x["depth"], x["final_norm"], x["source_convention"], x["source_id"]) for x in layers
    ] == [
        (2, False, "speculators", 1),
        (5, False, "speculators", 4),
        (7, False, "speculators", 6),
    ]
