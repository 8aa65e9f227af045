"""Pure planning functions of the loader: order, packing, sharding (no dataset needed)."""

from __future__ import annotations

import numpy as np
import pytest

from hsstore.errors import BadInputError
from hsstore.loader.batching import plan_packed, plan_padded
from hsstore.loader.options import LoaderOptions
from hsstore.loader.order import epoch_order, storage_blocks
from hsstore.loader.partition import rank_batches, worker_steps
from hsstore.loader.plan import global_plan, rank_plan

RNG = np.random.default_rng(1234)
N = 500
LENGTHS = RNG.integers(1, 300, size=N)
LENGTHS[[7, 100, 333]] = [900, 1500, 513]  # over-long for max_tokens=512
SEGMENTS = np.repeat(np.arange(5), [90, 110, 100, 150, 50])


def test_order_is_a_permutation_and_reproducible():
    a = epoch_order(N, seed=3, epoch=2, segments=SEGMENTS)
    b = epoch_order(N, seed=3, epoch=2, segments=SEGMENTS)
    assert np.array_equal(a, b)
    assert np.array_equal(np.sort(a), np.arange(N))


def test_no_shuffle_is_storage_order():
    assert np.array_equal(epoch_order(N, seed=3, epoch=5, shuffle=False), np.arange(N))


def test_seeds_and_epochs_give_different_orders():
    base = epoch_order(N, seed=0, epoch=0, segments=SEGMENTS)
    assert not np.array_equal(base, epoch_order(N, seed=1, epoch=0, segments=SEGMENTS))
    assert not np.array_equal(base, epoch_order(N, seed=0, epoch=1, segments=SEGMENTS))


def test_blocks_stay_storage_contiguous_and_inside_segments():
    starts = storage_blocks(N, 16, SEGMENTS)
    ends = np.concatenate([starts[1:], [N]])
    assert np.all(ends - starts <= 16)
    for s, e in zip(starts, ends):
        assert len(set(SEGMENTS[s:e])) == 1
    # window=1: no within-window shuffle, so the order is made of whole blocks.
    order = epoch_order(N, seed=9, epoch=0, block_size=16, window=1, segments=SEGMENTS)
    pos = 0
    block_of = {int(s): int(e) for s, e in zip(starts, ends)}
    while pos < N:
        s = int(order[pos])
        e = block_of[s]
        assert np.array_equal(order[pos : pos + e - s], np.arange(s, e))
        pos += e - s


def test_window_shuffle_only_moves_samples_inside_their_window():
    blocks_only = epoch_order(N, seed=4, epoch=1, block_size=8, window=1)
    windowed = epoch_order(N, seed=4, epoch=1, block_size=8, window=50)
    assert not np.array_equal(blocks_only, windowed)
    for w in range(0, N, 50):
        assert set(blocks_only[w : w + 50]) == set(windowed[w : w + 50])


@pytest.mark.parametrize("open_bins", [1, 4])
def test_packing_respects_budget_and_never_splits(open_bins):
    order = epoch_order(N, seed=0, epoch=0)
    plan = plan_packed(order, LENGTHS, 512, open_bins=open_bins)
    seen = []
    for samples, tokens in plan:
        assert tokens.sum() <= 512
        assert np.array_equal(tokens, np.minimum(LENGTHS[samples], 512))
        seen.extend(samples.tolist())
    assert sorted(seen) == list(range(N))
    if open_bins == 1:
        assert np.array_equal(np.array(seen), order)


def test_more_open_bins_fill_batches_better():
    order = epoch_order(N, seed=0, epoch=0)
    strict = plan_packed(order, LENGTHS, 512, open_bins=1)
    firstfit = plan_packed(order, LENGTHS, 512, open_bins=8)
    assert len(firstfit) < len(strict)


def test_over_long_policies():
    order = np.arange(N)
    skipped = plan_packed(order, LENGTHS, 512, over_long="skip")
    assert set(skipped.samples.tolist()) == set(range(N)) - {7, 100, 333}
    truncated = plan_packed(order, LENGTHS, 512, over_long="truncate")
    for samples, tokens in truncated:
        if 100 in samples:
            assert len(samples) == 1 and tokens[0] == 512
    with pytest.raises(BadInputError):
        plan_packed(order, LENGTHS, 512, over_long="error")


def test_padded_plan_groups_in_order():
    order = epoch_order(N, seed=2, epoch=0)
    plan = plan_padded(order, LENGTHS, 7, 512)
    assert len(plan) == -(-N // 7)
    assert np.array_equal(plan.samples, order)
    assert all(len(s) == 7 for s, _ in list(plan)[:-1])


@pytest.mark.parametrize("num_batches", [0, 1, 5, 12, 13])
@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
def test_rank_batches_tail_policies(num_batches, world_size):
    per_rank = {
        t: [rank_batches(num_batches, r, world_size, t) for r in range(world_size)]
        for t in ("uneven", "pad", "drop")
    }
    uneven = np.concatenate(per_rank["uneven"])
    assert sorted(uneven.tolist()) == list(range(num_batches))
    for tail in ("pad", "drop"):
        counts = {len(b) for b in per_rank[tail]}
        assert len(counts) == 1, f"{tail}: ranks differ in steps"
    pad = np.concatenate(per_rank["pad"])
    assert set(pad.tolist()) == set(range(num_batches))
    drop = np.concatenate(per_rank["drop"])
    assert len(set(drop.tolist())) == len(drop)
    assert len(drop) == (num_batches // world_size) * world_size


@pytest.mark.parametrize("start", [0, 1, 7])
@pytest.mark.parametrize("num_workers", [1, 2, 3])
def test_worker_steps_interleave_into_rank_order(start, num_workers):
    n = 20
    parts = [worker_steps(n, start, w, num_workers) for w in range(num_workers)]
    # A DataLoader takes worker 0, 1, ... in turn: reproduce its interleaving.
    merged, k = [], 0
    iters = [iter(p.tolist()) for p in parts]
    alive = list(range(num_workers))
    while alive:
        w = alive[k % len(alive)]
        nxt = next(iters[w], None)
        if nxt is None:
            alive.remove(w)
            continue
        merged.append(nxt)
        k += 1
    assert merged == list(range(start, n))


@pytest.mark.parametrize(("world_size", "num_workers"), [(1, 1), (1, 3), (2, 2), (3, 1), (4, 3)])
def test_every_sample_exactly_once_over_ranks_and_workers(world_size, num_workers):
    cfg = LoaderOptions(max_tokens=512, tail="uneven", seed=5).plan_config()
    seen = []
    for rank in range(world_size):
        plan = rank_plan(cfg, LENGTHS, SEGMENTS, 3, rank, world_size)
        for w in range(num_workers):
            for j in worker_steps(len(plan), 0, w, num_workers):
                seen.extend(plan.batch(int(j))[0].tolist())
    assert sorted(seen) == list(range(N))


def test_ranks_never_overlap_with_padding():
    cfg = LoaderOptions(max_tokens=512, tail="pad").plan_config()
    full = global_plan(cfg, LENGTHS, SEGMENTS, 0)
    plans = [rank_plan(cfg, LENGTHS, SEGMENTS, 0, r, 3) for r in range(3)]
    assert len({len(p) for p in plans}) == 1
    rounds_without_pad = len(full) // 3
    firsts = [set(p.samples[: p.offsets[rounds_without_pad]].tolist()) for p in plans]
    assert (
        not (firsts[0] & firsts[1]) and not (firsts[1] & firsts[2]) and not (firsts[0] & firsts[2])
    )
