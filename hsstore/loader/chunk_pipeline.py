"""One decode thread that does nothing but decode: a batch planned on the thread that plans
it, and its bytes decoded (compressed) or read (uncompressed) on a thread of their own.

With one decode thread on the fetcher's pipelined path, the producer plans each batch's reads
(`PlannedRead`, from `hsstore.dataset.batch_reads.read_hidden_many_into` with ``runs_to``).
Compressed chunks are planned shard by shard (`ShardRun`): the producer reads their bytes into
buffers of its own (`Storage.read_ranges` into them) and queues each filled buffer; the decode
thread decodes its chunks into the batch and hands the buffer back. The buffers are few and
reused (`BUFFERS` of `BUFFER_BYTES`): a producer that far ahead waits for one to come back, and
the decode thread finds each chunk freshly read, in the shared cache. Uncompressed samples are
planned a few MiB at a time (`RawSamplesRead`) and read straight into the batch on the decode
thread, in calls that hold no interpreter lock. Everything else a batch needs (planning,
padding, token columns, hints) then runs beside the decoding rather than between its chunks.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor

import numpy as np

from hsstore.segment.rows import PlannedRead, RawSamplesRead
from hsstore.storage.damage import read_ranges_into_io

BUFFER_BYTES = 4 << 20
BUFFERS = 4
_POLL_S = 0.1

RunsTo = Callable[[PlannedRead], None]


class ChunkPipeline:
    """The decode thread and the read buffers of one fetcher."""

    def __init__(self, stop: threading.Event, *, compressed: bool):
        self._stop = stop
        self.executor = ThreadPoolExecutor(1, thread_name_prefix="hsstore-decode")
        self._free: queue.SimpleQueue[np.ndarray] = queue.SimpleQueue()
        # Uncompressed samples are read straight into the batch, except some of their layers
        # (those runs go through buffers too): then the buffers are made on first need.
        self._unmade = 0 if compressed else BUFFERS
        for _ in range(BUFFERS - self._unmade):
            self._free.put(np.ones(BUFFER_BYTES, np.uint8))  # touched now, not in an epoch

    def run_batch(self, read: Callable[[RunsTo], object]) -> tuple[Future, SamplesRead]:
        """Call ``read(runs_to)`` here: every `ShardRun` it hands to ``runs_to`` is read on
        this thread and decoded on the pipeline's, every `RawSamplesRead` read on the
        pipeline's. The future is done once all are (or holds the first error one raised);
        the `SamplesRead` tells which uncompressed samples are read meanwhile."""
        runs: queue.SimpleQueue[tuple[PlannedRead, list[memoryview], np.ndarray | None] | None]
        runs = queue.SimpleQueue()
        samples = SamplesRead(self._stop)
        future = self.executor.submit(self._decode, runs, samples)
        try:
            read(lambda run: self._read(run, runs))
        finally:
            runs.put(None)  # the decode task ends here whatever happened to the reads
        return future, samples

    def _read(self, run: PlannedRead, runs: queue.SimpleQueue) -> None:
        if isinstance(run, RawSamplesRead):  # read there, straight into the batch
            runs.put((run, [], None))
            return
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
                buf = self._free.get(timeout=0 if self._unmade else _POLL_S)
            except queue.Empty:
                if self._unmade:  # only this thread takes buffers: no race on the count
                    self._unmade -= 1
                    buf = np.empty(BUFFER_BYTES, np.uint8)
                else:
                    continue
            if len(buf) < nbytes:
                self._free.put(buf)
                return np.empty(nbytes, np.uint8)
            return buf
        return None

    def _give_back(self, buf: np.ndarray) -> None:
        if len(buf) == BUFFER_BYTES:
            self._free.put(buf)

    def _decode(self, runs: queue.SimpleQueue, samples: SamplesRead) -> None:  # decode thread
        error: BaseException | None = None
        try:
            while (item := runs.get()) is not None:
                part, got, buf = item
                try:
                    if error is None and not self._stop.is_set():
                        if isinstance(part, RawSamplesRead):
                            samples.add(part.read())
                        else:
                            part.decode(iter(got))
                except BaseException as exc:  # the rest of the batch is drained, not decoded
                    error = exc
                finally:
                    if buf is not None:
                        self._give_back(buf)
        finally:
            samples.end()
        if error is not None:
            raise error

    def shutdown(self, wait: bool, cancel_futures: bool = False) -> None:
        self.executor.shutdown(wait=wait, cancel_futures=cancel_futures)


class SamplesRead:
    """The ``(position, row)`` of the uncompressed samples of one batch that the pipeline's
    thread has read so far: the checker verifies them while it reads the rest, so that what
    is left to check once the batch is read (the delivery of an epoch's last batch waits for
    it) is its last read's samples, and their bytes are hashed soon after they land."""

    def __init__(self, stop: threading.Event):
        self._stop = stop
        self._changed = threading.Condition()
        self._read: list[tuple[int, int]] = []
        self._ended = False

    def add(self, samples: list[tuple[int, int]]) -> None:
        with self._changed:
            self._read += samples
            self._changed.notify_all()

    def end(self) -> None:
        with self._changed:
            self._ended = True
            self._changed.notify_all()

    def after(self, known: int) -> list[tuple[int, int]] | None:
        """The samples read after the first ``known``, once there are any; None once the
        batch's reads have ended (or the fetcher stopped) without more."""
        with self._changed:
            while len(self._read) <= known and not self._ended and not self._stop.is_set():
                self._changed.wait(_POLL_S)
            return self._read[known:] if len(self._read) > known else None
