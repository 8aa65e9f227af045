"""A writer thread fed through a bounded queue, so storing overlaps extraction.

The model thread hands over finished batches and goes straight back to the next forward; the
thread compresses, writes and periodically commits them. The queue is bounded so a slow disk
applies back-pressure instead of letting states pile up in memory, and the time the model
thread spends blocked on a full queue is measured: it is exactly the time the writer was the
bottleneck.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from hsstore.dataset.dataset import Dataset
from hsstore.extractors.chat_tokens import TokenizedPrompt

_DONE = object()


@dataclass
class WriterStats:
    samples: int = 0
    tokens: int = 0
    raw_bytes: int = 0
    commits: int = 0
    busy_s: float = 0.0  # time spent in add/commit
    stall_s: float = 0.0  # time the producer waited on a full queue


class WriterThread:
    """Owns one ``ds.writer()``; commits every ``commit_every`` samples or ``commit_seconds``."""

    def __init__(
        self,
        ds: Dataset,
        *,
        commit_every: int,
        commit_seconds: float,
        max_queue: int = 4,
        encode_threads: int | None = None,
        on_written: Callable[[int, int, int], None] | None = None,
        on_committed: Callable[[list[str]], None] | None = None,
        skipped: Sequence[tuple[str, str]] = (),
    ):
        self.ds = ds
        self.commit_every = max(1, commit_every)
        self.commit_seconds = commit_seconds
        self.encode_threads = encode_threads
        self.on_written = on_written
        self.on_committed = on_committed
        self.skipped = list(skipped)
        self.stats = WriterStats()
        self.error: BaseException | None = None
        self._queue: queue.Queue = queue.Queue(maxsize=max(1, max_queue))
        self._thread = threading.Thread(target=self._run, name="hsstore-writer", daemon=True)

    def start(self) -> WriterThread:
        self._thread.start()
        return self

    def put(self, items: list[tuple[TokenizedPrompt, torch.Tensor]]) -> None:
        """Hand over one batch; blocks while the queue is full, raises if the writer died."""
        t0 = time.perf_counter()
        while True:
            if self.error is not None:
                raise self.error
            try:
                self._queue.put(items, timeout=0.5)
                break
            except queue.Full:
                continue
        self.stats.stall_s += time.perf_counter() - t0

    def finish(self) -> WriterStats:
        """Flush, commit what is left, stop the thread; re-raises a writer error."""
        if self.error is None:
            self._queue.put(_DONE)
        self._thread.join()
        if self.error is not None:
            raise self.error
        return self.stats

    def _run(self) -> None:
        try:
            with self.ds.writer(encode_threads=self.encode_threads) as w:
                for name, reason in self.skipped:
                    w.record_skipped(name, reason)
                pending: list[str] = []  # added since the last commit
                last_commit = time.monotonic()
                while True:
                    items = self._queue.get()
                    if items is _DONE:
                        break
                    t0 = time.perf_counter()
                    for prompt, hidden in items:
                        w.add(
                            prompt.sample_id,
                            prompt.input_ids,
                            prompt.loss_mask,
                            hidden,
                            source=prompt.source,
                        )
                        self._count(prompt, hidden)
                        pending.append(prompt.sample_id)
                    if len(pending) >= self.commit_every or (
                        time.monotonic() - last_commit >= self.commit_seconds
                    ):
                        w.commit()
                        self.stats.commits += 1
                        self._committed(pending)
                        pending = []
                        last_commit = time.monotonic()
                    self.stats.busy_s += time.perf_counter() - t0
                t0 = time.perf_counter()
            # leaving the with-block committed the rest
            self.stats.busy_s += time.perf_counter() - t0
            if pending:
                self.stats.commits += 1
                self._committed(pending)
        except BaseException as exc:  # surfaced to the producer by put()/finish()
            self.error = exc
            self._drain()

    def _count(self, prompt: TokenizedPrompt, hidden: torch.Tensor) -> None:
        n = prompt.num_tokens
        nbytes = hidden.numel() * hidden.element_size()
        self.stats.samples += 1
        self.stats.tokens += n
        self.stats.raw_bytes += nbytes
        if self.on_written is not None:
            self.on_written(1, n, nbytes)

    def _committed(self, sample_ids: list[str]) -> None:
        if self.on_committed is not None:
            self.on_committed(sample_ids)

    def _drain(self) -> None:
        """Unblock a producer stuck on a full queue after an error."""
        try:
            while True:
                self._queue.get_nowait()
        except queue.Empty:
            pass
