"""The audit's building blocks on hand-made inputs: sampling, accumulators, the norm identity,
the pure checks, and loading only the output head from safetensors."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from hsstore import LayerSpec
from hsstore.audit import alignment, checks
from hsstore.audit.collect import SampleRecord
from hsstore.audit.layer_stats import LayerAccumulator, PairAccumulator
from hsstore.audit.lm_head import load_output_head
from hsstore.audit.norm_fit import BROKEN, HOLDS, norm_fit, rows_needed
from hsstore.audit.sampling import RowReservoir, plan_reads
from hsstore.audit.verdict import Verdict, worst
from hsstore.segment.stats import StatsAccumulator


def test_full_plan_reads_everything_in_order():
    plan = plan_reads(5, np.array([3, 1, 4, 1, 5]), token_budget=2, seed=0, full=True)
    assert plan.indices == [0, 1, 2, 3, 4] and plan.full


def test_sampled_plan_covers_the_budget_in_storage_order():
    lengths = np.arange(1, 201)
    plan = plan_reads(200, lengths, token_budget=500, seed=3, full=False)
    assert plan.indices == sorted(plan.indices)
    assert len(set(plan.indices)) == len(plan.indices)
    assert lengths[plan.indices].sum() >= 500
    assert lengths[plan.indices[:-1]].sum() < 500 + lengths.max()
    assert plan == plan_reads(200, lengths, token_budget=500, seed=3, full=False)


def test_sampling_is_per_token_so_long_samples_are_favoured():
    lengths = np.array([1000] + [10] * 100)
    hits = sum(0 in plan_reads(101, lengths, token_budget=50, seed=s, full=False).indices
               for s in range(40))  # fmt: skip
    # per-sample sampling would pick sample 0 in ~5% of draws; per-token, in most of them
    assert hits > 20


def test_plan_without_lengths_is_a_permutation_with_a_budget():
    plan = plan_reads(7, None, token_budget=10, seed=0, full=False)
    assert sorted(plan.indices) == list(range(7)) and plan.token_budget == 10


def test_reservoir_keeps_capacity_rows_drawn_from_the_input():
    res = RowReservoir(10, seed=0)
    for start in range(0, 100, 7):
        rows = torch.arange(start, min(start + 7, 100), dtype=torch.float32)
        res.add(rows=rows, twice=rows * 2)
    kept = res.get("rows")
    assert len(res) == 10 and len(set(kept.tolist())) == 10
    assert torch.equal(res.get("twice"), kept * 2)
    assert kept.max() > 20  # later batches can still enter the sample


def test_reservoir_with_room_keeps_everything():
    res = RowReservoir(100, seed=0)
    res.add(rows=torch.arange(5.0))
    res.add(rows=torch.arange(5.0, 9.0))
    assert sorted(res.get("rows").tolist()) == list(range(9))


def test_reservoir_does_not_favour_early_or_late_batches():
    means = []
    for seed in range(100):
        res = RowReservoir(10, seed=seed)
        for start in range(0, 100, 7):
            res.add(rows=torch.arange(start, min(start + 7, 100), dtype=torch.float32))
        means.append(float(res.get("rows").mean()))
    # a uniform sample of 0..99 has mean 49.5; the mean of 100 such means has sd ~0.9
    assert 45 < sum(means) / len(means) < 54


def test_layer_accumulator_counts_bad_rows():
    x = torch.randn(10, 8)
    x[1] = 0
    x[2] = 0.5
    x[3, 4] = math.nan
    x[4, 0] = math.inf
    totals = StatsAccumulator(1, "float32", sample_every=1)  # the writer's, on every row
    totals.update(x[:, None].numpy())
    acc = LayerAccumulator()
    acc.update(x)
    s = acc.summary(totals.layers[0], x)
    assert (s["zero_rows"], s["constant_rows"], s["nan"], s["inf"], s["nonfinite_rows"]) == (
        1,
        1,
        1,
        1,
        2,
    )
    good = torch.cat([x[:3], x[5:]])
    assert s["rms"] == pytest.approx(float(good.pow(2).mean().sqrt()), rel=1e-5)
    assert sum(s["log2_hist"]["counts"]) == int((torch.isfinite(x) & (x != 0)).sum())
    assert s["abs_max"] == pytest.approx(float(good.abs().max()))


def test_pair_accumulator_finds_identical_layers():
    h = torch.randn(6, 3, 4)
    h[:, 2] = h[:, 0]
    pairs = {(p["a"], p["b"]): p for p in _pairs(h)}
    assert pairs[(0, 2)]["bit_identical"] and pairs[(0, 2)]["relative_distance"] == 0
    assert not pairs[(0, 1)]["bit_identical"] and pairs[(0, 1)]["relative_distance"] > 0.5


def _pairs(h):
    acc = PairAccumulator(h.shape[1])
    acc.update(h)
    return acc.pairs(h)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_norm_identity_tells_post_from_pre_norm(dtype):
    gen = torch.Generator().manual_seed(0)
    h = 48
    n = rows_needed(h)
    x = torch.randn(n, h, generator=gen) * (0.5 + 2 * torch.rand(n, 1, generator=gen))
    w = 0.3 + 1.7 * torch.rand(h, generator=gen)
    post = w * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)
    fit_post, fit_pre = norm_fit(post.to(dtype).float()), norm_fit(x.to(dtype).float())
    assert fit_post.ratio < HOLDS and fit_post.holds
    assert fit_post.negative_share < 0.01  # a norm's weights are positive
    assert fit_pre.ratio > BROKEN and not fit_pre.holds and not fit_pre.degenerate
    assert norm_fit(post[: h - 1]) is None


def _rec(sid, **kw) -> SampleRecord:
    base = dict(num_ids=4, num_mask=4, num_rows=4, expected_tokens=4, loss_tokens=2)
    base.update(kw)
    return SampleRecord(0, sid, **base)


def test_lengths_check():
    assert checks.check_lengths([_rec("a"), _rec("b")]).verdict is Verdict.OK
    bad = checks.check_lengths([_rec("a"), _rec("b", num_rows=3)])
    assert bad.verdict is Verdict.FAIL and "'b'" in bad.reason
    assert checks.check_lengths([_rec("a", expected_tokens=5)]).verdict is Verdict.FAIL


def test_readable_check_quotes_the_error():
    recs = [_rec("a"), SampleRecord(1, "b", error="x.pt: truncated zip")]
    res = checks.check_readable(recs)
    assert res.verdict is Verdict.FAIL and "truncated zip" in res.reason


def test_vocab_check():
    assert checks.check_vocab([("a", 0, 9)], 10, "all").verdict is Verdict.OK
    assert checks.check_vocab([("a", 0, 10)], 10, "all").verdict is Verdict.FAIL
    assert checks.check_vocab([("a", -1, 3)], 10, "all").verdict is Verdict.FAIL
    assert checks.check_vocab([("a", 0, 10)], None, "all").verdict is Verdict.SKIP


def test_empty_loss_masks_warn_when_rare_fail_when_common():
    ids = [f"s{i}" for i in range(200)]
    one = np.ones(200, dtype=int)
    one[7] = 0
    assert checks.check_empty_loss_masks(ids, one, "all").verdict is Verdict.WARN
    many = one.copy()
    many[:10] = 0
    assert checks.check_empty_loss_masks(ids, many, "all").verdict is Verdict.FAIL
    assert checks.check_empty_loss_masks(ids, np.ones(200), "all").verdict is Verdict.OK


def test_duplicate_states_with_different_ids_are_caught():
    res = checks.check_duplicate_samples([("a", "x"), ("b", "y")], [("a", "S"), ("b", "S")], "all")
    assert res.verdict is Verdict.FAIL and "same states" in res.reason


def test_depth_declarations_are_checked_against_the_model():
    specs = [LayerSpec(2), LayerSpec(5)]
    summaries = [{"token_rms_median": 1.0}, {"token_rms_median": 2.0}]
    assert checks.check_depth_order(summaries, specs, 4).verdict is Verdict.FAIL
    specs = [LayerSpec(2, final_norm=True), LayerSpec(4)]
    assert checks.check_depth_order(summaries, specs, 4).verdict is Verdict.FAIL
    assert (
        checks.check_depth_order(summaries, [LayerSpec(2), LayerSpec(4)], 4).verdict is Verdict.OK
    )


def _table(agree: dict, default: float = 0.05) -> dict:
    cells = [{"interpretation": i, "shift": s, "declared": (i, s) == ("post_norm", 0),
              "agreement": agree.get((i, s), default), "tokens": 100}
             for i in ("post_norm", "pre_norm") for s in (-1, 0, 1)]  # fmt: skip
    return {"layer_label": "after 4 +final_norm", "final_norm_declared": True, "cells": cells}


def test_alignment_verdicts():
    good = alignment.check_alignment([_table({("post_norm", 0): 0.8})], [3])
    assert good.verdict is Verdict.OK
    shifted = alignment.check_alignment(
        [_table({("post_norm", 0): 0.1, ("post_norm", 1): 0.7})], [3]
    )
    assert shifted.verdict is Verdict.FAIL and "shift +1" in shifted.reason
    weak = alignment.check_alignment([_table({("pre_norm", 1): 0.03}, default=0.01)], [3])
    assert weak.verdict is Verdict.WARN
    assert alignment.check_alignment([], []).verdict is Verdict.SKIP


def test_worst_verdict():
    assert worst([Verdict.OK, Verdict.SKIP]) is Verdict.OK
    assert worst([Verdict.WARN, Verdict.FAIL, Verdict.OK]) is Verdict.FAIL
    assert worst([]) is Verdict.OK


def _save_llama(path, **overrides):
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = dict(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
               num_key_value_heads=2, vocab_size=40, rms_norm_eps=1e-5)  # fmt: skip
    cfg.update(overrides)
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**cfg))
    model.save_pretrained(path)
    return model


def test_head_loader_handles_tied_embeddings(tmp_path):
    model = _save_llama(tmp_path / "m", tie_word_embeddings=True)
    head = load_output_head(tmp_path / "m")
    assert head.tied
    assert torch.equal(head.weight, model.model.embed_tokens.weight.detach())
    assert head.eps == pytest.approx(1e-5)


def test_head_loader_reads_sharded_checkpoints(tmp_path):
    model = _save_llama(tmp_path / "m", tie_word_embeddings=False)
    model.save_pretrained(tmp_path / "sharded", max_shard_size="2KB")
    assert (tmp_path / "sharded" / "model.safetensors.index.json").exists()
    head = load_output_head(tmp_path / "sharded")
    assert not head.tied
    assert torch.equal(head.weight, model.lm_head.weight.detach())
    assert torch.equal(head.norm_weight, model.model.norm.weight.detach().float())


def test_head_normalize_matches_the_model_norm(tmp_path):
    model = _save_llama(tmp_path / "m")
    with torch.no_grad():
        model.model.norm.weight.uniform_(0.5, 2.0)
    model.save_pretrained(tmp_path / "m")
    head = load_output_head(tmp_path / "m")
    x = torch.randn(5, 16)
    with torch.no_grad():
        expected = model.model.norm(x)
    assert torch.allclose(head.normalize(x), expected, atol=1e-6)
    assert torch.allclose(head.unit_rms(expected), torch.ones(5), atol=1e-3)
