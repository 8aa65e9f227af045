"""The acceptance a drafter will get when served, predicted offline by replaying the engine.

A serving engine (vLLM, SGLang) runs EAGLE-3 as a walk along each sequence: at the last verified
position it drafts k tokens, the first from the target's features and the token just emitted,
each later one from the drafter's own hidden state and its own previous draft token; the target
accepts the longest prefix of drafts equal to its greedy tokens, emits one token more, and the
next draft starts after them. The engine's counters are per draft position p: the number of
drafts whose first p + 1 tokens were all accepted, divided by the number of drafts.

:func:`predict_acceptance` replays that walk on stored sequences with the drafter exactly as
the engine runs it (draft tokens fed back for steps >= 2) and counts the same quantities, so its
figures are the engine's when the sequences are the target's own greedy continuations (the
tokens an engine serving greedily would see). On other text (the dataset's responses where the
target would have said something else) they are an estimate: the walk still compares each draft
with the target's greedy token at that point, but the prefix is the dataset's.

Training's per-step accuracy is not this: it scores every position, each step on its own
(teacher-forced, whatever the earlier steps drafted), on the batches being trained on.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from hsstore.trainers.eagle3.batches import align_batch, step_validity
from hsstore.trainers.eagle3.model import Eagle3Drafter, TargetHead


@dataclass
class AcceptanceCounts:
    """What an engine's spec-decode counters hold: drafts, and accepted drafts per position."""

    k: int
    drafts: int = 0
    accepted_per_pos: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        if not self.accepted_per_pos:
            self.accepted_per_pos = [0] * self.k

    def add(self, accepted: int) -> None:
        self.drafts += 1
        for p in range(accepted):
            self.accepted_per_pos[p] += 1

    @property
    def rates(self) -> list[float]:
        """Per draft position: the fraction of drafts accepted up to and including it."""
        return [a / self.drafts if self.drafts else float("nan") for a in self.accepted_per_pos]

    @property
    def mean_accepted_length(self) -> float:
        """Tokens emitted per target forward: 1 + accepted drafts per draft (vLLM's figure)."""
        if not self.drafts:
            return float("nan")
        return 1.0 + sum(self.accepted_per_pos) / self.drafts

    def to_json(self) -> dict:
        return {
            "k": self.k,
            "drafts": self.drafts,
            "accepted_per_pos": list(self.accepted_per_pos),
            "accept_rate_per_pos": self.rates,
            "mean_accepted_length": self.mean_accepted_length,
        }


def greedy_targets(view: dict, head: TargetHead | None) -> torch.Tensor:
    """[T] target token ids: at aligned position i, the target's greedy choice for the token
    after ``input_ids[i]`` (argmax of ``head``, which must span the whole vocabulary, on the
    stored last state), or without a head the dataset's next token; -1 past the end."""
    if head is not None:
        return head(view["verifier"][0]).argmax(-1)
    ids = view["input_ids"][0]
    return torch.cat([ids[1:], ids.new_full((1,), -1)])


@torch.no_grad()
def draft_chains(model: Eagle3Drafter, view: dict, k: int) -> torch.Tensor:
    """[T, k] target ids the drafter proposes from each aligned position, run as the engine
    runs it: step 0 on the target's features and the stored token, steps >= 1 on the drafter's
    own hidden state and its own previous draft."""
    aux = view["aux"].to(next(model.parameters()).dtype)
    logits = model(
        view["input_ids"], aux, view["position_ids"], view["document_ids"], k, feed_drafts=True
    )
    to_target = model.draft_to_target
    return torch.stack([to_target[lg[0].argmax(-1)] for lg in logits], dim=1)


def walk(
    drafts: torch.Tensor,  # [T, k] target ids
    targets: torch.Tensor,  # [T] greedy target ids
    valid: list[torch.Tensor],  # per step [T] bool: the drafted token is a loss token
    starts: torch.Tensor,  # [T] bool: first aligned position of each response span
    counts: AcceptanceCounts,
    max_new_tokens: int | None = None,
) -> None:
    """Replay the engine's walk over one aligned batch and add its drafts to ``counts``.

    A span starts where the target emits its first response token (by prefill, no draft); from
    there each draft of k tokens is scored against the target's greedy tokens, the walk advancing
    by the accepted count + 1. A draft whose k tokens do not all lie inside the span ends the
    span's walk (an engine would be drafting past the data). ``max_new_tokens`` stops a span as
    an engine's request stops, once that many tokens were emitted.
    """
    k = counts.k
    hits = torch.stack(
        [drafts[:, s] == torch.cat([targets[s:], targets.new_full((s,), -1)]) for s in range(k)],
        dim=1,
    ).tolist()
    ok = torch.stack(valid[:k], dim=1).all(dim=1).tolist()
    t = len(ok)
    for i0 in starts.nonzero().flatten().tolist():
        i, emitted = i0, 1
        while i < t and ok[i] and (max_new_tokens is None or emitted < max_new_tokens):
            accepted = 0
            while accepted < k and hits[i][accepted]:
                accepted += 1
            counts.add(accepted)
            emitted += accepted + 1
            i += accepted + 1


def span_starts(view: dict) -> torch.Tensor:
    """[T] bool: aligned positions whose token is the first loss token of a run of them."""
    mask = view["loss_mask"][0].bool()
    doc = view["document_ids"]
    prev_mask = torch.cat([mask.new_zeros(1), mask[:-1]])
    new_doc = torch.cat([doc.new_ones(1, dtype=torch.bool), doc[1:] != doc[:-1]])
    return mask & (~prev_mask | new_doc)


def predict_acceptance(
    model: Eagle3Drafter,
    data,
    *,
    aux_layers: list[int],
    head: TargetHead | None,
    k: int,
    max_samples: int | None = None,
    max_tokens: int = 4096,
    device: torch.device | str = "cpu",
    max_new_tokens: int | None = None,
    skip_damaged: bool = False,
) -> AcceptanceCounts:
    """Replay the engine's walk (see the module docstring) over the samples of ``data``.

    ``data`` is a dataset path or URL with the layers the drafter was trained on (stored
    positions ``aux_layers``, and the last state when ``head`` is given: a full-vocabulary
    :class:`TargetHead`); read in stored order, the first ``max_samples`` (or more, to the end
    of a packed batch) or all of them. ``skip_damaged``: the loader's, a damaged sample's
    loss mask is zero, so it drafts nothing.
    """
    from hsstore.loader import Loader

    loader = Loader(
        data,
        max_tokens=max_tokens,
        shuffle=False,
        aux_layers=aux_layers,
        verifier=head is not None,
        rank=0,
        world_size=1,
        prefetch=1,
        num_threads=2,
        skip_damaged=skip_damaged,
    )
    counts = AcceptanceCounts(k)
    was_training = model.training
    model.eval()
    seen = 0
    try:
        for batch in loader:
            view = align_batch({key: v.to(device) for key, v in batch.items()})
            view["aux"] = view["aux"].float()
            walk(
                draft_chains(model, view, k).cpu(),
                greedy_targets(view, head).cpu(),
                [v.cpu() for v in step_validity(view, k)],
                span_starts(view).cpu(),
                counts,
                max_new_tokens,
            )
            seen += int(batch["lengths"].numel())
            if max_samples and seen >= max_samples:
                break
    finally:
        loader.close()
        model.train(was_training)
    return counts


def predict_for_run(args, model, aux_pos, target_tensors, train_head, device) -> dict:
    """A training run's prediction: the acceptance an engine serving its drafter greedily
    should count, on ``--eval-data`` (else the training data), printed and returned for the
    run's summary."""
    head = None
    if train_head is not None:  # the target's greedy token: its argmax over the whole vocabulary
        norm = target_tensors["norm"]
        head = TargetHead(norm, target_tensors["head"], train_head.eps, train_head.apply_norm)
        head = head.to(device)
    data = args.eval_data or args.data
    k = args.eval_draft_tokens or args.ttt_steps
    counts = predict_acceptance(
        model, data, aux_layers=aux_pos, head=head, k=k, max_samples=args.eval_samples,
        max_tokens=args.max_tokens, device=device, skip_damaged=args.skip_damaged,
    )  # fmt: skip
    rates = " ".join(f"{r:.3f}" for r in counts.rates)
    where = "held-out" if args.eval_data else "training"
    print(
        f"predicted acceptance ({counts.drafts} drafts of {k} on {where} samples of {data}): "
        f"per position {rates} | mean accepted length {counts.mean_accepted_length:.2f}",
        flush=True,
    )
    return {**counts.to_json(), "data": str(data), "held_out": bool(args.eval_data)}
