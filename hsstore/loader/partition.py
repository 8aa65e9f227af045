"""Who reads which batch: ranks and DataLoader workers, as pure functions.

The epoch's batches are planned once, identically on every rank, from the index alone. Batch j
then goes to rank ``j % world_size``; this is what makes "no two ranks overlap" and
"every sample once per epoch" true by construction rather than by coordination.
"""

from __future__ import annotations

import numpy as np

TAIL_POLICIES = ("pad", "drop", "uneven")


def rank_batches(num_batches: int, rank: int, world_size: int, tail: str = "pad") -> np.ndarray:
    """Global batch numbers rank ``rank`` processes this epoch, in order.

    tail: ``"uneven"``: every batch exactly once, ranks may differ by one step.
    ``"drop"``: the last incomplete round (fewer than ``world_size`` batches) is dropped.
    ``"pad"``: the last round is completed with batches from the start of the epoch, so every
    rank runs the same number of steps (DDP hangs otherwise) and every sample is seen at least
    once.
    """
    if world_size < 1 or not 0 <= rank < world_size:
        raise ValueError(f"need 0 <= rank < world_size, got rank={rank} world_size={world_size}")
    if tail not in TAIL_POLICIES:
        raise ValueError(f"tail must be one of {TAIL_POLICIES}, got {tail!r}")
    if num_batches == 0:
        return np.zeros(0, dtype=np.int64)
    if tail == "uneven":
        return np.arange(rank, num_batches, world_size, dtype=np.int64)
    if tail == "drop":
        end = (num_batches // world_size) * world_size
        return np.arange(rank, end, world_size, dtype=np.int64)
    rounds = -(-num_batches // world_size)
    return np.arange(rank, rounds * world_size, world_size, dtype=np.int64) % num_batches


def worker_steps(num_steps: int, start: int, worker: int, num_workers: int) -> np.ndarray:
    """Positions in the rank's batch list (from ``start`` on) that worker ``worker`` produces.

    A ``DataLoader`` takes one batch from worker 0, then worker 1, ... round robin; assigning
    step ``start + m`` to worker ``m % num_workers`` makes its output the rank's order.
    """
    if num_workers < 1 or not 0 <= worker < num_workers:
        raise ValueError(f"need 0 <= worker < num_workers, got {worker}, {num_workers}")
    return np.arange(start + worker, num_steps, num_workers, dtype=np.int64)
