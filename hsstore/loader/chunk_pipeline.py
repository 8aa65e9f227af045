"""One decode thread that does nothing but decode: compressed chunks read on the thread that
plans the batch and decoded on a thread of their own.

With one decode thread and a core to spare, the producer plans each batch's reads shard by
shard (`ShardRun`, from `Dataset.read_hidden_many_into` with ``runs_to``), reads their bytes
into buffers of its own (`Storage.read_ranges` into them) and queues each filled buffer; the
decode thread decodes its chunks into the batch and hands the buffer back. Everything else a
batch needs (planning, reads, padding, token columns, hints) then runs beside the decoding
rather than between its chunks. The buffers are few and reused (`BUFFERS` of `BUFFER_BYTES`):
a producer that far ahead waits for one to come back, and the decode thread finds each chunk
freshly read, in the shared cache.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor

import numpy as np

from hsstore.format.damage import read_ranges_into_io
from hsstore.segment_rows import ShardRun

BUFFER_BYTES = 4 << 20
BUFFERS = 4
_POLL_S = 0.1

RunsTo = Callable[[ShardRun], None]


class ChunkPipeline:
    """The decode thread and the read buffers of one fetcher."""

    def __init__(self, stop: threading.Event):
        self._stop = stop
        self.executor = ThreadPoolExecutor(1, thread_name_prefix="hsstore-decode")
        self._free: queue.SimpleQueue[np.ndarray] = queue.SimpleQueue()
        for _ in range(BUFFERS):
            self._free.put(np.ones(BUFFER_BYTES, np.uint8))  # touched now, not in an epoch

    def run_batch(self, read: Callable[[RunsTo], object]) -> Future:
        """Call ``read(runs_to)`` here: every `ShardRun` it hands to ``runs_to`` is read on
        this thread and decoded on the pipeline's. The future is done once all are decoded
        (or holds the first error a decode raised)."""
        runs: queue.SimpleQueue[tuple[ShardRun, list[memoryview], np.ndarray] | None]
        runs = queue.SimpleQueue()
        future = self.executor.submit(self._decode, runs)
        try:
            read(lambda run: self._read(run, runs))
        finally:
            runs.put(None)  # the decode task ends here whatever happened to the reads
        return future

    def _read(self, run: ShardRun, runs: queue.SimpleQueue) -> None:
        for part in run.split(BUFFER_BYTES):
            buf = self._take_buffer(part.nbytes)
            if buf is None:  # stopped: the batch is abandoned
                return
            ranges, into, at = part.ranges, [], 0
            view = memoryview(buf)
            for _, nbytes in ranges:
                into.append(view[at : at + nbytes])
                at += nbytes
            try:
                got = read_ranges_into_io(part.storage, part.key, ranges, into)
            except BaseException:
                self._give_back(buf)
                raise
            runs.put((part, got, buf))

    def _take_buffer(self, nbytes: int) -> np.ndarray | None:
        """A free buffer of at least ``nbytes`` (a chunk larger than `BUFFER_BYTES` gets one
        of its own, once a regular one is free), or None once stopped."""
        while not self._stop.is_set():
            try:
                buf = self._free.get(timeout=_POLL_S)
            except queue.Empty:
                continue
            if len(buf) < nbytes:
                self._free.put(buf)
                return np.empty(nbytes, np.uint8)
            return buf
        return None

    def _give_back(self, buf: np.ndarray) -> None:
        if len(buf) == BUFFER_BYTES:
            self._free.put(buf)

    def _decode(self, runs: queue.SimpleQueue) -> None:  # runs on the decode thread
        error: BaseException | None = None
        while (item := runs.get()) is not None:
            part, got, buf = item
            try:
                if error is None and not self._stop.is_set():
                    part.decode(iter(got))
            except BaseException as exc:  # the rest of the batch is drained, not decoded
                error = exc
            finally:
                self._give_back(buf)
        if error is not None:
            raise error

    def shutdown(self, wait: bool, cancel_futures: bool = False) -> None:
        self.executor.shutdown(wait=wait, cancel_futures=cancel_futures)
