"""One pass over the samples inspect reads, feeding every statistic the checks need.

Reading is the expensive part of an audit, so each sample is decoded once and all
accumulators (per-layer moments, layer-pair distances, token-id facts, row reservoirs for the
norm and lm-head checks) are updated from it before it is dropped.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from typing import Any

import crc32c
import torch

from hsstore.audit.layer_stats import LayerAccumulator, PairAccumulator
from hsstore.audit.sampling import RowReservoir
from hsstore.segment.stats import StatsAccumulator

SHIFTS = (-1, 0, 1)  # token shifts the lm-head check compares (0 = the declared alignment)


@dataclass
class SampleRecord:
    """What one read taught us about one sample (or why it could not be read)."""

    index: int
    sample_id: str
    expected_tokens: int | None = None  # what the index says, when there is one
    num_ids: int | None = None
    num_mask: int | None = None
    num_rows: int | None = None
    loss_tokens: int | None = None
    min_id: int | None = None
    max_id: int | None = None
    ids_hash: str | None = None
    states_hash: str | None = None
    error: str | None = None

    @property
    def lengths_agree(self) -> bool:
        n = {self.num_ids, self.num_mask, self.num_rows}
        if self.expected_tokens is not None:
            n.add(self.expected_tokens)
        return len(n) == 1


@dataclass
class Collected:
    """Everything the checks consume, after the read pass."""

    records: list[SampleRecord]
    layer_summaries: list[dict[str, Any]]
    pairs: list[dict[str, Any]]
    fit_rows: dict[int, torch.Tensor]  # final-layer index -> [R, H] float32 rows
    lm_rows: torch.Tensor | None  # [M, F, H] rows of the final layers at loss positions
    lm_targets: torch.Tensor | None  # [M, len(SHIFTS)] next-token ids per shift (-1 = none)
    final_layers: list[int]
    tokens_read: int = 0
    extra: dict[str, Any] = field(default_factory=dict)


def _digest(t: torch.Tensor) -> str:
    raw = t.detach().contiguous().reshape(-1).view(torch.uint8).numpy()
    return hashlib.blake2b(memoryview(raw), digest_size=16).hexdigest()


def _fast_digest(t: torch.Tensor) -> str:
    """crc32c + shape of a large tensor: hardware-fast, and collisions among the few thousand
    samples one audit reads are negligible (the ids of every sample use blake2b)."""
    raw = t.detach().contiguous().reshape(-1).view(torch.uint8).numpy()
    return f"{crc32c.crc32c(memoryview(raw)):08x}-{'x'.join(map(str, t.shape))}"


class Collector:
    """Accumulates statistics sample by sample; ``finish`` hands them to the checks."""

    def __init__(
        self,
        *,
        num_layers: int,
        hidden_size: int,
        final_layers: list[int],
        seed: int,
        lm_tokens: int,
        fit_rows: int,
        percentile_rows: int = 256,
    ):
        self.num_layers = num_layers
        self.final_layers = final_layers
        # The writer's accumulator, on every row of what is read (not every 8th).
        self.totals = StatsAccumulator(num_layers, "float32", sample_every=1)
        self.layers = [LayerAccumulator() for _ in range(num_layers)]
        self.pairs = PairAccumulator(num_layers)
        self.records: list[SampleRecord] = []
        self.tokens_read = 0
        self._pct = RowReservoir(percentile_rows, seed + 1)
        self._fit = {i: RowReservoir(fit_rows, seed + 2 + i) for i in final_layers}
        self._lm = RowReservoir(lm_tokens if final_layers else 0, seed + 100)
        self.hidden_size = hidden_size

    def add_error(self, index: int, sample_id: str, message: str, expected: int | None) -> None:
        self.records.append(SampleRecord(index, sample_id, expected_tokens=expected, error=message))

    def add(
        self,
        index: int,
        sample_id: str,
        input_ids: torch.Tensor,
        loss_mask: torch.Tensor,
        hidden: torch.Tensor,
        expected: int | None,
    ) -> SampleRecord:
        """Feed one sample: ``hidden`` is [T, L, H] in the stored dtype."""
        rec = SampleRecord(
            index,
            sample_id,
            expected_tokens=expected,
            num_ids=int(input_ids.shape[0]),
            num_mask=int(loss_mask.shape[0]),
            num_rows=int(hidden.shape[0]),
            loss_tokens=int((loss_mask != 0).sum()),
            min_id=int(input_ids.min()) if input_ids.numel() else None,
            max_id=int(input_ids.max()) if input_ids.numel() else None,
            ids_hash=_digest(input_ids.to(torch.int64)),
            states_hash=_fast_digest(hidden),
        )
        self.records.append(rec)
        self.tokens_read += rec.num_rows or 0
        values = hidden.float()
        self.totals.update(values.numpy())
        for i, acc in enumerate(self.layers):
            acc.update(values[:, i])
        self.pairs.update(hidden)
        self._pct.add(rows=hidden)
        for i, res in self._fit.items():
            res.add(rows=hidden[:, i])
        if self._lm.capacity and rec.lengths_agree:
            self._add_lm(input_ids.to(torch.int64), loss_mask, hidden)
        return rec

    def _add_lm(self, ids: torch.Tensor, mask: torch.Tensor, hidden: torch.Tensor) -> None:
        """Keep final-layer rows at positions whose next token is a loss token.

        The state at t has seen tokens 0..t, so under the declared alignment it predicts
        ids[t + 1]; the other shifts are what an off-by-one would make it predict.
        """
        t_len = ids.shape[0]
        pos = torch.nonzero(mask[1:] != 0).flatten()  # t with loss_mask[t + 1] == 1
        if pos.numel() == 0:
            return
        targets = torch.full((pos.numel(), len(SHIFTS)), -1, dtype=torch.int64)
        for k, s in enumerate(SHIFTS):
            j = pos + 1 + s
            ok = (j >= 0) & (j < t_len)
            targets[ok, k] = ids[j[ok]]
        rows = hidden[pos][:, self.final_layers]
        self._lm.add(rows=rows, targets=targets)

    def finish(self) -> Collected:
        pct_rows = self._pct.get("rows")
        summaries = []
        for i, (acc, totals) in enumerate(zip(self.layers, self.totals.layers, strict=True)):
            sample = pct_rows[:, i].float() if pct_rows is not None else None
            summaries.append(acc.summary(totals, sample))
        fit = {}
        for i, res in self._fit.items():
            rows = res.get("rows")
            fit[i] = rows.float() if rows is not None else torch.empty(0, self.hidden_size)
        lm_rows = self._lm.get("rows")
        return Collected(
            records=self.records,
            layer_summaries=summaries,
            pairs=self.pairs.pairs(pct_rows),
            fit_rows=fit,
            lm_rows=lm_rows.float() if lm_rows is not None else None,
            lm_targets=self._lm.get("targets"),
            final_layers=self.final_layers,
            tokens_read=self.tokens_read,
        )
