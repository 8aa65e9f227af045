"""Epoch order: which sample comes when, as a pure function of (seed, epoch).

A uniform shuffle turns a streaming read into random reads over every segment file. Instead we
shuffle *blocks* of storage-contiguous samples (a block never crosses a segment), then shuffle
samples inside windows of consecutive positions of the block-shuffled sequence. Reads stay
mostly sequential inside a segment, while the order still differs enough from epoch to epoch
for SGD. ``block_size=1`` with a window covering the dataset is a uniform shuffle.
"""

from __future__ import annotations

import numpy as np

# Mixed into every seed so the loader's random stream never coincides with a user's stream
# seeded with the same (seed, epoch).
_ORDER_TAG = 0x6873_6F72  # "hsor"


def epoch_rng(
    seed: int, epoch: int, tag: int = _ORDER_TAG, part: int | None = None
) -> np.random.Generator:
    """A generator that depends only on (seed, epoch, tag, part): same inputs, same stream,
    anywhere. ``part`` tells apart the windows of a followed dataset's first pass."""
    entropy = [tag, seed, epoch] + ([] if part is None else [part])
    return np.random.Generator(np.random.PCG64(np.random.SeedSequence(entropy)))


def storage_blocks(
    num_samples: int, block_size: int, segments: np.ndarray | None = None
) -> np.ndarray:
    """Start positions of blocks of at most ``block_size`` samples, cut at segment changes.

    Returns ``starts`` with ``starts[0] == 0``; block b is ``[starts[b], starts[b+1])`` (the
    last one ends at ``num_samples``).
    """
    if block_size < 1:
        raise ValueError(f"block_size must be >= 1, got {block_size}")
    if num_samples == 0:
        return np.zeros(0, dtype=np.int64)
    if segments is None:
        run_starts = np.array([0], dtype=np.int64)
    else:
        seg = np.asarray(segments)
        if len(seg) != num_samples:
            raise ValueError(f"segments has {len(seg)} entries for {num_samples} samples")
        run_starts = np.concatenate([[0], np.flatnonzero(seg[1:] != seg[:-1]) + 1])
    run_ends = np.concatenate([run_starts[1:], [num_samples]])
    starts = [np.arange(s, e, block_size, dtype=np.int64) for s, e in zip(run_starts, run_ends)]
    return np.concatenate(starts)


def epoch_order(
    num_samples: int,
    *,
    seed: int,
    epoch: int,
    shuffle: bool = True,
    block_size: int = 64,
    window: int = 1024,
    segments: np.ndarray | None = None,
    part: int | None = None,
) -> np.ndarray:
    """The storage positions of all samples, in the order epoch ``epoch`` visits them.

    ``segments`` (the index's segment column, storage order) keeps blocks inside one segment.
    ``shuffle=False`` returns storage order. The result is a permutation of
    ``range(num_samples)`` (int64). ``part``: a separate stream of the same epoch (one per
    window of a followed dataset).
    """
    if not shuffle or num_samples <= 1:
        return np.arange(num_samples, dtype=np.int64)
    if window < 1:
        raise ValueError(f"window must be >= 1, got {window}")
    rng = epoch_rng(seed, epoch, part=part)
    starts = storage_blocks(num_samples, block_size, segments)
    sizes = np.diff(np.concatenate([starts, [num_samples]]))
    perm = rng.permutation(len(starts))
    # Concatenate the blocks in permuted order without a Python loop over samples.
    new_sizes = sizes[perm]
    new_starts = np.concatenate([[0], np.cumsum(new_sizes)[:-1]])
    offsets_in_block = np.arange(num_samples, dtype=np.int64) - np.repeat(new_starts, new_sizes)
    order = np.repeat(starts[perm], new_sizes) + offsets_in_block
    if window > 1:
        win_id = np.arange(num_samples, dtype=np.int64) // window
        keys = rng.random(num_samples)
        order = order[np.lexsort((keys, win_id))]
    return order.astype(np.int64, copy=False)
