"""Each planted fault makes its check FAIL; clean data passes every check.

Data comes from a tiny random Llama that generated its own tokens greedily (audit_helpers), so
the lm-head agreement under the true alignment is exact and every wrong reading is worse.
"""

from __future__ import annotations

import math

import pytest
import torch
from audit_helpers import (
    CLEAN_LAYERS,
    LAYERS,
    Tiny,
    capture_states,
    clean_rows,
    make_tiny,
    write_dataset,
)

from hsstore import LayerSpec
from hsstore.audit import AuditOptions, Verdict, audit


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Tiny:
    return make_tiny(tmp_path_factory.mktemp("tiny"))


def run(path, tiny: Tiny | None = None, **kw):
    opts = AuditOptions(progress=False, lm_head=tiny.model_dir if tiny else None, **kw)
    return audit(path, opts)


def failed(result) -> set[str]:
    return {c.name for c in result.checks if c.verdict is Verdict.FAIL}


def test_clean_dataset_passes_every_check(tiny, tmp_path):
    res = run(write_dataset(tmp_path / "ds", clean_rows(tiny.samples)), tiny, model=tiny.model_dir)
    bad = [(c.name, c.verdict.value, c.reason) for c in res.checks if c.verdict is not Verdict.OK]
    assert bad == []
    assert res.verdict is Verdict.OK


def test_clean_agreement_is_far_above_every_wrong_reading(tiny, tmp_path):
    res = run(write_dataset(tmp_path / "ds", clean_rows(tiny.samples)), tiny)
    cells = res.lm_head["tables"][0]["cells"]
    declared = next(c for c in cells if c["declared"])
    others = [c["agreement"] for c in cells if not c["declared"]]
    assert declared["agreement"] > max(others) + 0.2


def test_clean_bfloat16_dataset_passes(tiny, tmp_path):
    path = write_dataset(tmp_path / "ds", clean_rows(tiny.samples), dtype=torch.bfloat16)
    res = run(path, tiny)
    assert failed(res) == set()


def test_layer_stored_twice(tiny, tmp_path):
    rows = clean_rows(tiny.samples, sources=[1, 1, 3, "post"])
    res = run(write_dataset(tmp_path / "ds", rows))
    assert "duplicate_layers" in failed(res)
    assert "bit-identical" in res.check("duplicate_layers").reason


def test_layer_stored_twice_with_rounding_noise(tiny, tmp_path):
    rows = []
    for sid, ids, mask, h in clean_rows(tiny.samples):
        h = h.clone()
        h[:, 1] = h[:, 0] * (1 + 1e-5 * torch.randn_like(h[:, 0]))
        rows.append((sid, ids, mask, h))
    res = run(write_dataset(tmp_path / "ds", rows))
    assert "duplicate_layers" in failed(res)
    assert "relative distance" in res.check("duplicate_layers").reason


def test_layers_in_wrong_order(tiny, tmp_path):
    rows = clean_rows(tiny.samples, sources=[3, 1, 2, "post"])
    res = run(write_dataset(tmp_path / "ds", rows))
    assert "depth_order" in failed(res)


def test_tokens_shifted_against_states(tiny, tmp_path):
    rows = [(sid, ids[1:], mask[1:], h[:-1]) for sid, ids, mask, h in clean_rows(tiny.samples)]
    res = run(write_dataset(tmp_path / "ds", rows), tiny)
    assert "lm_head_alignment" in failed(res)
    assert "shift -1" in res.check("lm_head_alignment").reason


def test_pre_norm_state_declared_post_norm(tiny, tmp_path):
    rows = clean_rows(tiny.samples, sources=[1, 2, 3, LAYERS])
    path = write_dataset(tmp_path / "ds", rows)
    assert "final_norm" in failed(run(path))  # model-free norm identity
    with_head = failed(run(path, tiny))
    assert {"final_norm", "final_norm_exact", "lm_head_alignment"} <= with_head
    recomputed = run(path, tiny, model=tiny.model_dir).check("model_recompute")
    assert recomputed.verdict is Verdict.FAIL
    assert "is not the model's after 4 +final_norm" in recomputed.reason
    assert "but its after 4 (" in recomputed.reason


def test_post_norm_state_declared_pre_norm(tiny, tmp_path):
    layers = CLEAN_LAYERS[:3] + [LayerSpec(LAYERS, final_norm=False)]
    path = write_dataset(tmp_path / "ds", clean_rows(tiny.samples), layers=layers)
    assert "final_norm" in failed(run(path))
    assert {"final_norm", "final_norm_exact", "lm_head_alignment"} <= failed(run(path, tiny))


def test_pre_norm_state_declared_pre_norm_passes(tiny, tmp_path):
    layers = CLEAN_LAYERS[:3] + [LayerSpec(LAYERS, final_norm=False)]
    rows = clean_rows(tiny.samples, sources=[1, 2, 3, LAYERS])
    res = run(write_dataset(tmp_path / "ds", rows, layers=layers), tiny)
    assert failed(res) == set()


def _edit(tiny: Tiny, k: int, fn) -> list:
    rows = clean_rows(tiny.samples)
    sid, ids, mask, h = rows[k]
    h = h.clone()
    fn(h)
    rows[k] = (sid, ids, mask, h)
    return rows


def test_zero_rows(tiny, tmp_path):
    rows = _edit(tiny, 2, lambda h: h[40:].zero_())
    res = run(write_dataset(tmp_path / "ds", rows))
    assert "zero_or_constant_rows" in failed(res)


def test_constant_rows(tiny, tmp_path):
    rows = _edit(tiny, 1, lambda h: h[5:7, 2].fill_(0.25))
    res = run(write_dataset(tmp_path / "ds", rows), full=True)
    assert "zero_or_constant_rows" in failed(res)


def test_nan_rows(tiny, tmp_path):
    rows = _edit(tiny, 3, lambda h: h[7, 1].fill_(math.nan))
    res = run(write_dataset(tmp_path / "ds", rows))
    assert "nonfinite" in failed(res)


def test_duplicate_samples(tiny, tmp_path):
    rows = clean_rows(tiny.samples)
    sid, ids, mask, h = rows[0]
    rows.append(("copy-of-s0", ids, mask, h))
    res = run(write_dataset(tmp_path / "ds", rows))
    assert "duplicate_samples" in failed(res)
    assert "copy-of-s0" in res.check("duplicate_samples").reason


def test_empty_loss_mask(tiny, tmp_path):
    rows = clean_rows(tiny.samples)
    sid, ids, mask, h = rows[4]
    rows[4] = (sid, ids, torch.zeros_like(mask), h)
    res = run(write_dataset(tmp_path / "ds", rows))
    assert "empty_loss_masks" in failed(res)
    assert "'s4'" in res.check("empty_loss_masks").reason


def test_token_ids_outside_vocab(tiny, tmp_path):
    top = max(int(s.input_ids.max()) for s in tiny.samples)
    res = run(write_dataset(tmp_path / "ds", clean_rows(tiny.samples), vocab_size=top))
    assert "token_ids_in_vocab" in failed(res)


def test_sampled_audit_reads_a_subset_and_still_passes(tiny, tmp_path):
    rows = clean_rows(tiny.samples) * 1
    rows = [(f"{sid}-{k}", ids, m, h + k * 1e-3) for k in range(4) for sid, ids, m, h in rows]
    path = write_dataset(tmp_path / "ds", rows)
    res = run(path, sample_tokens=100)
    assert res.sampling["mode"] == "sample"
    assert res.sampling["samples_read"] < len(rows)
    assert res.sampling["tokens_read"] >= 100
    assert res.summary["samples"] == len(rows)  # the summary still covers everything
    assert res.check("duplicate_samples").verdict is Verdict.FAIL  # same ids, found via index


def test_aux_layers_labelled_one_deeper_fail_only_against_the_model(tiny, tmp_path):
    """The seed's bug: states of depths 1 and 2 labelled 2 and 3. Statistics cannot see it (the
    depths still grow); the model, run on the same tokens, can."""
    layers = [LayerSpec(2), LayerSpec(3), CLEAN_LAYERS[3]]
    rows = clean_rows(tiny.samples, sources=[1, 2, "post"])
    path = write_dataset(tmp_path / "ds", rows, layers=layers)
    assert failed(run(path, tiny)) == set()
    res = run(path, tiny, model=tiny.model_dir)
    assert failed(res) == {"model_recompute"}
    reason = res.check("model_recompute").reason
    assert "layer 0 (after 2) is not the model's after 2" in reason
    assert "but its after 1 (" in reason and "layer 1 (after 3)" in reason


def test_pre_norm_states_of_constant_scale_pass_with_the_models_norm_weight(tiny, tmp_path):
    """Pre-norm states whose per-token weighted norm is constant (as a trained model's can be)
    satisfy the weight-free norm identity; the model's own norm weight says they are not its
    norm's output, and that answer stands."""
    layers = CLEAN_LAYERS[:3] + [LayerSpec(LAYERS, final_norm=False)]
    rows = [(sid, ids, mask, torch.cat([h[:, :3], 3 * h[:, 3:]], dim=1))
            for sid, ids, mask, h in clean_rows(tiny.samples)]  # fmt: skip
    path = write_dataset(tmp_path / "ds", rows, layers=layers)
    assert "final_norm" in failed(run(path))  # the weight-free fit alone is fooled
    res = run(path, tiny)
    assert res.check("final_norm_exact").verdict is Verdict.OK
    assert res.check("final_norm").verdict is Verdict.OK
    assert "final_norm_exact" in res.check("final_norm").reason


def _one_sample_twice(tiny: Tiny, final: str | int) -> list:
    """One sample's states as stored, and again as a second extraction whose arithmetic differs
    (float64, rounded to float32): rows equal to the last bits, so the fit gets more rows than
    unknowns but only half as many distinct states, as when a trained model computes nearly
    the same state in many contexts or a prefix is extracted in two batch shapes."""
    from transformers import LlamaForCausalLM

    first = tiny.samples[0]
    model = LlamaForCausalLM.from_pretrained(tiny.model_dir, dtype=torch.float64).eval()
    again = capture_states(model, first.input_ids[None])
    sources = [1, 2, 3, final]
    return [
        (first.sample_id, first.input_ids, first.loss_mask, stack_states(first.states, sources)),
        ("again", first.input_ids, first.loss_mask,
         stack_states({k: v[0] for k, v in again.items()}, sources)),
    ]  # fmt: skip


def stack_states(states: dict, sources: list) -> torch.Tensor:
    return torch.stack([states[k].float() for k in sources], dim=1)


def test_few_distinct_pre_norm_states_are_no_proof_of_a_norm(tiny, tmp_path):
    """Near-copies of fewer states than the hidden size satisfy the weight-free identity with
    weights of both signs; declared pre-norm, that is no evidence of post-norm states."""
    layers = CLEAN_LAYERS[:3] + [LayerSpec(LAYERS, final_norm=False)]
    path = write_dataset(tmp_path / "pre", _one_sample_twice(tiny, LAYERS), layers=layers)
    check = run(path).check("final_norm")
    assert check.verdict is Verdict.SKIP, check
    assert "too few distinct states" in check.reason
    fit = check.details["layers"]["3"]
    assert fit["ratio"] < 2 and fit["negative_share"] > 0.05  # what used to claim post-norm
    # declared post-norm, the same pre-norm rows are not passed either
    wrong = write_dataset(tmp_path / "wrong", _one_sample_twice(tiny, LAYERS))
    assert run(wrong).check("final_norm").verdict is Verdict.SKIP


def test_few_distinct_post_norm_states_declared_pre_norm_still_fail(tiny, tmp_path):
    layers = CLEAN_LAYERS[:3] + [LayerSpec(LAYERS, final_norm=False)]
    path = write_dataset(tmp_path / "ds", _one_sample_twice(tiny, "post"), layers=layers)
    check = run(path).check("final_norm")
    assert check.verdict is Verdict.FAIL, check
    assert "positive weights" in check.reason
