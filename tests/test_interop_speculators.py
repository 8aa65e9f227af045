"""hsstore <-> speculators 0.9, proven with speculators' and hs-connectors' own classes.

Every export is read back through ``speculators.train.data.ArrowDataset`` (with
``hs_connectors.FileTransfer`` / ``FP8Transfer``) and ``CollateFn``; FP8 sources are written with
hs-connectors' own quantiser, the way its FP8 connector saves them.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from safetensors.torch import save_file

import hsstore
from hsstore.cli import main
from hsstore.errors import BadInputError
from hsstore.interop.convert import convert
from hsstore.spec.layers import LayerSpec
from tests.peer_packages import peer
from tools.synthetic import llm_like_states

N = 8  # decoder layers of the (imaginary) target
LENGTHS = [5, 1, 9, 3]
H = 16


def bits(t: torch.Tensor) -> bytes:
    return t.contiguous().view(torch.uint8).numpy().tobytes()


def samples(num_layers: int = 4):
    out = []
    for k, t in enumerate(LENGTHS):
        g = torch.Generator().manual_seed(k)
        ids = torch.randint(0, 32000, (t,), generator=g, dtype=torch.int64)
        mask = (torch.rand(t, generator=g) < 0.6).to(torch.int64)
        out.append((ids, mask, llm_like_states(t, num_layers, H, seed=k)))
    return out


def make_dataset(path: Path, layers: list[LayerSpec], data) -> hsstore.Dataset:
    ds = hsstore.create(
        path, layers=layers, hidden_size=H, dtype=torch.bfloat16, model={"num_hidden_layers": N}
    )
    with ds.writer() as w:
        for k, (ids, mask, hidden) in enumerate(data):
            w.add(f"s{k}", ids, mask, hidden)
        w.commit()
    return hsstore.open(path)


VLLM_LAYERS = [LayerSpec(2), LayerSpec(4), LayerSpec(6), LayerSpec(N)]  # vLLM ids 2,4,6,8


def arrow_dataset(path: Path, transfer=None):
    data = peer("speculators.train.data")
    return data.ArrowDataset(max_len=64, datapath=str(path), transfer=transfer, on_missing="raise")


def test_export_bf16_reads_in_speculators_arrow_dataset(tmp_path):
    data = samples()
    make_dataset(tmp_path / "ds", VLLM_LAYERS, data)
    res = convert(tmp_path / "ds", tmp_path / "out", dst_format="speculators-arrow", progress=False)
    assert res.added == len(LENGTHS)
    assert any("--target-layer-ids 2,4,6" in n for n in res.notes)

    theirs = arrow_dataset(tmp_path / "out")
    assert len(theirs) == len(LENGTHS) and theirs.approx_lengths == LENGTHS
    items = [theirs[k] for k in range(len(theirs))]
    for (ids, mask, hidden), item in zip(data, items):
        assert torch.equal(item["input_ids"], ids) and torch.equal(item["loss_mask"], mask)
        assert bits(item["hidden_states"]) == bits(hidden[:, :-1].flatten(1))
        assert bits(item["verifier_last_hidden_states"]) == bits(hidden[:, -1])

    collate = peer("speculators.train.data").CollateFn(64, H, num_target_layers=3)
    batch = collate(items[:2])
    t0, t1 = LENGTHS[0], LENGTHS[1]
    docs = batch["document_ids"][0].tolist()
    assert docs == [0] * t0 + [1] * t1 + [-1] * (64 - t0 - t1)
    assert bits(batch["hidden_states"][0, :t0]) == bits(data[0][2][:, :-1].flatten(1))
    assert bits(batch["hidden_states"][0, t0 : t0 + t1]) == bits(data[1][2][:, :-1].flatten(1))


def test_export_fp8_matches_hs_connectors_and_reads_through_fp8_transfer(tmp_path):
    fp8_utils = peer("hs_connectors.fp8_utils")
    transfer = peer("hs_connectors.transfer")
    data = samples()
    make_dataset(tmp_path / "ds", VLLM_LAYERS, data)
    r = CliRunner().invoke(
        main,
        ["convert", str(tmp_path / "ds"), str(tmp_path / "out"), "--to", "speculators-arrow"]
        + ["--fp8", "--no-progress"],
    )
    assert r.exit_code == 0, r.output
    from safetensors.torch import load_file

    for k, (_ids, _mask, hidden) in enumerate(data):
        ours = load_file(tmp_path / "out" / "hidden_states" / f"hs_{k}.safetensors")
        fp8, scale = fp8_utils.quantize_tensor_to_fp8(hidden)
        assert ours["hidden_states"].dtype == torch.float8_e4m3fn
        assert bits(ours["hidden_states"]) == bits(fp8)
        assert bits(ours[fp8_utils.SCALES_KEY]) == bits(scale)

    fp8_transfer = transfer.FP8Transfer(tmp_path / "out" / "hidden_states")
    theirs = arrow_dataset(tmp_path / "out", transfer=fp8_transfer)
    for k, (ids, _mask, hidden) in enumerate(data):
        item = theirs[k]
        want = fp8_utils.dequantize_fp8_tensor(*fp8_utils.quantize_tensor_to_fp8(hidden))
        assert torch.equal(item["input_ids"], ids)
        assert bits(item["hidden_states"]) == bits(want[:, :-1].flatten(1))


def write_fp8_source(root: Path, data, hs_dir: Path) -> None:
    """A speculators 0.9 dataset with FP8 states, written the way its tools write them."""
    datasets = peer("datasets")
    fp8_utils = peer("hs_connectors.fp8_utils")
    rows = {
        "input_ids": [ids.tolist() for ids, _, _ in data],
        "loss_mask": [m.tolist() for _, m, _ in data],
        "seq_len": [len(ids) for ids, _, _ in data],
    }
    d = datasets.Dataset.from_dict(rows)
    d.set_format(type="torch")  # speculators/data_generation/preprocessing.py
    d.save_to_disk(str(root))
    hs_dir.mkdir(parents=True, exist_ok=True)
    for k, (ids, _mask, hidden) in enumerate(data):
        # hs_connectors/fp8_hidden_states_connector.py FP8HiddenStatesConnector._write_tensors
        fp8, scales = fp8_utils.quantize_tensor_to_fp8(hidden)
        tensors = {"hidden_states": fp8, fp8_utils.SCALES_KEY: scales, "token_ids": ids}
        save_file(tensors, str(hs_dir / f"hs_{k}.safetensors"))


@pytest.mark.parametrize("elsewhere", [False, True])
def test_fp8_source_imports_as_the_trainer_reads_it(tmp_path, elsewhere):
    transfer = peer("hs_connectors.transfer")
    data = samples()
    hs_dir = tmp_path / "states" if elsewhere else tmp_path / "src" / "hidden_states"
    write_fp8_source(tmp_path / "src", data, hs_dir)
    args = ["convert", str(tmp_path / "src"), str(tmp_path / "ds"), "--from", "speculators-arrow"]
    args += ["--layer-ids", "2,4,6,8", "--no-progress"]
    if elsewhere:
        args += ["--hidden-states-path", str(hs_dir)]
    r = CliRunner().invoke(main, args)
    assert r.exit_code == 0, r.output
    ds = hsstore.open(tmp_path / "ds")
    assert ds.dtype == torch.float8_e4m3fn and [s.depth for s in ds.layers] == [2, 4, 6, 8]
    theirs = arrow_dataset(tmp_path / "src", transfer=transfer.FP8Transfer(hs_dir))
    for k in range(len(data)):
        item, s = theirs[k], ds[k]
        assert torch.equal(s.input_ids, item["input_ids"])
        values = s.dequantized()
        assert bits(values[:, :-1].flatten(1)) == bits(item["hidden_states"])
        assert bits(values[:, -1]) == bits(item["verifier_last_hidden_states"])


def test_states_elsewhere_without_the_option_names_it(tmp_path):
    write_fp8_source(tmp_path / "src", samples(), tmp_path / "states")
    with pytest.raises(BadInputError, match="--hidden-states-path"):
        convert(tmp_path / "src", tmp_path / "ds", src_format="speculators-arrow",
                layer_ids=[2, 4, 6, 8], progress=False)  # fmt: skip


def test_forgotten_final_layer_id_names_the_fix(tmp_path):
    write_fp8_source(tmp_path / "src", samples(), tmp_path / "src" / "hidden_states")
    r = CliRunner().invoke(
        main,
        ["convert", str(tmp_path / "src"), str(tmp_path / "ds"), "--from", "speculators-arrow"]
        + ["--layer-ids", "2,4,6", "--no-progress"],
    )
    assert r.exit_code == 2
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and "did you forget the final layer N in --layer-ids" in lines[0]
    assert "Traceback" not in r.output and not (tmp_path / "ds").exists()


def test_export_refuses_a_post_norm_final_state(tmp_path):
    layers = [LayerSpec(2), LayerSpec(4), LayerSpec(6), LayerSpec(N, final_norm=True)]
    make_dataset(tmp_path / "ds", layers, samples())
    r = CliRunner().invoke(
        main, ["convert", str(tmp_path / "ds"), str(tmp_path / "out"), "--to", "speculators-arrow"]
    )
    assert r.exit_code == 2 and "before the final norm" in r.stderr
    assert "extracting with --layers 2,4,6,final-prenorm would have made it exportable" in r.stderr
    assert not (tmp_path / "out").exists()


def test_adapter_delivers_what_the_converted_files_deliver(tmp_path):
    from hsstore.interop.integrations.speculators import HsstoreArrowDataset

    data_mod = peer("speculators.train.data")
    make_dataset(tmp_path / "ds", VLLM_LAYERS, samples())
    convert(tmp_path / "ds", tmp_path / "out", dst_format="speculators-arrow", progress=False)
    theirs = arrow_dataset(tmp_path / "out")
    ours = HsstoreArrowDataset(64, tmp_path / "ds")
    assert isinstance(ours, data_mod.BaseDataset)
    assert len(ours) == len(theirs) and ours.approx_lengths == theirs.approx_lengths
    collate = data_mod.CollateFn(64, H, num_target_layers=3)
    a = collate([ours[k] for k in range(len(ours))])
    b = collate([theirs[k] for k in range(len(theirs))])
    assert set(a) == set(b)
    for key, value in b.items():
        if isinstance(value, torch.Tensor):
            assert value.dtype == a[key].dtype and bits(a[key]) == bits(value), key
        else:
            assert a[key] == value, key


def test_adapter_takes_arrow_datasets_arguments_and_splits_alike(tmp_path):
    import pickle

    from hsstore.interop.integrations.speculators import HsstoreArrowDataset

    make_dataset(tmp_path / "ds", VLLM_LAYERS, samples())
    convert(tmp_path / "ds", tmp_path / "out", dst_format="speculators-arrow", progress=False)
    data_mod = peer("speculators.train.data")
    for split in ("train", "val"):
        kwargs = {"train_ratio": 0.5, "split": split, "on_missing": "raise"}
        theirs = data_mod.ArrowDataset(max_len=64, datapath=str(tmp_path / "out"), **kwargs)
        ours = HsstoreArrowDataset(max_len=64, datapath=tmp_path / "ds", **kwargs)
        # DataLoader workers are spawned: the dataset travels pickled.
        ours = pickle.loads(pickle.dumps(ours))
        assert len(ours) == len(theirs) == 2 and ours.approx_lengths == theirs.approx_lengths
        for k in range(len(ours)):
            a, b = ours[k], theirs[k]
            assert set(a) == set(b)
            assert all(bits(a[key]) == bits(b[key]) for key in b), (split, k)
