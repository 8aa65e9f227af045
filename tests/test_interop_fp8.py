"""FP8 kept lossless: speculators 0.9 fp8 files -> hsstore -> fp8 files, bit for bit.

The sources are written with hs-connectors' own quantiser the way its FP8 connector saves them;
what the trainer would see is read with hs-connectors' ``FP8Transfer`` through speculators'
``ArrowDataset`` and ``CollateFn``.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import xxhash
from click.testing import CliRunner
from safetensors.torch import load_file, save_file

import hsstore
from hsstore.cli import main
from hsstore.errors import BadInputError, FormatError
from hsstore.loader import Loader
from hsstore.segment.stats import HIST_BINS, HIST_MAX_EXP, HIST_MIN_EXP
from hsstore.spec.layers import LayerSpec
from hsstore.spec.manifest import Manifest
from tests.peer_packages import peer
from tests.test_interop_specforge import PRE_NORM, model_run, read_with_specforge  # noqa: F401
from tests.test_interop_specforge import H as SPECFORGE_H
from tests.test_interop_specforge import N as SPECFORGE_N
from tests.test_interop_specforge import make_dataset as make_specforge_dataset
from tests.test_interop_speculators import LENGTHS, H, arrow_dataset, bits, samples
from tests.test_interop_speculators import write_fp8_source as write_source

LAYER_IDS = "2,4,6,8"


def convert_source(tmp_path: Path) -> tuple[Path, Path]:
    """(source folder, hsstore dataset) of an fp8 speculators 0.9 dataset, converted by the CLI."""
    src, ds = tmp_path / "src", tmp_path / "ds"
    write_source(src, samples(), src / "hidden_states")
    r = CliRunner().invoke(
        main,
        ["convert", str(src), str(ds), "--from", "speculators-arrow", "--layer-ids", LAYER_IDS]
        + ["--no-progress"],
    )
    assert r.exit_code == 0, r.output
    return src, ds


def trainer_items(src: Path) -> list[dict]:
    """What speculators' trainer reads from the fp8 files (``--hidden-states-backend fp8``)."""
    transfer = peer("hs_connectors.transfer")
    theirs = arrow_dataset(src, transfer=transfer.FP8Transfer(src / "hidden_states"))
    return [theirs[k] for k in range(len(theirs))]


def assert_same_items(ours: list[dict], theirs: list[dict]) -> None:
    for k, (a, b) in enumerate(zip(ours, theirs, strict=True)):
        assert set(a) == set(b), k
        for key, value in b.items():
            assert a[key].dtype == value.dtype and bits(a[key]) == bits(value), (k, key)


def test_import_stores_the_fp8_bits_and_scales(tmp_path):
    src, path = convert_source(tmp_path)
    ds = hsstore.open(path)
    assert ds.dtype == torch.float8_e4m3fn
    assert ds.manifest.columns["scales"] == "float32"
    fp8_utils = peer("hs_connectors.fp8_utils")
    for k in range(len(LENGTHS)):
        original = load_file(src / "hidden_states" / f"hs_{k}.safetensors")
        s = ds[k]
        assert s.hidden.dtype == torch.float8_e4m3fn
        assert bits(s.hidden) == bits(original["hidden_states"])
        assert s.scales.dtype == torch.float32 and s.scales.shape == (LENGTHS[k],)
        assert bits(s.scales) == bits(original[fp8_utils.SCALES_KEY])
        want = fp8_utils.dequantize_fp8_tensor(
            original["hidden_states"], original[fp8_utils.SCALES_KEY]
        )
        assert bits(s.dequantized()) == bits(want)
    r = CliRunner().invoke(main, ["verify", str(path)])
    assert r.exit_code == 0, r.output


def test_fp8_export_reproduces_the_original_files(tmp_path):
    src, path = convert_source(tmp_path)
    out = tmp_path / "out"
    r = CliRunner().invoke(
        main,
        ["convert", str(path), str(out), "--to", "speculators-arrow", "--fp8", "--no-progress"],
    )
    assert r.exit_code == 0, r.output
    for k in range(len(LENGTHS)):
        original = load_file(src / "hidden_states" / f"hs_{k}.safetensors")
        again = load_file(out / "hidden_states" / f"hs_{k}.safetensors")
        assert set(again) == set(original)
        for key, value in original.items():
            assert again[key].dtype == value.dtype and again[key].shape == value.shape, key
            assert bits(again[key]) == bits(value), (k, key)
    assert_same_items(trainer_items(out), trainer_items(src))


def test_bf16_export_is_what_the_trainer_reads_from_the_fp8_files(tmp_path):
    src, path = convert_source(tmp_path)
    out = tmp_path / "out"
    r = CliRunner().invoke(
        main, ["convert", str(path), str(out), "--to", "speculators-arrow", "--no-progress"]
    )
    assert r.exit_code == 0, r.output
    assert load_file(out / "hidden_states" / "hs_0.safetensors")["hidden_states"].dtype == (
        torch.bfloat16
    )
    theirs = arrow_dataset(out)  # the default FileTransfer: plain bf16 files
    assert_same_items([theirs[k] for k in range(len(theirs))], trainer_items(src))

    v1 = tmp_path / "v1"
    r = CliRunner().invoke(main, ["convert", str(path), str(v1), "--no-progress"])
    assert r.exit_code == 0, r.output
    want = trainer_items(src)
    for k in range(len(LENGTHS)):
        layers = torch.load(v1 / f"data_{k}.pt", weights_only=True)["hidden_states"]
        assert bits(torch.cat(layers[:-1], dim=1)) == bits(want[k]["hidden_states"])
        assert bits(layers[-1]) == bits(want[k]["verifier_last_hidden_states"])


def test_adapter_and_loader_deliver_what_fp8_transfer_delivers(tmp_path):
    from hsstore.interop.integrations.speculators import HsstoreArrowDataset

    data_mod = peer("speculators.train.data")
    src, path = convert_source(tmp_path)
    want = trainer_items(src)
    ours = HsstoreArrowDataset(64, path)
    assert_same_items([ours[k] for k in range(len(ours))], want)
    collate = data_mod.CollateFn(64, H, num_target_layers=3)
    a, b = collate([ours[k] for k in range(len(ours))]), collate(want)
    for key, value in b.items():
        if isinstance(value, torch.Tensor):
            assert value.dtype == a[key].dtype and bits(a[key]) == bits(value), key

    ds = hsstore.open(path)
    seen = set()
    # max_tokens 8 < the 9-token sample: the truncated read path dequantizes too
    for batch in Loader(path, max_tokens=8, seed=1, num_threads=1):
        assert batch["hidden_states"].dtype == torch.bfloat16
        for d, i in enumerate(batch["sample_index"].tolist()):
            item = want[int(ds.sample_ids[i].removeprefix("hs_"))]
            cols = (batch["document_ids"][0] == d).nonzero().flatten()
            n = min(8, len(item["input_ids"]))
            assert len(cols) == n
            assert bits(batch["hidden_states"][0, cols]) == bits(item["hidden_states"][:n])
            assert bits(batch["verifier_last_hidden_states"][0, cols]) == bits(
                item["verifier_last_hidden_states"][:n]
            )
            seen.add(i)
    assert seen == set(range(len(LENGTHS)))


def test_sample_checksum_covers_the_scales(tmp_path):
    _src, path = convert_source(tmp_path)
    ds = hsstore.open(path)
    for k in range(len(LENGTHS)):
        s = ds[k]
        stored = int(ds.index.column("checksum")[k].as_py())
        h = xxhash.xxh3_64()
        for part in (
            s.hidden.view(torch.uint8).numpy(),
            s.input_ids.numpy().astype("<i4"),
            s.loss_mask.numpy().astype("<u1"),
        ):
            h.update(part.tobytes())
        without_scales = h.copy().intdigest()
        h.update(s.scales.numpy().astype("<f4").tobytes())
        assert stored == h.intdigest() != without_scales


def make_fp8(path: Path) -> hsstore.Dataset:
    return hsstore.create(
        path, layers=[LayerSpec(1), LayerSpec(2)], hidden_size=H, dtype="float8_e4m3fn"
    )


def test_writer_takes_scales_with_fp8_only(tmp_path):
    fp8_utils = peer("hs_connectors.fp8_utils")
    q, scale = fp8_utils.quantize_tensor_to_fp8(torch.randn(3, 2, H))
    ids, mask = torch.arange(3), torch.ones(3, dtype=torch.int64)
    ds = make_fp8(tmp_path / "fp8")
    with ds.writer() as w:
        w.add("good", ids, mask, q, scales=scale)
    bad_calls = {
        "needs the per-token scales": {},
        "one per token": {"scales": scale[:2]},
        "expected float32": {"scales": scale.double()},
        "finite and positive": {"scales": -scale},
    }
    for message, kwargs in bad_calls.items():
        with ds.writer() as w, pytest.raises(BadInputError, match=message):
            w.add("bad", ids, mask, q, **kwargs)
    ds = hsstore.open(tmp_path / "fp8")
    assert ds.sample_ids == ["good"] and bits(ds[0].scales) == bits(scale)

    bf16 = hsstore.create(tmp_path / "bf16", layers=[LayerSpec(1)], hidden_size=H, dtype="bf16")
    with bf16.writer() as w, pytest.raises(BadInputError, match="stores no per-token scales"):
        w.add("x", ids, mask, torch.zeros(3, 1, H, dtype=torch.bfloat16), scales=scale)
    assert hsstore.open(tmp_path / "bf16").sample_ids == []


def test_manifest_refuses_a_scales_column_on_the_wrong_dtype(tmp_path):
    make_fp8(tmp_path / "fp8")
    bf16 = hsstore.create(tmp_path / "bf16", layers=[LayerSpec(1)], hidden_size=H, dtype="bf16")
    assert "scales" not in bf16.manifest.columns
    for man, change in (
        (bf16.manifest, lambda c: c | {"scales": "float32"}),
        (hsstore.open(tmp_path / "fp8").manifest, lambda c: {k: c[k] for k in c if k != "scales"}),
    ):
        obj = man.to_json()
        obj["columns"] = change(obj["columns"])
        with pytest.raises(FormatError, match="do not match dtype"):
            Manifest.from_json(obj, where="test")


@pytest.mark.parametrize(
    "damage, message",
    [
        ("nan", "contain NaN"),
        ("negative_scale", "scale <= 0"),
        ("scale_shape", "expected float32"),
    ],
)
def test_bad_fp8_file_is_one_line_naming_it(tmp_path, damage, message):
    src = tmp_path / "src"
    write_source(src, samples(), src / "hidden_states")
    name = src / "hidden_states" / "hs_2.safetensors"
    tensors = load_file(name)
    fp8_utils = peer("hs_connectors.fp8_utils")
    if damage == "nan":
        raw = tensors["hidden_states"].view(torch.uint8).clone()
        raw[1, 0, 3] = 0x7F  # e4m3fn's NaN pattern
        tensors["hidden_states"] = raw.view(torch.float8_e4m3fn)
    elif damage == "negative_scale":
        tensors[fp8_utils.SCALES_KEY] = -tensors[fp8_utils.SCALES_KEY]
    else:
        tensors[fp8_utils.SCALES_KEY] = tensors[fp8_utils.SCALES_KEY].reshape(-1)
    save_file(tensors, str(name))
    r = CliRunner().invoke(
        main,
        ["convert", str(src), str(tmp_path / "ds"), "--from", "speculators-arrow"]
        + ["--layer-ids", LAYER_IDS, "--no-progress"],
    )
    assert r.exit_code == 2, r.output
    lines = [x for x in r.output.splitlines() if "hs_2.safetensors" in x]
    assert len(lines) == 1 and message in lines[0], r.output
    assert "Traceback" not in r.output
    ds = hsstore.open(tmp_path / "ds")  # the good prefix before the bad file is kept
    assert ds.sample_ids == ["hs_0", "hs_1"]


def row_magnitudes(states: torch.Tensor) -> list[int]:
    """The write-time histogram of one layer's rows: floor(log2(row abs-max)), clipped."""
    _mantissa, exponent = torch.frexp(states.abs().amax(dim=-1))
    bins = (exponent - 1).clamp(HIST_MIN_EXP, HIST_MAX_EXP) - HIST_MIN_EXP
    return torch.bincount(bins, minlength=HIST_BINS).tolist()


def test_write_time_stats_describe_the_values(tmp_path):
    fp8_utils = peer("hs_connectors.fp8_utils")
    path = tmp_path / "fp8"
    with make_fp8(path).writer() as w:
        for k, (ids, mask, hidden) in enumerate(samples(num_layers=2)):
            q, scale = fp8_utils.quantize_tensor_to_fp8(hidden / 1000)
            w.add(f"s{k}", ids, mask, q, scales=scale)
    ds = hsstore.open(path)
    values = torch.cat([ds[k].dequantized(torch.float32) for k in range(len(ds))])
    raw = torch.cat([ds[k].hidden.float() for k in range(len(ds))])
    for j, st in enumerate(ds.layer_stats()):
        assert st.rows == sum(LENGTHS) and st.nonfinite_rows == 0 and st.zero_rows == 0
        assert st.rowmax_hist == row_magnitudes(values[:, j]) != row_magnitudes(raw[:, j])
    r = CliRunner().invoke(main, ["inspect", str(path)])
    assert r.exit_code == 0, r.output


def test_specforge_export_and_feature_store_see_the_dequantized_values(tmp_path, model_run):  # noqa: F811
    from hsstore.interop.integrations.specforge import HsstoreFeatureStore

    fp8_utils = peer("hs_connectors.fp8_utils")
    model_dir, run = model_run
    fp8_ds = hsstore.create(tmp_path / "fp8", layers=PRE_NORM, hidden_size=SPECFORGE_H,
                            dtype="fp8", model={"num_hidden_layers": SPECFORGE_N})  # fmt: skip
    with fp8_ds.writer() as w:
        for k, (ids, mask, hidden, _post) in enumerate(run):
            q, scale = fp8_utils.quantize_tensor_to_fp8(hidden)
            w.add(f"s{k}", ids, mask, q, scales=scale)
    values = [
        (ids, mask, fp8_utils.dequantize_fp8_tensor(*fp8_utils.quantize_tensor_to_fp8(h)), post)
        for ids, mask, h, post in run
    ]
    make_specforge_dataset(tmp_path / "bf16", PRE_NORM, values)  # what the trainer reads
    for name in ("fp8", "bf16"):
        r = CliRunner().invoke(
            main,
            ["convert", str(tmp_path / name), str(tmp_path / f"out-{name}"), "--to", "specforge"]
            + ["--target", str(model_dir), "--no-progress"],
        )
        assert r.exit_code == 0, r.output
    ours, want = (
        read_with_specforge(tmp_path / "out-fp8"),
        read_with_specforge(tmp_path / "out-bf16"),
    )
    assert set(ours) == set(want) == set(range(len(run)))
    for k, item in want.items():
        for key, value in item.items():
            if isinstance(value, torch.Tensor):
                assert bits(ours[k][key]) == bits(value), (k, key)

    store = HsstoreFeatureStore(tmp_path / "fp8", "run", target=model_dir)
    for k, ref in enumerate(store.refs(run_id="run")):
        got, _handle = store.get(ref)
        theirs = torch.load(
            next((tmp_path / "out-bf16").rglob(f"data_{k}.ckpt")), weights_only=True
        )
        for key in ("aux_hidden_state", "hidden_state"):
            assert bits(got[key]) == bits(theirs[key]), (k, key)


def test_inspect_reads_an_fp8_source_folder_as_values(tmp_path):
    src = tmp_path / "src"
    write_source(src, samples(), src / "hidden_states")
    r = CliRunner().invoke(
        main, ["inspect", str(src), "--layer-ids", LAYER_IDS, "--full", "--json"]
    )
    assert r.exit_code == 0, r.output
    assert '"float8_e4m3fn"' in r.output


def test_verify_names_a_damaged_scales_column(tmp_path):
    _src, path = convert_source(tmp_path)
    (column,) = (path / "segments").glob("*/scales/c/0")
    data = bytearray(column.read_bytes())
    data[len(data) // 2] ^= 0x40
    column.write_bytes(bytes(data))
    r = CliRunner().invoke(main, ["verify", str(path)])
    assert r.exit_code != 0
    assert "scales/c/0" in r.output, r.output
