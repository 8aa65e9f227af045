"""The streaming machinery convert and export share: an ordered, bounded thread map, a torch
thread limit, and the progress bar."""

from __future__ import annotations

import functools
import time
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from typing import TypeVar

import torch

from hsstore.cores import usable_cores
from hsstore.errors import HsstoreError

T = TypeVar("T")


def default_workers() -> int:
    """One reader thread per usable core, at most 8."""
    return max(1, min(8, usable_cores()))


def ordered_map(
    fn: Callable[[int], T], items: Sequence[int], workers: int
) -> Iterator[tuple[int, T | BaseException]]:
    """Yield ``(i, fn(i) or the exception it raised)`` in input order, at most 2*workers ahead."""
    window = max(2, 2 * workers)

    def call(i: int) -> T | BaseException:
        try:
            return fn(i)
        except HsstoreError as exc:  # bad input is data, not a crash
            return exc

    with ThreadPoolExecutor(max_workers=workers, thread_name_prefix="hsstore-convert") as pool:
        pending: deque[tuple[int, Future]] = deque()
        it = iter(items)
        for i in it:
            pending.append((i, pool.submit(call, i)))
            if len(pending) >= window:
                break
        while pending:
            i, fut = pending.popleft()
            nxt = next(it, None)
            if nxt is not None:
                pending.append((nxt, pool.submit(call, nxt)))
            yield i, fut.result()


@contextmanager
def torch_threads(n: int) -> Iterator[None]:
    """Limit torch's intra-op pool while we run our own threads: otherwise each of our threads
    wakes torch's whole pool for every small op, the cores are oversubscribed and a bf16 stack
    runs an order of magnitude slower than on one torch thread."""
    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


class Progress:
    """tqdm bar with samples/s (tqdm's rate) and GB/s of hidden states."""

    def __init__(self, total: int, desc: str, enabled: bool) -> None:
        from tqdm import tqdm

        # disable=None: shown on a terminal, silent when stderr is a file or a pipe.
        self.bar = tqdm(
            total=total,
            desc=desc,
            unit="sample",
            disable=None if enabled else True,
            dynamic_ncols=True,
        )
        self.start = time.perf_counter()
        self.nbytes = 0

    def update(self, nbytes: int) -> None:
        self.nbytes += nbytes
        self.bar.update(1)
        dt = time.perf_counter() - self.start
        if dt > 0 and self.bar.n % 8 == 0:
            self.bar.set_postfix_str(f"{self.nbytes / dt / 1e9:.2f} GB/s", refresh=False)

    def close(self) -> None:
        self.bar.close()


def single_torch_thread(fn: Callable[..., T]) -> Callable[..., T]:
    """Run ``fn`` with torch limited to one intra-op thread (see :func:`torch_threads`)."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs) -> T:
        with torch_threads(1):
            return fn(*args, **kwargs)

    return wrapper
