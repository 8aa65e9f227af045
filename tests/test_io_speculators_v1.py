"""speculators v1 reader and writer against fixtures in the exact v1 layout."""

from __future__ import annotations

import json

import pytest
import torch

from hsstore.errors import BadInputError
from hsstore.interop.formats import detect_format, open_foreign
from hsstore.interop.formats.speculators_v1 import (
    SpeculatorsV1Reader,
    build_data_config,
    write_sample,
)
from tools.convert_fixtures import v1_data_config, write_v1_dir


def bits(t: torch.Tensor) -> bytes:
    return t.contiguous().view(torch.uint8).numpy().tobytes()


@pytest.mark.parametrize(
    ("dtype", "layer_ids"),
    [(torch.bfloat16, [0]), (torch.float16, [1, 3, 5]), (torch.bfloat16, [2, 4, 5, 6, 7])],
)
def test_reader_gives_back_every_tensor_bit_for_bit(tmp_path, dtype, layer_ids):
    lengths = [1, 3, 4096, 70]
    src = tmp_path / "v1"
    samples = write_v1_dir(src, lengths, layer_ids=layer_ids, hidden_size=8, dtype=dtype)
    r = open_foreign(src)
    assert r.format == "speculators-v1" and len(r) == len(lengths)
    assert r.dtype == dtype and r.hidden_size == 8
    n = max(layer_ids) + 1  # inferred: the last v1 layer is the verifier's final layer
    assert r.model == {"name": "tiny/llama", "num_hidden_layers": n, "hidden_size": 8}
    assert [s.depth for s in r.layers] == [v + 1 for v in layer_ids]
    assert [s.source_id for s in r.layers] == layer_ids
    assert {s.source_convention for s in r.layers} == {"speculators"}
    assert r.names() == [f"data_{i}.pt" for i in range(len(lengths))]
    assert r.sample_ids() == [f"data_{i}" for i in range(len(lengths))]
    for i, orig in enumerate(samples):
        item = r.read(i)
        assert item.sample_id == f"data_{i}" and item.name == f"data_{i}.pt"
        assert item.hidden.shape == (lengths[i], len(layer_ids), 8)
        assert torch.equal(item.input_ids, orig["input_ids"])
        assert torch.equal(item.loss_mask, orig["loss_mask"])
        for k, h in enumerate(orig["hidden_states"]):
            assert bits(item.hidden[:, k, :]) == bits(h)


def test_files_are_ordered_by_index_not_by_name(tmp_path):
    src = tmp_path / "v1"
    write_v1_dir(src, [2] * 12, layer_ids=[1, 2])
    names = SpeculatorsV1Reader(src).names()
    assert names[:3] == ["data_0.pt", "data_1.pt", "data_2.pt"] and names[-1] == "data_11.pt"


def test_unsorted_config_ids_follow_capture_order(tmp_path):
    """The capture hook walks layers in order, so files hold states by ascending layer id."""
    src = tmp_path / "v1"
    write_v1_dir(src, [3], layer_ids=[1, 3])
    cfg = json.loads((src / "data_config.json").read_text())
    cfg["hidden_states"]["layer_ids"] = [3, 1]
    (src / "data_config.json").write_text(json.dumps(cfg))
    assert [s.source_id for s in SpeculatorsV1Reader(src).layers] == [1, 3]


def test_missing_config_requires_layer_ids(tmp_path):
    src = tmp_path / "v1"
    write_v1_dir(src, [3, 4], layer_ids=[1, 3], with_config=False)
    with pytest.raises(BadInputError, match="no data_config.json.*--layer-ids"):
        SpeculatorsV1Reader(src)
    r = SpeculatorsV1Reader(src, layer_ids=[1, 3], num_hidden_layers=6)
    assert [(s.depth, s.final_norm) for s in r.layers] == [(2, False), (4, False)]
    assert r.model["name"] is None and r.model["num_hidden_layers"] == 6


def test_layer_ids_that_contradict_the_config_are_refused(tmp_path):
    src = tmp_path / "v1"
    write_v1_dir(src, [3], layer_ids=[1, 3])
    with pytest.raises(BadInputError, match="disagree with data_config.json"):
        SpeculatorsV1Reader(src, layer_ids=[1, 2])


def test_wrong_layer_count_and_sample_lengths_mismatch_are_bad_input(tmp_path):
    src = tmp_path / "v1"
    write_v1_dir(src, [3, 4], layer_ids=[1, 3, 5])
    r = SpeculatorsV1Reader(src, layer_ids=[1, 3, 5])
    obj = torch.load(src / "data_1.pt", weights_only=True)
    obj["hidden_states"] = obj["hidden_states"][:2]
    torch.save(obj, src / "data_1.pt")
    with pytest.raises(BadInputError, match="hidden_states has 2 layers, expected 3") as e:
        r.read(1)
    assert e.value.path.endswith("data_1.pt")
    (src / "sample_lengths.json").write_text(json.dumps({"0": 5, "1": 4}))
    with pytest.raises(BadInputError, match="has 3 tokens but sample_lengths.json says 5"):
        SpeculatorsV1Reader(src).read(0)


def test_detect_format(tmp_path):
    src = tmp_path / "v1"
    write_v1_dir(src, [2], layer_ids=[1])
    assert detect_format(src) == "speculators-v1"
    (src / "data_config.json").unlink()
    assert detect_format(src) == "speculators-v1"
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(BadInputError, match="cannot tell the format"):
        detect_format(empty)
    with pytest.raises(FileNotFoundError, match="no such file or directory"):
        detect_format(tmp_path / "nope")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_writer_output_loads_the_way_speculators_loads_it(tmp_path, dtype):
    hidden = torch.randn(9, 3, 8).to(dtype)
    ids = torch.arange(9, dtype=torch.int64)
    mask = torch.tensor([0, 0, 1, 1, 1, 0, 1, 1, 1], dtype=torch.int64)
    write_sample(tmp_path / "data_0.pt", ids, mask, hidden)
    # speculators' Eagle3SampleFileDataset.__getitem__ loads exactly like this:
    got = torch.load(tmp_path / "data_0.pt", mmap=True, weights_only=True, map_location="cpu")
    assert set(got) == {"input_ids", "loss_mask", "hidden_states"}
    assert isinstance(got["hidden_states"], list) and len(got["hidden_states"]) == 3
    assert got["input_ids"].dtype == torch.int64 and got["loss_mask"].dtype == torch.int64
    for k in range(3):
        assert got["hidden_states"][k].dtype == dtype
        assert bits(got["hidden_states"][k]) == bits(hidden[:, k, :])
    # Each tensor owns its storage: the file is not the whole [T, L, H] buffer three times.
    payload = hidden.numel() * hidden.element_size() + 2 * 9 * 8
    assert (tmp_path / "data_0.pt").stat().st_size < payload + 4096
    assert not list(tmp_path.glob(".*tmp"))


def test_generated_data_config_has_speculators_keys(tmp_path):
    cfg = build_data_config(
        layer_ids=[2, 5, 7], hidden_size=8, dtype=torch.float16, num_samples=3, model_name="m"
    )
    reference = v1_data_config([2, 5, 7], 8, 3)
    assert set(cfg) == set(reference)
    for key in ("model", "data", "hidden_states", "format", "reproducibility"):
        assert set(cfg[key]) == set(reference[key]), key
    assert cfg["hidden_states"]["layer_ids"] == [2, 5, 7]
    assert cfg["format"]["schema"]["hidden_states"]["dtype"] == "list[torch.float16]"
    base = build_data_config(
        layer_ids=[2, 5, 7],
        hidden_size=8,
        dtype=torch.float16,
        num_samples=3,
        model_name="m",
        base=reference,
    )
    assert base == reference
