"""speculators 0.5+ reader: Arrow rows plus hidden_states/hs_{i}.safetensors."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import save_file

from hsstore.errors import BadInputError
from hsstore.interop.formats import detect_format, open_foreign
from tools.convert_fixtures import write_arrow_dir


def bits(t: torch.Tensor) -> bytes:
    return t.contiguous().view(torch.uint8).numpy().tobytes()


@pytest.mark.parametrize(("dtype", "bool_mask"), [(torch.bfloat16, True), (torch.float16, False)])
def test_rows_and_states_read_back_exactly(tmp_path, dtype, bool_mask):
    lengths = [4, 1, 257]
    rows = write_arrow_dir(
        tmp_path / "a", lengths, num_layers=4, hidden_size=8, dtype=dtype, bool_mask=bool_mask
    )
    assert detect_format(tmp_path / "a") == "speculators-arrow"
    r = open_foreign(tmp_path / "a", layer_ids=[2, 16, 29, 32])
    assert r.format == "speculators-arrow" and len(r) == 3 and r.dtype == dtype
    assert r.model["num_hidden_layers"] == 32  # launch_vllm appends num_hidden_layers last
    assert [(s.depth, s.final_norm) for s in r.layers] == [
        (2, False),
        (16, False),
        (29, False),
        (32, False),
    ]
    assert r.names()[1] == "hidden_states/hs_1.safetensors"
    for i, row in enumerate(rows):
        item = r.read(i)
        assert item.sample_id == f"hs_{i}"
        assert torch.equal(item.input_ids, row["input_ids"])
        assert item.loss_mask.dtype == torch.int64 and torch.equal(item.loss_mask, row["loss_mask"])
        assert bits(item.hidden) == bits(row["hidden"])


def test_layer_ids_are_required(tmp_path):
    write_arrow_dir(tmp_path / "a", [3])
    with pytest.raises(BadInputError, match="does not record its layers; pass --layer-ids"):
        open_foreign(tmp_path / "a")


def test_missing_mismatched_and_corrupt_files_are_bad_input(tmp_path):
    write_arrow_dir(tmp_path / "a", [3, 4, 5], num_layers=2, hidden_size=8)
    hs = tmp_path / "a" / "hidden_states"
    (hs / "hs_0.safetensors").unlink()
    save_file(
        {
            "hidden_states": torch.zeros(4, 2, 8, dtype=torch.bfloat16),
            "token_ids": torch.zeros(4, dtype=torch.int64),
        },
        str(hs / "hs_1.safetensors"),
    )
    (hs / "hs_2.safetensors").write_bytes((hs / "hs_2.safetensors").read_bytes()[:100])
    r = open_foreign(tmp_path / "a", layer_ids=[3, 8])
    with pytest.raises(BadInputError, match="file is missing"):
        r.read(0)
    with pytest.raises(BadInputError, match="token_ids do not match"):
        r.read(1)
    with pytest.raises(BadInputError, match="corrupt or truncated safetensors") as e:
        r.read(2)
    assert e.value.path == str(hs / "hs_2.safetensors")
