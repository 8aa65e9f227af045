"""Who reads which batch: ranks and DataLoader workers, as pure functions.

The epoch's batches are planned once, identically on every rank, from the index alone: that
global batch list, and how many of its batches are done (the *position*), are all that a
resumed run shares with the run that saved it. From position ``start`` on, batch
``start + r + i * world_size`` goes to rank r at its step i; this is what makes "no two ranks
overlap" and "every sample once per epoch" true by construction rather than by coordination,
and what lets a run stopped at one world size go on at another (ranks advance in lockstep, so
after i steps the position is ``start + i * world_size``).
"""

from __future__ import annotations

import numpy as np

TAIL_POLICIES = ("pad", "drop", "uneven")


def rank_batches(
    num_batches: int, rank: int, world_size: int, tail: str = "pad", start: int = 0
) -> np.ndarray:
    """Global batch numbers rank ``rank`` processes this epoch from position ``start``, in order.

    tail: ``"uneven"``: every batch exactly once, ranks may differ by one step.
    ``"drop"``: the last incomplete round (fewer than ``world_size`` batches) is dropped.
    ``"pad"``: the last round is completed with batches from the start of the epoch, so every
    rank runs the same number of steps (DDP hangs otherwise) and every sample is seen at least
    once. The rounds are counted from ``start``.
    """
    if world_size < 1 or not 0 <= rank < world_size:
        raise ValueError(f"need 0 <= rank < world_size, got rank={rank} world_size={world_size}")
    if tail not in TAIL_POLICIES:
        raise ValueError(f"tail must be one of {TAIL_POLICIES}, got {tail!r}")
    if start < 0:
        raise ValueError(f"start must be >= 0, got {start}")
    remaining = num_batches - start
    if remaining <= 0:
        return np.zeros(0, dtype=np.int64)
    first = start + rank
    if tail == "uneven":
        return np.arange(first, num_batches, world_size, dtype=np.int64)
    if tail == "drop":
        end = start + (remaining // world_size) * world_size
        return np.arange(first, end, world_size, dtype=np.int64)
    end = start + -(-remaining // world_size) * world_size
    return np.arange(first, end, world_size, dtype=np.int64) % num_batches


def position_after(start: int, steps: int, world_size: int, num_batches: int | None) -> int:
    """Global batches done once every rank has run ``steps`` steps from ``start`` (capped at
    the epoch's end, which a padded last round runs past)."""
    done = start + steps * world_size
    return done if num_batches is None else min(done, num_batches)


def worker_steps(num_steps: int, start: int, worker: int, num_workers: int) -> np.ndarray:
    """Positions in the rank's batch list (from ``start`` on) that worker ``worker`` produces.

    A ``DataLoader`` takes one batch from worker 0, then worker 1, ... round robin; assigning
    step ``start + m`` to worker ``m % num_workers`` makes its output the rank's order.
    """
    if num_workers < 1 or not 0 <= worker < num_workers:
        raise ValueError(f"need 0 <= worker < num_workers, got {worker}, {num_workers}")
    return np.arange(start + worker, num_steps, num_workers, dtype=np.int64)
