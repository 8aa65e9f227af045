"""The target model's folder: every reader of its tensors reports a bad folder in one line."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import save_file

from hsstore.audit.lm_head import load_output_head
from hsstore.errors import BadInputError
from hsstore.interop.formats.final_norm import load_final_norm
from hsstore.model_folder import ModelFolder
from hsstore.trainers.eagle3.model import load_target_tensors

H, V = 8, 16


def _model(path, *, sharded: bool):
    torch.manual_seed(0)
    tensors = {
        "model.embed_tokens.weight": torch.randn(V, H),
        "model.norm.weight": torch.rand(H) + 0.5,
        "lm_head.weight": torch.randn(V, H),
    }
    path.mkdir()
    if sharded:
        names = sorted(tensors)
        save_file({n: tensors[n] for n in names[:1]}, str(path / "a.safetensors"))
        save_file({n: tensors[n] for n in names[1:]}, str(path / "b.safetensors"))
        wm = {n: ("a.safetensors" if i < 1 else "b.safetensors") for i, n in enumerate(names)}
        (path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": wm}))
    else:
        save_file(tensors, str(path / "model.safetensors"))
    config = {"model_type": "llama", "rms_norm_eps": 1e-5, "num_hidden_layers": 2}
    (path / "config.json").write_text(json.dumps(config))
    return tensors


@pytest.mark.parametrize("sharded", [False, True])
def test_the_three_readers_see_the_same_tensors(tmp_path, sharded):
    ref = _model(tmp_path / "m", sharded=sharded)
    head = load_output_head(tmp_path / "m")
    norm = load_final_norm(tmp_path / "m", hidden_size=H)
    got, config = load_target_tensors(tmp_path / "m")
    assert torch.equal(head.weight, ref["lm_head.weight"]) and not head.tied
    assert torch.equal(norm.weight, ref["model.norm.weight"]) and norm.eps == 1e-5
    assert torch.equal(got["embed"], ref["model.embed_tokens.weight"])
    assert torch.equal(got["norm"], head.norm_weight) and config["num_hidden_layers"] == 2
    assert ModelFolder(tmp_path / "m").where("model.norm.weight").endswith(":model.norm.weight")


def _truncate(path):
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])


READERS = {
    "audit": lambda p: load_output_head(p),
    "export": lambda p: load_final_norm(p, hidden_size=H),
    "trainer": lambda p: load_target_tensors(p),
}


@pytest.mark.parametrize("reader", sorted(READERS))
def test_truncated_weights_are_one_error_naming_the_file(tmp_path, reader):
    _model(tmp_path / "m", sharded=False)
    _truncate(tmp_path / "m" / "model.safetensors")
    with pytest.raises(BadInputError) as err:
        READERS[reader](tmp_path / "m")
    assert err.value.path == str(tmp_path / "m" / "model.safetensors")


@pytest.mark.parametrize("reader", sorted(READERS))
def test_bad_config_and_bad_index_name_their_file(tmp_path, reader):
    _model(tmp_path / "m", sharded=True)
    (tmp_path / "m" / "model.safetensors.index.json").write_text("[1, 2]")
    with pytest.raises(BadInputError, match="unreadable shard index") as err:
        READERS[reader](tmp_path / "m")
    assert err.value.path == str(tmp_path / "m" / "model.safetensors.index.json")
    (tmp_path / "m" / "config.json").write_text("{not json")
    with pytest.raises(BadInputError, match="not valid JSON") as err:
        READERS[reader](tmp_path / "m")
    assert err.value.path == str(tmp_path / "m" / "config.json")


def test_missing_tensor_in_trainer_is_a_bad_input(tmp_path):
    ref = _model(tmp_path / "m", sharded=False)
    del ref["model.norm.weight"]
    save_file(ref, str(tmp_path / "m" / "model.safetensors"))
    with pytest.raises(BadInputError, match="none of") as err:
        load_target_tensors(tmp_path / "m")
    assert err.value.path == str(tmp_path / "m")
