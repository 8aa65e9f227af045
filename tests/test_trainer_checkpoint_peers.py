"""The trainer's checkpoint loaded by speculators 0.9's own EAGLE-3 model class.

The checkpoint's weights go into ``speculators.models.eagle3.Eagle3DraftModel`` (its names use
``layers.0.`` where SGLang and vLLM read ``midlayer.``), every parameter of the class filled and
no tensor left over; then both models draft from the same features, and the draft tokens of
each step agree: the class reads the weights as the trainer meant them.
"""

from __future__ import annotations

import json

import pytest
import torch
from peer_packages import peer
from safetensors.torch import load_file

from hsstore import LayerSpec
from hsstore.trainers.eagle3.checkpoint import save_checkpoint, server_config
from hsstore.trainers.eagle3.model import DrafterConfig, Eagle3Drafter
from hsstore.trainers.eagle3.vocab import build_vocab_maps

H, V, HEADS, HEAD_DIM = 64, 96, 4, 16
# filled from the verifier model when speculators trains; the checkpoint does not carry them
VERIFIER_ONLY = {"verifier_norm.weight", "verifier_lm_head.weight"}


def speculators_model(config: dict):
    """Eagle3DraftModel configured from the checkpoint's config.json (the keys the trainer
    writes for speculators: see docs/TRAINER.md)."""
    from transformers import LlamaConfig

    eagle3 = peer("speculators.models.eagle3")
    speculators = peer("speculators")
    layer = LlamaConfig(
        hidden_size=config["hidden_size"],
        intermediate_size=config["intermediate_size"],
        num_attention_heads=config["num_attention_heads"],
        num_key_value_heads=config["num_key_value_heads"],
        head_dim=config["head_dim"],
        num_hidden_layers=1,
        rms_norm_eps=config["rms_norm_eps"],
        rope_theta=config["rope_theta"],
        max_position_embeddings=config["max_position_embeddings"],
        vocab_size=config["vocab_size"],
        attn_implementation="eager",
    )
    spec = eagle3.Eagle3SpeculatorConfig(
        transformer_layer_config=layer,
        draft_vocab_size=config["draft_vocab_size"],
        norm_before_residual=config["norm_before_residual"],
        target_hidden_size=config["target_hidden_size"],
        eagle_aux_hidden_state_layer_ids=config["eagle_aux_hidden_state_layer_ids"],
        speculators_config=speculators.SpeculatorsConfig(
            algorithm="eagle3",
            proposal_methods=[speculators.proposals.greedy.GreedyTokenProposalConfig()],
            default_proposal_method="greedy",
            verifier=speculators.VerifierConfig(name_or_path=None, architectures=["Llama"]),
        ),
    )
    return eagle3.Eagle3DraftModel(spec)


@pytest.mark.parametrize("draft_vocab", [V, 48])
def test_speculators_model_class_loads_the_checkpoint_and_drafts_the_same(tmp_path, draft_vocab):
    torch.manual_seed(0)
    cfg = DrafterConfig(
        hidden_size=H, num_aux_layers=2, vocab_size=V, draft_vocab_size=draft_vocab,
        num_attention_heads=HEADS, num_key_value_heads=2, head_dim=HEAD_DIM,
        intermediate_size=128, target_hidden_size=H, rms_norm_eps=1e-5,
    )  # fmt: skip
    ours = Eagle3Drafter(cfg).eval()
    maps = build_vocab_maps(torch.arange(V) % 7, draft_vocab)
    ours.d2t.copy_(maps.d2t)
    ours.t2d.copy_(maps.t2d)
    aux = [LayerSpec(depth=1), LayerSpec(depth=2)]
    config = server_config(cfg, aux, LayerSpec(depth=4), num_hidden_layers=4)
    path = save_checkpoint(tmp_path, ours, config, {"step": 1})

    theirs = speculators_model(json.loads((path / "config.json").read_text())).eval()
    weights = {k.replace("midlayer.", "layers.0."): v for k, v in load_file(path / "model.safetensors").items()}  # fmt: skip
    missing, unexpected = theirs.load_state_dict(weights, strict=False)
    assert not unexpected, unexpected
    expected_missing = VERIFIER_ONLY | ({"d2t", "t2d"} if draft_vocab == V else set())
    assert set(missing) <= expected_missing, missing
    for name, value in weights.items():  # every tensor landed where its shape fits
        assert torch.equal(theirs.state_dict()[name], value), name

    t = 24
    ids = torch.randint(0, V, (1, t))
    feats = torch.randn(1, t, 2 * H)
    pos = torch.arange(t)[None]
    doc = torch.zeros(t, dtype=torch.long)
    with torch.no_grad():
        our_logits = ours(ids, feats, pos, doc, steps=3)
        their_drafts = theirs(feats, ids, doc[None], position_ids=pos, ttt_steps=3)
    for step, (lg, drafted) in enumerate(zip(our_logits, their_drafts, strict=True)):
        n = t - step  # positions whose step-s input is a real token in both models
        agree = (lg[0].argmax(-1)[:n] == drafted[0, :n]).float().mean().item()
        assert agree == 1.0, (step, agree)
