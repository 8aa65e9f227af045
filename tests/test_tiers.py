"""Lossy tiers as written and stored: their bounds hold, fp8-token is hs-connectors' quantizer
bit for bit, the tier is recorded, checked and kept across resumes, zarr-python reads the
arrays, and lossless stays the default and bit-identical. How readers, inspect, exports and
extraction see a tier is tests/test_tiers_in_use.py."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
import zarr
from click.testing import CliRunner

import hsstore
from hsstore.cli import main
from hsstore.codec import tiers
from hsstore.errors import BadInputError, FormatError, IncompatibleDatasetError
from hsstore.loader import Loader
from hsstore.spec.layers import LayerSpec
from hsstore.spec.manifest import Manifest
from tests.peer_packages import peer
from tests.test_interop_speculators import bits
from tools.synthetic import llm_like_states

H = 32
LAYERS = [LayerSpec(1), LayerSpec(2), LayerSpec(3), LayerSpec(4)]
LOSSY = ("fp8-token", "fp8-token-layer", "bf16-m0", "bf16-m2", "bf16-m3", "bf16-m6",
         "bf16-m2-final-m3", "bf16-m1-final-m5")  # fmt: skip


def data(n: int = 5):
    out = []
    for k in range(n):
        t = 3 + 7 * k
        g = torch.Generator().manual_seed(k)
        ids = torch.randint(0, 1000, (t,), generator=g)
        mask = (torch.rand(t, generator=g) < 0.7).long()
        out.append((ids, mask, llm_like_states(t, len(LAYERS), H, seed=k)))
    return out


def write(path: Path, samples, tier: str | None = None) -> hsstore.Dataset:
    ds = hsstore.create(
        path, layers=LAYERS, hidden_size=H, dtype="bf16", model={"num_hidden_layers": 4}, tier=tier
    )
    with ds.writer() as w:
        for k, (ids, mask, hidden) in enumerate(samples):
            w.add(f"s{k}", ids, mask, hidden)
    return hsstore.open(path)


def assert_within_bound(tier: tiers.Tier, given: torch.Tensor, stored, scales) -> None:
    got = tiers.dequantize(stored, scales).float()  # what a trainer reads (bf16)
    err = (got - given.float()).abs()
    bound = tier.bound(given, scales, final_position=given.shape[1] - 1)
    assert bool((err <= bound).all()), float((err / bound).max())


def wide_values(seed: int) -> torch.Tensor:
    """Gaussian values over 2^-40 .. 2^40 per token, so every tier meets its subnormal range."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(64, 3, 48, generator=g, dtype=torch.float64)
    x *= torch.exp2(torch.randint(-40, 40, (64, 3, 48), generator=g).double())
    return x.float()


@pytest.mark.parametrize("name", LOSSY)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_bound_holds_on_random_values(name, dtype):
    tier = tiers.parse(name)
    for seed in range(3):
        given = wide_values(seed).to(dtype)
        if dtype == torch.float16:
            given = given.clamp(-6e4, 6e4)
        stored, scales = tiers.quantize(tier, given, final_position=2)
        assert (
            stored.dtype
            == {"bfloat16": torch.bfloat16, "float8_e4m3fn": torch.float8_e4m3fn}[tier.dtype]
        )
        assert_within_bound(tier, given, stored, scales)
        # the bound is not slack: some value comes close to it
        got = tiers.dequantize(stored, scales).float()
        use = (got - given.float()).abs() / tier.bound(given, scales, final_position=2)
        assert all(float(use[:, j].max()) > 0.5 for j in range(3))


def test_bound_holds_on_real_minilm_states():
    from tools.real_states import minilm_states

    real = minilm_states(2, max_tokens=48)
    for name in LOSSY:
        tier = tiers.parse(name)
        for _ids, states in real:
            stored, scales = tiers.quantize(tier, states, final_position=states.shape[1] - 1)
            assert_within_bound(tier, states, stored, scales)


def test_bf16_tiers_drop_exactly_the_low_mantissa_bits():
    x = llm_like_states(50, 2, 64, seed=3)
    for k in range(7):
        y, scales = tiers.quantize(tiers.parse(f"bf16-m{k}"), x)
        assert scales is None and y.dtype == torch.bfloat16
        low = y.view(torch.int16).int() & ((1 << (7 - k)) - 1)
        assert int(low.abs().sum()) == 0
        again, _ = tiers.quantize(tiers.parse(f"bf16-m{k}"), y)
        assert bits(again) == bits(y)  # idempotent: re-encoding loses nothing more
    # round to nearest even at the halfway point: 1 + 2^-3 keeps 2 bits -> 1 (even), and
    # 1 + 3 * 2^-3 -> 1 + 2^-1 (even); non-finite values pass through
    x = torch.tensor([1.125, 1.375, float("inf"), float("nan"), -1.125])
    y, _ = tiers.quantize(tiers.parse("bf16-m2"), x.view(1, 1, -1))
    assert y.flatten()[:2].tolist() == [1.0, 1.5] and y.flatten()[4] == -1.0
    assert torch.isinf(y.flatten()[2]) and torch.isnan(y.flatten()[3])


def test_final_tier_keeps_more_of_the_verifier_state_in_chunks_of_its_own(tmp_path):
    # the verifier's state (the normed final one) is not the last listed: the rule finds it
    layers = [LayerSpec(1), LayerSpec(4, final_norm=True), LayerSpec(2), LayerSpec(4)]
    hidden_size, samples = 1024, []
    for k in range(4):
        g = torch.Generator().manual_seed(k)
        ids = torch.randint(0, 1000, (100,), generator=g)
        samples.append(
            (ids, torch.ones(100, dtype=torch.long), llm_like_states(100, 4, hidden_size, seed=k))
        )

    def write_in(name: str, tier: str, **layout) -> hsstore.Dataset:
        ds = hsstore.create(tmp_path / name, layers=layers, hidden_size=hidden_size,
                            dtype="bf16", model={"num_hidden_layers": 4}, tier=tier, **layout)  # fmt: skip
        with ds.writer() as w:
            for k, (ids, mask, hidden) in enumerate(samples):
                w.add(f"s{k}", ids, mask, hidden)
        return hsstore.open(tmp_path / name)

    ds = write_in("mixed", "bf16-m2-final-m3")
    assert ds.manifest.layout.layers_per_chunk == 1
    assert ds.manifest.tier.final_state == tiers.Rounding(3, 2.0**-4, 2.0**-130)
    for k, (_ids, _mask, hidden) in enumerate(samples):
        stored = ds[k].hidden
        for j in range(4):
            bits_kept = 3 if j == 1 else 2
            want = tiers.round_mantissa(hidden[:, j], bits_kept)
            assert bits(stored[:, j]) == bits(want), j
    low = ds[0].hidden[:, 1].view(torch.int16).int() & (1 << 4)  # the third bit, kept
    assert int(low.count_nonzero()) > 0

    # each layer's own chunks are what makes the verifier's extra bit cheap: the same states
    # with all layers in one chunk store more bytes
    shared = write_in("shared", "bf16-m2-final-m3", layers_per_chunk=4)
    assert shared.manifest.layout.layers_per_chunk == 4
    assert bits(shared[0].hidden) == bits(ds[0].hidden)

    def stored_bytes(name: str) -> int:
        shards = (tmp_path / name).glob("segments/*/states/c/**/*")
        return sum(f.stat().st_size for f in shards if f.is_file())

    assert stored_bytes("mixed") < 0.96 * stored_bytes("shared")

    # the loader and inspect: bf16 values as stored, and a bound per layer that holds
    batch = next(iter(Loader(tmp_path / "mixed", max_tokens=100, shuffle=False)))
    # (the loader puts the verifier's state last)
    assert bits(batch["per_layer_hidden_states"][0]) == bits(ds[0].hidden[:, [0, 2, 3, 1]])
    write_in("ref", "lossless", layers_per_chunk=4)
    r = CliRunner().invoke(
        main, ["inspect", str(tmp_path / "mixed"), "--reference", str(tmp_path / "ref"), "--json"]
    )
    assert r.exit_code == 0, r.output
    report = json.loads(r.output)["lossy"]
    assert report["tier"]["final_state"]["mantissa_bits"] == 3
    assert [x["bound"]["max_relative_error"] for x in report["layers"]] == [
        2**-3,
        2**-4,
        2**-3,
        2**-3,
    ]
    assert all(x["measured"]["bound_holds"] for x in report["layers"])
    text = CliRunner().invoke(main, ["inspect", str(tmp_path / "mixed")]).output
    assert "the verifier's state keeps 3 mantissa bits" in text

    # the recorded final-state bound must be the name's, and the name must keep more there
    obj = ds.manifest.to_json()
    obj["tier"]["final_state"]["max_relative_error"] = 2.0**-6
    with pytest.raises(FormatError, match="is not what tier 'bf16-m2-final-m3' records"):
        Manifest.from_json(obj, where="test")
    with pytest.raises(BadInputError, match="keeps no more bits of the final state"):
        hsstore.create(tmp_path / "bad", layers=layers, hidden_size=hidden_size, dtype="bf16",
                       tier="bf16-m3-final-m3")  # fmt: skip
    # seven bits of a bf16 final state is all of it
    exact = write_in("m7", "bf16-m0-final-m7")
    assert bits(exact[0].hidden[:, 1]) == bits(samples[0][2][:, 1])


def test_fp8_token_is_hs_connectors_quantizer_bit_for_bit(tmp_path):
    fp8_utils = peer("hs_connectors.fp8_utils")
    samples = data()
    ds = write(tmp_path / "ds", samples, "fp8-token")
    assert ds.dtype == torch.float8_e4m3fn and ds.manifest.tier.name == "fp8-token"
    for k, (_ids, _mask, hidden) in enumerate(samples):
        q, scale = fp8_utils.quantize_tensor_to_fp8(hidden)
        s = ds[k]
        assert bits(s.hidden) == bits(q) and bits(s.scales) == bits(scale.reshape(-1))
        want = fp8_utils.dequantize_fp8_tensor(q, scale)
        assert bits(s.dequantized()) == bits(want)


def test_fp8_token_layer_scales_each_layer(tmp_path):
    fp8_utils = peer("hs_connectors.fp8_utils")
    samples = data()
    ds = write(tmp_path / "ds", samples, "fp8-token-layer")
    for k, (_ids, _mask, hidden) in enumerate(samples):
        s = ds[k]
        t = hidden.shape[0]
        q, scale = fp8_utils.quantize_tensor_to_fp8(hidden.reshape(t * len(LAYERS), H))
        assert s.scales.shape == (t, len(LAYERS))
        assert bits(s.hidden) == bits(q.reshape(hidden.shape))
        assert bits(s.scales) == bits(scale.reshape(t, len(LAYERS)))
        part = ds.read(k, layers=[3, 1])  # scales follow the layers read
        assert bits(part.dequantized()) == bits(s.dequantized()[:, [3, 1]])


def test_lossless_stays_the_default_and_bit_identical(tmp_path):
    samples = data()
    ds = write(tmp_path / "ds", samples)
    assert ds.manifest.tier is None and "tier" not in ds.manifest.to_json()
    for k, (_ids, _mask, hidden) in enumerate(samples):
        assert bits(ds[k].hidden) == bits(hidden)
    r = CliRunner().invoke(main, ["convert", str(ds.path), str(tmp_path / "copy"), "--to", "hsstore",
                                  "--no-progress"])  # fmt: skip
    assert r.exit_code == 0, r.output
    copy = hsstore.open(tmp_path / "copy")
    assert copy.manifest.tier is None and copy.sample_ids == ds.sample_ids
    for k, (_ids, _mask, hidden) in enumerate(samples):
        assert bits(copy[k].hidden) == bits(hidden)


@pytest.mark.parametrize("name", ["fp8-token", "fp8-token-layer", "bf16-m3"])
def test_zarr_python_reads_the_arrays_and_decodes_by_hand(tmp_path, name):
    samples = data()
    ds = write(tmp_path / "ds", samples, name)
    for seg_no, info in enumerate(ds.manifest.segments):
        group = zarr.open_group(str(tmp_path / "ds" / "segments" / info.id), mode="r")
        states = torch.from_numpy(np.asarray(group["states"][:]))
        scales = None
        if "scales" in group:  # [rows] or, per token and layer, [rows * L] row after row
            scales = torch.from_numpy(np.asarray(group["scales"][:])).reshape(states.shape[0], -1)
        index = ds.index.filter(ds.index.column("segment").to_numpy() == seg_no)
        for row, n, sid in zip(index.column("row_offset").to_pylist(),
                               index.column("num_tokens").to_pylist(),
                               index.column("sample_id").to_pylist(), strict=True):  # fmt: skip
            raw = states[row : row + n]
            if scales is None:  # bf16 bits as uint16
                by_hand = raw.view(torch.bfloat16)
            else:  # fp8 bits as uint8, times the [T] or [T, L] scale, in bf16
                s = scales[row : row + n].to(torch.bfloat16)
                s = s.reshape(n, -1, 1)
                by_hand = raw.view(torch.float8_e4m3fn).to(torch.bfloat16) * s
            assert bits(by_hand) == bits(ds.get(sid).dequantized())


def test_bad_tier_names_and_options_are_one_line(tmp_path):
    write(tmp_path / "ds", data(2))
    runner = CliRunner()
    cases = [
        (["convert", str(tmp_path / "ds"), str(tmp_path / "x"), "--tier", "fp9"], "unknown tier"),
        (
            [
                "convert",
                str(tmp_path / "ds"),
                str(tmp_path / "x"),
                "--tier",
                "bf16-m2",
                "--to",
                "speculators-v1",
            ],
            "--tier: only for converting into hsstore",
        ),  # fmt: skip
        (
            [
                "extract",
                "--model",
                str(tmp_path),
                "--data",
                str(tmp_path),
                "--out",
                str(tmp_path / "y"),
                "--tier",
                "bf16-m9",
            ],
            "unknown tier 'bf16-m9'",
        ),  # fmt: skip
        (["inspect", str(tmp_path / "ds"), "--reference", str(tmp_path / "nope")], "nope"),
    ]
    for args, message in cases:
        r = runner.invoke(main, args)
        assert r.exit_code == 2, (args, r.output)
        lines = [x for x in r.output.splitlines() if x.strip()]
        assert len(lines) == 1 and message in lines[0], (args, r.output)
    assert not (tmp_path / "x").exists() and not (tmp_path / "y").exists()
    with pytest.raises(BadInputError, match="unknown tier"):
        hsstore.create(tmp_path / "z", layers=LAYERS, hidden_size=H, dtype="bf16", tier="fp4")


def test_a_tier_is_kept_across_resumes_and_refused_when_another(tmp_path):
    write(tmp_path / "ds", data(2), "bf16-m3")
    again = hsstore.create(tmp_path / "ds", layers=LAYERS, hidden_size=H, dtype="bf16",
                           model={"num_hidden_layers": 4}, tier="bf16-m3", exist_ok=True)  # fmt: skip
    assert again.manifest.tier.name == "bf16-m3"
    with pytest.raises(IncompatibleDatasetError, match="tier bf16-m3 .asked for bf16-m2"):
        hsstore.create(tmp_path / "ds", layers=LAYERS, hidden_size=H, dtype="bf16",
                       model={"num_hidden_layers": 4}, tier="bf16-m2", exist_ok=True)  # fmt: skip


def test_manifest_tier_must_be_what_its_name_records(tmp_path):
    man = write(tmp_path / "ds", data(1), "fp8-token").manifest
    obj = man.to_json()
    assert obj["tier"] == tiers.parse("fp8-token").to_json()
    obj["tier"] = dict(obj["tier"], max_relative_error=0.001)  # a tighter bound than the truth
    with pytest.raises(FormatError, match="is not what tier 'fp8-token' records"):
        Manifest.from_json(obj, where="test")
    obj["tier"] = tiers.parse("bf16-m3").to_json()  # a bf16 tier on fp8 states
    with pytest.raises(FormatError, match="stores bfloat16"):
        Manifest.from_json(obj, where="test")


def test_fp8_tiers_refuse_non_finite_states(tmp_path):
    ds = hsstore.create(tmp_path / "ds", layers=LAYERS, hidden_size=H, dtype="bf16",
                        tier="fp8-token")  # fmt: skip
    hidden = llm_like_states(4, len(LAYERS), H)
    hidden[2, 1, 5] = float("nan")
    with ds.writer() as w, pytest.raises(BadInputError, match="NaN or Inf, which tier fp8-token"):
        w.add("bad", torch.arange(4), torch.ones(4, dtype=torch.long), hidden)
    assert hsstore.open(tmp_path / "ds").sample_ids == []
