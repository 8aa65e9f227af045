"""Lossy tiers as their readers see them: the loader and the adapters deliver the values
dequantized, inspect reports each tier's cost against a reference, exports and re-encoding
keep or convert the tier, and extraction writes it. How the tiers round and store values is
tests/test_tiers.py."""

from __future__ import annotations

import json

import pytest
import torch
from click.testing import CliRunner
from safetensors.torch import load_file

import hsstore
from hsstore.cli import main
from hsstore.codec import tiers
from hsstore.loader import Loader
from hsstore.spec.layers import verifier_position
from tests.peer_packages import peer
from tests.test_interop_speculators import bits
from tests.test_tiers import LAYERS, H, data, write


@pytest.mark.parametrize("max_tokens", [64, 16])  # 16: longer samples take the truncated path
def test_loader_batches_are_the_values_dequantized_by_hand(tmp_path, max_tokens):
    samples = data(6)
    ds = write(tmp_path / "ds", samples, "fp8-token-layer")
    seen = set()
    loader = Loader(ds.path, max_tokens=max_tokens, aux_layers=[0, 2], seed=2, num_threads=1)
    for batch in loader:
        assert batch["hidden_states"].dtype == torch.bfloat16
        assert set(batch) >= {"hidden_states", "verifier_last_hidden_states", "input_ids"}
        for d, i in enumerate(batch["sample_index"].tolist()):
            s = ds[i]
            by_hand = s.hidden.to(torch.bfloat16) * s.scales.to(torch.bfloat16)[:, :, None]
            cols = (batch["document_ids"][0] == d).nonzero().flatten()
            n = min(max_tokens, s.num_tokens)
            assert len(cols) == n
            assert bits(batch["hidden_states"][0, cols]) == bits(by_hand[:n, [0, 2]].flatten(1))
            assert bits(batch["verifier_last_hidden_states"][0, cols]) == bits(by_hand[:n, 3])
            seen.add(i)
    assert seen == set(range(len(samples)))


def test_adapter_delivers_dequantized_values(tmp_path):
    from hsstore.interop.integrations.speculators import HsstoreArrowDataset

    ds = write(tmp_path / "ds", data(), "fp8-token-layer")
    ours = HsstoreArrowDataset(64, ds.path)
    for k in range(len(ours)):
        values = ds[k].dequantized()
        item = ours[k]
        assert item["hidden_states"].dtype == torch.bfloat16
        assert bits(item["verifier_last_hidden_states"]) == bits(values[:, -1])


def test_inspect_shows_the_tier_and_measures_against_a_reference(tmp_path):
    samples = data()
    write(tmp_path / "ref", samples)
    write(tmp_path / "fp8", samples, "fp8-token")
    r = CliRunner().invoke(
        main, ["inspect", str(tmp_path / "fp8"), "--reference", str(tmp_path / "ref"), "--json"]
    )
    assert r.exit_code == 0, r.output
    doc = json.loads(r.output)
    lossy = doc["lossy"]
    assert lossy["tier"]["name"] == "fp8-token" and lossy["reference"]["tier"] == "lossless"
    assert len(lossy["layers"]) == len(LAYERS)
    for layer in lossy["layers"]:
        m = layer["measured"]
        assert m["bound_holds"] and 0 < m["max_bound_use"] <= 1
        assert 0 < m["rms_relative_error"] < layer["bound"]["max_relative_error"]
    import jsonschema

    from hsstore.schemas import INSPECT, load

    jsonschema.validate(doc, load(INSPECT))
    text = CliRunner().invoke(main, ["inspect", str(tmp_path / "fp8")]).output
    assert "lossy tier: fp8-token" in text and "pass --reference" in text

    # a dataset that is not what its tier claims: the bound shows broken
    write(tmp_path / "other", [(ids, mask, hidden * 1.25) for ids, mask, hidden in samples])
    r = CliRunner().invoke(
        main, ["inspect", str(tmp_path / "fp8"), "--reference", str(tmp_path / "other"), "--json"]
    )
    assert not any(x["measured"]["bound_holds"] for x in json.loads(r.output)["lossy"]["layers"])


def test_exports_respect_the_tier(tmp_path):
    fp8_utils = peer("hs_connectors.fp8_utils")
    samples = data()
    write(tmp_path / "fp8", samples, "fp8-token")
    write(tmp_path / "layer", samples, "fp8-token-layer")
    runner = CliRunner()
    for src, name, extra in (("fp8", "arrow-fp8", ["--fp8"]), ("fp8", "arrow", []),
                             ("layer", "arrow-layer", []), ("layer", "v1-layer", ["--to",
                             "speculators-v1"])):  # fmt: skip
        to = [] if "--to" in extra else ["--to", "speculators-arrow"]
        r = runner.invoke(main, ["convert", str(tmp_path / src), str(tmp_path / name), *to,
                                 "--no-progress", *extra])  # fmt: skip
        assert r.exit_code == 0, r.output
    layer = hsstore.open(tmp_path / "layer")
    for k, (_ids, _mask, hidden) in enumerate(samples):
        q, scale = fp8_utils.quantize_tensor_to_fp8(hidden)
        theirs = load_file(tmp_path / "arrow-fp8" / "hidden_states" / f"hs_{k}.safetensors")
        assert bits(theirs["hidden_states"]) == bits(q)  # what hs-connectors would write
        assert bits(theirs[fp8_utils.SCALES_KEY]) == bits(scale)
        plain = load_file(tmp_path / "arrow" / "hidden_states" / f"hs_{k}.safetensors")
        assert bits(plain["hidden_states"]) == bits(fp8_utils.dequantize_fp8_tensor(q, scale))
        per_layer = load_file(tmp_path / "arrow-layer" / "hidden_states" / f"hs_{k}.safetensors")
        assert bits(per_layer["hidden_states"]) == bits(layer[k].dequantized())
        v1 = torch.load(tmp_path / "v1-layer" / f"data_{k}.pt", weights_only=True)
        assert bits(torch.stack(v1["hidden_states"], dim=1)) == bits(layer[k].dequantized())


def test_reencode_between_tiers(tmp_path):
    samples = data()
    write(tmp_path / "fp8", samples, "fp8-token")
    runner = CliRunner()

    def convert(src: str, dst: str, *extra: str) -> None:
        r = runner.invoke(main, ["convert", str(tmp_path / src), str(tmp_path / dst),
                                 "--no-progress", *extra])  # fmt: skip
        assert r.exit_code == 0, r.output

    convert("fp8", "layer", "--tier", "fp8-token-layer")  # per-token scales fit: bits kept
    convert("fp8", "same", "--tier", "lossless")  # loses nothing more: the source's tier
    convert("layer", "m3", "--tier", "bf16-m3")
    src = hsstore.open(tmp_path / "fp8")
    layer, same, m3 = (hsstore.open(tmp_path / n) for n in ("layer", "same", "m3"))
    assert same.manifest.tier.name == "fp8-token" and m3.manifest.tier.name == "bf16-m3"
    assert m3.manifest.provenance["reencoded_from"]["tier"] == "fp8-token-layer"
    for k in range(len(samples)):
        assert bits(layer[k].hidden) == bits(src[k].hidden)
        assert bits(layer[k].dequantized()) == bits(src[k].dequantized())
        assert bits(same[k].hidden) == bits(src[k].hidden)
        want, _ = tiers.quantize(tiers.parse("bf16-m3"), layer[k].dequantized(torch.float32))
        assert bits(m3[k].hidden) == bits(want)
    r = runner.invoke(main, ["convert", str(tmp_path / "fp8"), str(tmp_path / "m3"),
                             "--tier", "bf16-m2", "--no-progress"])  # fmt: skip
    assert r.exit_code == 2 and "tier bf16-m3 (asked for bf16-m2)" in r.output

    # a lossless dataset into the tier that keeps a bit more of the verifier's state
    write(tmp_path / "plain", samples)
    convert("plain", "m2f3", "--tier", "bf16-m2-final-m3")
    m2f3 = hsstore.open(tmp_path / "m2f3")
    assert m2f3.manifest.layout.layers_per_chunk == 1
    for k, (_ids, _mask, hidden) in enumerate(samples):
        want, _ = tiers.quantize(m2f3.manifest.tier, hidden, final_position=len(LAYERS) - 1)
        assert bits(m2f3[k].hidden) == bits(want)


def test_inspect_lm_head_agreement_of_the_stored_final_state(tmp_path):
    from hsstore.demo_model import build_tiny_model

    model_dir = build_tiny_model(tmp_path / "model", hidden=H, layers=4, vocab=512)
    samples = data()
    write(tmp_path / "ref", samples)
    write(tmp_path / "m0", samples, "bf16-m0")

    def agreement(path: str) -> dict:
        r = CliRunner().invoke(main, ["inspect", str(tmp_path / path), "--reference",
                                      str(tmp_path / "ref"), "--lm-head", str(model_dir),
                                      "--json"])  # fmt: skip
        assert r.exit_code in (0, 1), r.output  # checks may WARN/FAIL on random states
        return json.loads(r.output)["lossy"]["lm_head"]

    same, lossy = agreement("ref"), agreement("m0")
    tokens = sum(len(ids) for ids, _, _ in samples)
    assert same == {"layer": 3, "tokens": tokens, "top1_agreement": 1.0}
    assert lossy["layer"] == 3 and lossy["tokens"] == tokens
    assert 0.3 < lossy["top1_agreement"] < 1.0  # one mantissa bit kept: some tokens flip


def test_extract_writes_its_tier(tmp_path):
    from hsstore.demo_model import build_tiny_model

    fp8_utils = peer("hs_connectors.fp8_utils")
    model = build_tiny_model(tmp_path / "model")
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(
        json.dumps({"messages": [{"role": "user", "content": f"the quick fox {i}"},
                                 {"role": "assistant", "content": "jumps over " * (i + 1)}]}) + "\n"
        for i in range(3)
    ))  # fmt: skip

    def extract(out: str, *tier: str) -> CliRunner:
        args = ["extract", "--model", str(model), "--data", str(prompts), "--out",
                str(tmp_path / out), "--device", "cpu", "--dtype", "bfloat16", "--no-progress",
                *tier]  # fmt: skip
        return CliRunner().invoke(main, args)

    for out, tier in (
        ("plain", ()),
        ("fp8", ("--tier", "fp8-token")),
        ("m2f3", ("--tier", "bf16-m2-final-m3")),
    ):
        r = extract(out, *tier)
        assert r.exit_code == 0, r.output
    plain, fp8 = hsstore.open(tmp_path / "plain"), hsstore.open(tmp_path / "fp8")
    assert fp8.manifest.tier.name == "fp8-token" and plain.manifest.tier is None
    assert fp8.sample_ids == plain.sample_ids and len(plain) == 3
    for k in range(len(plain)):
        q, scale = fp8_utils.quantize_tensor_to_fp8(plain[k].hidden)
        assert bits(fp8[k].hidden) == bits(q) and bits(fp8[k].scales) == bits(scale.reshape(-1))
    # the final-state tier: each layer in chunks of its own, the verifier's state kept at 3 bits
    m2f3 = hsstore.open(tmp_path / "m2f3")
    assert m2f3.manifest.layout.layers_per_chunk == 1 and m2f3.sample_ids == plain.sample_ids
    final = verifier_position(plain.layers)
    for k in range(len(plain)):
        want, _ = tiers.quantize(m2f3.manifest.tier, plain[k].hidden, final_position=final)
        assert bits(m2f3[k].hidden) == bits(want)
        assert bits(m2f3[k].hidden[:, final]) != bits(
            tiers.round_mantissa(plain[k].hidden[:, final], 2)
        )
    r = extract("fp8", "--tier", "bf16-m3")  # a rerun into it must keep its tier
    assert r.exit_code == 2 and "tier fp8-token (asked for bf16-m3)" in r.output, r.output
