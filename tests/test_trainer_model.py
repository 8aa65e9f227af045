"""Unit tests of the EAGLE-3 drafter pieces that do not need a dataset: attention masking and
TTT, vocabulary maps, the target head, batch alignment, the loss and checkpoints."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file

from hsstore import LayerSpec
from hsstore.errors import BadInputError
from hsstore.trainers.eagle3.checkpoint import load_drafter, save_checkpoint, server_config
from hsstore.trainers.eagle3.model import (
    DrafterConfig,
    Eagle3Drafter,
    TargetHead,
    block_causal_mask,
    load_target_tensors,
    rope_cos_sin,
)
from hsstore.trainers.eagle3.train import align_batch, step_validity, ttt_loss
from hsstore.trainers.eagle3.vocab import build_vocab_maps, count_tokens

H, V, D, K = 32, 50, 20, 3


def small_config(**kw) -> DrafterConfig:
    base = dict(
        hidden_size=H,
        num_aux_layers=K,
        vocab_size=V,
        draft_vocab_size=D,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        intermediate_size=64,
    )
    base.update(kw)
    return DrafterConfig(**base)


def random_doc(n: int, gen: torch.Generator) -> dict:
    return {
        "ids": torch.randint(0, V, (n,), generator=gen),
        "aux": torch.randn(n, K * H, generator=gen),
    }


def run(model, docs: list[dict], steps: int) -> list[torch.Tensor]:
    ids = torch.cat([d["ids"] for d in docs])[None]
    aux = torch.cat([d["aux"] for d in docs])[None]
    pos = torch.cat([torch.arange(len(d["ids"])) for d in docs])[None]
    doc = torch.cat([torch.full((len(d["ids"]),), i) for i, d in enumerate(docs)])
    with torch.no_grad():
        return model(ids, aux, pos, doc, steps=steps)


def test_packed_documents_do_not_see_each_other():
    """A document packed after another drafts exactly what it drafts alone, at every TTT step,
    on every position whose step-s input token is still inside the document."""
    torch.manual_seed(0)
    gen = torch.Generator().manual_seed(1)
    model = Eagle3Drafter(small_config()).eval()
    a, b = random_doc(7, gen), random_doc(9, gen)
    steps = 3
    packed = run(model, [a, b], steps)
    alone_a, alone_b = run(model, [a], steps), run(model, [b], steps)
    for s in range(steps):
        keep_a, keep_b = 7 - s, 9 - s
        torch.testing.assert_close(packed[s][0, :keep_a], alone_a[s][0, :keep_a])
        torch.testing.assert_close(packed[s][0, 7 : 7 + keep_b], alone_b[s][0, :keep_b])

    # And changing the second document changes nothing in the first.
    b2 = random_doc(9, gen)
    other = run(model, [a, b2], steps)
    for s in range(steps):
        torch.testing.assert_close(other[s][0, : 7 - s], packed[s][0, : 7 - s])
        assert not torch.allclose(other[s][0, 7:], packed[s][0, 7:])


def test_step_zero_is_causal():
    torch.manual_seed(0)
    gen = torch.Generator().manual_seed(2)
    model = Eagle3Drafter(small_config()).eval()
    a = random_doc(10, gen)
    changed = {"ids": a["ids"].clone(), "aux": a["aux"].clone()}
    changed["aux"][6] += 1.0
    before, after = run(model, [a], 1)[0], run(model, [changed], 1)[0]
    torch.testing.assert_close(before[0, :6], after[0, :6])
    assert not torch.allclose(before[0, 6:], after[0, 6:])


def test_ttt_step_s_is_fed_the_token_s_positions_ahead():
    """Step s at position i drafts from the true token x[i+s] (the accepted prefix): changing
    token p changes step s first at position p - s, and nothing before it."""
    torch.manual_seed(0)
    gen = torch.Generator().manual_seed(5)
    model = Eagle3Drafter(small_config()).eval()
    a = random_doc(12, gen)
    p = 8
    changed = {"ids": a["ids"].clone(), "aux": a["aux"]}
    changed["ids"][p] = (changed["ids"][p] + 1) % V
    before, after = run(model, [a], 3), run(model, [changed], 3)
    for s in range(3):
        torch.testing.assert_close(before[s][0, : p - s], after[s][0, : p - s])
        assert not torch.allclose(before[s][0, p - s], after[s][0, p - s]), s


def test_ttt_attention_equals_dense_unrolled_attention():
    """The diagonal-cache shortcut equals attention over all steps' keys with an explicit mask:
    step-0 keys block-causal, each later step's key only at the query's own position."""
    torch.manual_seed(0)
    cfg = small_config()
    attn = Eagle3Drafter(cfg).midlayer.self_attn.eval()
    t, steps = 8, 3
    doc = torch.tensor([0, 0, 0, 1, 1, 1, 1, 1])
    pos = torch.tensor([[0, 1, 2, 0, 1, 2, 3, 4]])
    allowed = block_causal_mask(doc)
    xs = [torch.randn(1, t, 2 * H) for _ in range(steps)]
    cache: list = []
    with torch.no_grad():
        for s in range(steps):
            cos, sin = rope_cos_sin(pos + s, cfg.head_dim, cfg.rope_theta)
            fast = attn(xs[s], cos, sin, allowed, cache)

            # Reference: recompute every step's q/k/v and attend over the concatenation.
            qs, ks, vs = [], [], []
            for j in range(s + 1):
                c, si = rope_cos_sin(pos + j, cfg.head_dim, cfg.rope_theta)
                q = attn.q_proj(xs[j]).view(1, t, 4, 8).transpose(1, 2)
                k = attn.k_proj(xs[j]).view(1, t, 2, 8).transpose(1, 2)
                v = attn.v_proj(xs[j]).view(1, t, 2, 8).transpose(1, 2)
                rot = lambda x, c=c, si=si: x * c + torch.cat([-x[..., 4:], x[..., :4]], -1) * si  # noqa: E731
                qs.append(rot(q))
                ks.append(rot(k).repeat_interleave(2, dim=1))
                vs.append(v.repeat_interleave(2, dim=1))
            keys, values = torch.cat(ks, dim=2), torch.cat(vs, dim=2)
            mask = torch.zeros(t, (s + 1) * t, dtype=torch.bool)
            mask[:, :t] = allowed
            for j in range(1, s + 1):
                mask[:, j * t : (j + 1) * t] = torch.eye(t, dtype=torch.bool)
            ref = F.scaled_dot_product_attention(qs[s], keys, values, attn_mask=mask)
            ref = attn.o_proj(ref.transpose(1, 2).reshape(1, t, -1))
            torch.testing.assert_close(fast, ref, rtol=1e-4, atol=1e-5)


def test_vocab_keeps_most_frequent_tokens_and_maps_round_trip():
    gen = torch.Generator().manual_seed(3)
    ids = torch.randint(0, V, (400,), generator=gen) % 17  # only ids < 17 occur
    mask = torch.ones_like(ids)
    counts = count_tokens([(ids, mask)], V)
    assert int(counts.sum()) == 400 and int(counts[17:].sum()) == 0
    maps = build_vocab_maps(counts, 10)
    kept = maps.draft_to_target
    # Every kept token is at least as frequent as every dropped one.
    dropped = torch.ones(V, dtype=torch.bool)
    dropped[kept] = False
    assert counts[kept].min() >= counts[dropped].max()
    assert bool((maps.d2t >= 0).all()) and bool((maps.d2t[1:] >= maps.d2t[:-1]).all())
    assert int(maps.t2d.sum()) == 10
    t2d_index = maps.target_to_draft
    assert torch.equal(t2d_index[kept], torch.arange(10))
    assert bool((t2d_index[dropped] == -1).all())


def test_count_tokens_uses_loss_positions_only():
    ids = torch.tensor([1, 1, 2, 3, 3, 3])
    mask = torch.tensor([0, 0, 1, 1, 0, 0])
    counts = count_tokens([(ids, mask)], 5)
    assert counts.tolist() == [0, 0, 1, 1, 0]
    unmasked = count_tokens([(ids, torch.zeros_like(mask))], 5)  # no loss tokens: count all
    assert unmasked.tolist() == [0, 2, 1, 3, 0]


def _fake_target_dir(path, tie: bool, sharded: bool):
    gen = torch.Generator().manual_seed(4)
    tensors = {
        "model.embed_tokens.weight": torch.randn(V, H, generator=gen),
        "model.norm.weight": torch.rand(H, generator=gen) + 0.5,
        "model.layers.0.mlp.up_proj.weight": torch.randn(4, H, generator=gen),
    }
    if not tie:
        tensors["lm_head.weight"] = torch.randn(V, H, generator=gen)
    if sharded:
        names = sorted(tensors)
        save_file({n: tensors[n] for n in names[:2]}, str(path / "a.safetensors"))
        save_file({n: tensors[n] for n in names[2:]}, str(path / "b.safetensors"))
        wm = {n: ("a.safetensors" if i < 2 else "b.safetensors") for i, n in enumerate(names)}
        (path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": wm}))
    else:
        save_file(tensors, str(path / "model.safetensors"))
    (path / "config.json").write_text(json.dumps({"hidden_size": H, "rms_norm_eps": 1e-5}))
    return tensors


@pytest.mark.parametrize("tie,sharded", [(False, False), (True, False), (False, True)])
def test_target_head_applies_final_norm_only_when_not_stored(tmp_path, tie, sharded):
    ref = _fake_target_dir(tmp_path, tie, sharded)
    got, config = load_target_tensors(tmp_path)
    head_w = ref["model.embed_tokens.weight"] if tie else ref["lm_head.weight"]
    assert torch.equal(got["head"], head_w) and torch.equal(got["norm"], ref["model.norm.weight"])
    rows = torch.tensor([0, 3, 7])
    x = torch.randn(5, H)
    pre = TargetHead(got["norm"], got["head"][rows], eps=config["rms_norm_eps"], apply_norm=True)
    post = TargetHead(got["norm"], got["head"][rows], eps=config["rms_norm_eps"], apply_norm=False)
    normed = x / torch.sqrt((x * x).mean(-1, keepdim=True) + 1e-5) * ref["model.norm.weight"]
    torch.testing.assert_close(pre(x), normed @ head_w[rows].T)
    torch.testing.assert_close(post(normed), normed @ head_w[rows].T)


def test_align_batch_shifts_each_document_separately():
    # Two documents and padding (document id -1), as the loader packs them.
    doc = torch.tensor([0, 0, 0, 1, 1, 1, 1, -1, -1])
    ids = torch.arange(10, 19)
    aux = torch.arange(9).float()[:, None].repeat(1, 6)
    batch = {
        "input_ids": ids[None],
        "hidden_states": aux[None],
        "verifier_last_hidden_states": aux[None, :, :2] + 100,
        "loss_mask": (doc >= 0).long()[None],
        "position_ids": torch.tensor([[0, 1, 2, 0, 1, 2, 3, 0, 0]]),
        "document_ids": doc[None],
    }
    view = align_batch(batch)
    expect_tok, expect_feat = [], []
    for d in (0, 1, -1):
        where = (doc == d).nonzero().flatten()
        expect_tok += where[1:].tolist()  # token of position t+1 ...
        expect_feat += where[:-1].tolist()  # ... beside the feature of position t
    assert view["input_ids"][0].tolist() == ids[expect_tok].tolist()
    assert view["aux"][0, :, 0].tolist() == [float(i) for i in expect_feat]
    assert view["verifier"][0, :, 0].tolist() == [100.0 + i for i in expect_tok]
    assert view["document_ids"].tolist() == doc[expect_tok].tolist()


def test_step_validity_never_crosses_documents_or_loss_mask():
    doc = torch.tensor([0, 0, 0, 0, 1, 1, 1, -1])
    mask = torch.tensor([1, 1, 0, 1, 1, 1, 1, 0])
    view = {"document_ids": doc, "loss_mask": mask[None]}
    valid = step_validity(view, 3)
    for s in range(3):
        for i in range(len(doc)):
            j = i + s + 1
            want = j < len(doc) and doc[j] == doc[i] and mask[j] == 1 and doc[i] >= 0
            assert bool(valid[s][i]) == bool(want), (s, i)


def test_next_token_loss_is_low_for_a_perfect_draft_and_counts_accuracy():
    maps = build_vocab_maps(torch.arange(V, 0, -1), D)  # keeps ids 0..D-1
    doc = torch.zeros(6, dtype=torch.long)
    ids = torch.tensor([[1, 2, 3, 4, 5, 6]])
    view = {"input_ids": ids, "document_ids": doc, "loss_mask": torch.ones(1, 6)}
    steps = 2
    perfect = []
    for s in range(steps):
        lg = torch.full((1, 6, D), -20.0)
        for i in range(6 - s - 1):
            lg[0, i, ids[0, i + s + 1]] = 20.0
        perfect.append(lg)
    loss, accs, counts = ttt_loss(perfect, view, maps, None, decay=0.8)
    assert loss.item() < 1e-6 and accs == [1.0, 1.0] and counts == [5, 4]
    wrong = [torch.zeros(1, 6, D) for _ in range(steps)]
    loss_u, _, _ = ttt_loss(wrong, view, maps, None, decay=0.8)
    assert loss_u.item() > 1.0


def test_soft_target_loss_is_zero_when_draft_matches_target():
    torch.manual_seed(0)
    norm_w, head_w = torch.ones(H), torch.randn(D, H)
    head = TargetHead(norm_w, head_w, eps=1e-6, apply_norm=False)
    t = 5
    verifier = torch.randn(1, t, H)
    view = {
        "input_ids": torch.zeros(1, t, dtype=torch.long),
        "document_ids": torch.zeros(t, dtype=torch.long),
        "loss_mask": torch.ones(1, t),
        "verifier": verifier,
    }
    maps = build_vocab_maps(torch.ones(V), D)
    target_logits = head(verifier[0])
    matched = [target_logits[None], torch.cat([target_logits[1:], target_logits[:1]])[None]]
    loss, accs, _ = ttt_loss(matched, view, maps, head, decay=1.0)
    assert abs(loss.item()) < 1e-5 and accs == [1.0, 1.0]
    off, _, _ = ttt_loss([torch.zeros(1, t, D)] * 2, view, maps, head, decay=1.0)
    assert off.item() > 0.1


def test_checkpoint_round_trip_and_server_key_names(tmp_path):
    cfg = small_config()
    model = Eagle3Drafter(cfg)
    maps = build_vocab_maps(torch.arange(V), D)
    model.d2t.copy_(maps.d2t)
    model.t2d.copy_(maps.t2d)
    aux = [LayerSpec(depth=d) for d in (1, 2, 3)]
    config = server_config(cfg, aux, LayerSpec(depth=4, final_norm=True), num_hidden_layers=4)
    path = save_checkpoint(tmp_path, model, config, {"step": 3})
    weights = load_file(str(path / "model.safetensors"))
    assert weights["midlayer.self_attn.q_proj.weight"].shape == (4 * 8, 2 * H)
    assert weights["fc.weight"].shape == (H, K * H)
    assert weights["lm_head.weight"].shape == (D, H)
    assert weights["d2t"].dtype == torch.int64 and weights["t2d"].dtype == torch.bool
    saved = json.loads((path / "config.json").read_text())
    assert saved["draft_vocab_size"] == D and saved["target_hidden_size"] == H
    assert saved["eagle_aux_hidden_state_layer_ids"] == [1, 2, 3]
    # id 1 first: SGLang then captures id + 1 under every target's rule
    assert saved["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [1, 0, 2]
    again, _ = load_drafter(path)
    for k, v in model.state_dict().items():
        assert torch.equal(again.state_dict()[k], v), k


def test_checkpoint_of_a_full_draft_vocabulary_has_no_vocabulary_maps(tmp_path):
    """vLLM creates draft_id_to_target_id only when the vocabularies differ and refuses a d2t
    it has no place for; the identity maps come back on load."""
    cfg = small_config(draft_vocab_size=V)
    model = Eagle3Drafter(cfg)
    aux = [LayerSpec(depth=d) for d in (1, 2, 3)]
    config = server_config(cfg, aux, LayerSpec(depth=4, final_norm=True), num_hidden_layers=4)
    path = save_checkpoint(tmp_path, model, config, {"step": 1})
    weights = load_file(str(path / "model.safetensors"))
    assert "d2t" not in weights and "t2d" not in weights
    assert "lm_head.weight" in weights
    again, _ = load_drafter(path)
    assert torch.equal(again.draft_to_target, torch.arange(V))
    assert bool(again.t2d.all())
    del weights["fc.weight"]
    save_file(weights, str(path / "model.safetensors"))
    with pytest.raises(BadInputError, match="fc.weight"):
        load_drafter(path)
