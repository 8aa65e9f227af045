"""The acceptance prediction (hsstore/trainers/eagle3/acceptance.py): the engine's walk and
counters, and the drafter run as an engine runs it (its own drafts fed back)."""

from __future__ import annotations

import torch

from hsstore.trainers.eagle3.acceptance import AcceptanceCounts, span_starts, walk
from hsstore.trainers.eagle3.model import DrafterConfig, Eagle3Drafter

H, V, K = 32, 40, 2


def test_walk_counts_drafts_and_accepted_positions_as_an_engine_does():
    """One response span of 13 positions, k = 3. The engine drafts at 0 (2 accepted), jumps to
    3 (3 accepted), to 7 (none), to 8 (1 accepted), to 10, whose third token lies past the span:
    no draft is counted there."""
    t, k = 13, 3
    targets = torch.arange(100, 100 + t)
    drafts = torch.full((t, k), -5)
    for i in range(t):  # drafts[i, s] is the guess for targets[i + s]
        for s in range(k):
            if i + s < t:
                drafts[i, s] = targets[i + s]
    drafts[0, 2] = 0  # start 0: accepts 2
    drafts[7, 0] = 0  # start 7: accepts 0 (the later guesses do not count after a miss)
    drafts[8, 1] = 0  # start 8: accepts 1
    valid = [torch.arange(t) + s < t - 1 for s in range(k)]  # the last position has no target
    starts = torch.zeros(t, dtype=torch.bool)
    starts[0] = True
    counts = AcceptanceCounts(k)
    walk(drafts, targets, valid, starts, counts)
    assert counts.drafts == 4
    assert counts.accepted_per_pos == [3, 2, 1]  # accepted 2, 3, 0, 1
    assert counts.rates == [0.75, 0.5, 0.25]
    assert counts.mean_accepted_length == 1 + 6 / 4
    limited = AcceptanceCounts(k)
    walk(drafts, targets, valid, starts, limited, max_new_tokens=5)  # 1 + 3 emitted, then 4 more
    assert limited.drafts == 2 and limited.accepted_per_pos == [2, 2, 1]


def test_span_starts_mark_the_first_response_token_of_each_document():
    view = {
        "loss_mask": torch.tensor([[0, 0, 1, 1, 0, 1, 1, 1, 1]]),
        "document_ids": torch.tensor([0, 0, 0, 0, 0, 0, 1, 1, 1]),
    }
    assert span_starts(view).nonzero().flatten().tolist() == [2, 5, 6]


def test_fed_back_drafts_are_what_the_teacher_forced_drafter_sees_on_those_tokens():
    """Steps >= 1 read the drafter's own previous draft. Appending those drafts to the sequence
    and teacher-forcing must give the same logits at the last real position: its step s then
    reads the appended token s, and the appended positions are invisible to it."""
    torch.manual_seed(0)
    cfg = DrafterConfig(
        hidden_size=H, num_aux_layers=K, vocab_size=V, draft_vocab_size=24,
        num_attention_heads=4, num_key_value_heads=2, head_dim=8, intermediate_size=64,
    )  # fmt: skip
    model = Eagle3Drafter(cfg).eval()
    model.d2t.copy_(torch.arange(24) // 2)  # draft id d is target id d + d // 2
    t, steps = 10, 3
    ids = torch.randint(0, V, (1, t))
    aux = torch.randn(1, t + steps, K * H)
    doc = torch.zeros(t + steps, dtype=torch.long)
    pos = torch.arange(t + steps)[None]
    with torch.no_grad():
        fed = model(ids, aux[:, :t], pos[:, :t], doc[:t], steps, feed_drafts=True)
        drafts = [int(model.draft_to_target[lg[0, -1].argmax()]) for lg in fed]
        extended = torch.cat([ids, torch.tensor([drafts])], dim=1)
        forced = model(extended, aux, pos, doc, steps)
    assert any(d != int(ids[0, -1]) for d in drafts)
    for s in range(steps):
        torch.testing.assert_close(fed[s][0, t - 1], forced[s][0, t - 1])
    # and without feeding back, step 1 at the last position reads a padding token instead
    plain = model(ids, aux[:, :t], pos[:, :t], doc[:t], steps)
    assert not torch.allclose(plain[1][0, t - 1], fed[1][0, t - 1])
