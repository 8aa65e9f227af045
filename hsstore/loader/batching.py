"""Which samples share a batch: token-budget packing and fixed-size padded batches.

Planning needs only the token count of every sample (the index has it), so the whole epoch's
batch list is known before a byte of hidden state is read. That is what makes sharding exact
and resumption free (skip k batches = start at plan entry k, nothing to decode).

Over-long samples (more tokens than ``max_tokens``):

* ``"truncate"`` (default, like speculators' collate): the first ``max_tokens`` tokens are
  kept and the sample forms a batch on its own;
* ``"skip"``: the sample is left out of the plan (so of the epoch, on every rank alike);
* ``"error"``: planning raises :class:`~hsstore.errors.BadInputError`.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import numpy as np

from hsstore.errors import BadInputError

OVER_LONG_POLICIES = ("truncate", "skip", "error")

# Yielded by a batch schedule that cannot go on without waiting for the dataset to grow (a
# following loader's first pass): the fetcher then finishes the batch it holds instead of
# sitting on it while it waits (see fetch.BatchFetcher).
WAIT = object()


@dataclass(frozen=True)
class BatchPlan:
    """A list of batches stored flat: batch b holds ``samples[offsets[b]:offsets[b+1]]``.

    ``tokens`` holds the number of tokens each entry contributes (after truncation).
    """

    samples: np.ndarray  # int64 storage positions
    tokens: np.ndarray  # int64, same length as samples
    offsets: np.ndarray  # int64, len(batches) + 1

    def __len__(self) -> int:
        return len(self.offsets) - 1

    def batch(self, b: int) -> tuple[np.ndarray, np.ndarray]:
        """(sample positions, token counts) of batch ``b``."""
        lo, hi = int(self.offsets[b]), int(self.offsets[b + 1])
        return self.samples[lo:hi], self.tokens[lo:hi]

    def __iter__(self) -> Iterator[tuple[np.ndarray, np.ndarray]]:
        for b in range(len(self)):
            yield self.batch(b)

    def select(self, batch_ids: Sequence[int] | np.ndarray) -> BatchPlan:
        """The sub-plan made of the given batches, in the given order."""
        ids = np.asarray(batch_ids, dtype=np.int64)
        if len(ids) == 0:
            return _from_lists([], [])
        starts, ends = self.offsets[ids], self.offsets[ids + 1]
        sizes = ends - starts
        take = np.repeat(starts, sizes) + (
            np.arange(int(sizes.sum())) - np.repeat(np.cumsum(sizes) - sizes, sizes)
        )
        return BatchPlan(
            samples=self.samples[take],
            tokens=self.tokens[take],
            offsets=np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64),
        )


def _from_lists(batches: list[list[int]], tokens: list[list[int]]) -> BatchPlan:
    sizes = np.array([len(b) for b in batches], dtype=np.int64)
    flat = [s for b in batches for s in b]
    flat_t = [t for b in tokens for t in b]
    return BatchPlan(
        samples=np.array(flat, dtype=np.int64),
        tokens=np.array(flat_t, dtype=np.int64),
        offsets=np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64),
    )


def _apply_over_long(
    order: np.ndarray, num_tokens: np.ndarray, max_tokens: int, over_long: str
) -> tuple[np.ndarray, np.ndarray]:
    """(order, tokens taken per visited sample) after the over-long policy."""
    if over_long not in OVER_LONG_POLICIES:
        raise ValueError(f"over_long must be one of {OVER_LONG_POLICIES}, got {over_long!r}")
    if max_tokens < 1:
        raise ValueError(f"max_tokens must be >= 1, got {max_tokens}")
    order = np.asarray(order, dtype=np.int64)
    lengths = np.asarray(num_tokens, dtype=np.int64)[order]
    long = lengths > max_tokens
    if long.any():
        if over_long == "error":
            first = int(order[np.flatnonzero(long)[0]])
            raise BadInputError(
                f"sample at position {first} has {int(lengths[long][0])} tokens, more than "
                f"max_tokens={max_tokens} (over_long='error')"
            )
        if over_long == "skip":
            order, lengths = order[~long], lengths[~long]
        else:
            lengths = np.minimum(lengths, max_tokens)
    return order, lengths


def plan_packed(
    order: np.ndarray,
    num_tokens: np.ndarray,
    max_tokens: int,
    *,
    open_bins: int = 4,
    over_long: str = "truncate",
) -> BatchPlan:
    """Pack samples, visited in ``order``, into batches of at most ``max_tokens`` tokens.

    First fit over at most ``open_bins`` open batches: a sample goes to the oldest open batch
    it fits in, else opens a new one; a full batch, or the oldest when too many are open, is
    closed. ``open_bins=1`` keeps the visiting order exactly; a few more fill batches much
    better while only reordering samples locally. A sample is never split.
    ``num_tokens`` is indexed by storage position.
    """
    if open_bins < 1:
        raise ValueError(f"open_bins must be >= 1, got {open_bins}")
    order, lengths = _apply_over_long(order, num_tokens, max_tokens, over_long)
    closed: list[list[int]] = []
    closed_tok: list[list[int]] = []
    bins: list[list[int]] = []
    bins_tok: list[list[int]] = []
    room: list[int] = []
    for pos, n in zip(order.tolist(), lengths.tolist()):
        for k in range(len(bins)):
            if room[k] >= n:
                break
        else:
            k = len(bins)
            bins.append([])
            bins_tok.append([])
            room.append(max_tokens)
        bins[k].append(pos)
        bins_tok[k].append(n)
        room[k] -= n
        if len(bins) > open_bins:  # oldest first: keeps the visiting order when open_bins=1
            closed.append(bins.pop(0))
            closed_tok.append(bins_tok.pop(0))
            room.pop(0)
            k -= 1
        if room[k] == 0:
            closed.append(bins.pop(k))
            closed_tok.append(bins_tok.pop(k))
            room.pop(k)
    closed.extend(bins)
    closed_tok.extend(bins_tok)
    return _from_lists(closed, closed_tok)


def plan_padded(
    order: np.ndarray,
    num_tokens: np.ndarray,
    batch_size: int,
    max_tokens: int,
    *,
    over_long: str = "truncate",
) -> BatchPlan:
    """Consecutive groups of ``batch_size`` samples (the last may be smaller)."""
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    order, lengths = _apply_over_long(order, num_tokens, max_tokens, over_long)
    n = len(order)
    offsets = np.concatenate([np.arange(0, n, batch_size), [n]]).astype(np.int64)
    if n == 0:
        offsets = np.zeros(1, dtype=np.int64)
    return BatchPlan(samples=order, tokens=lengths, offsets=offsets)


def padded_length(tokens: np.ndarray, multiple: int, max_tokens: int) -> int:
    """Sequence length of a padded batch: its longest sample, rounded up, capped."""
    longest = int(tokens.max()) if len(tokens) else 0
    rounded = -(-longest // multiple) * multiple if multiple > 1 else longest
    return max(1, min(rounded, max_tokens))
