"""Decoding planned batches into host buffers with a bounded pool of threads.

The core reader does its file reads (``preadv``) and blosc decoding outside the GIL, so
threads scale with cores without the pickling and shared-memory copies of worker processes.
A producer thread walks the plan; each batch takes a free buffer from a small ring (or a fresh
one when buffers cannot be reused) and queues one decode task per thread, not one per sample:
on small samples a future, a thread wake-up and a GIL hand-off per sample cost as much as
reading the sample. The tasks claim the batch's samples one at a time, in storage order, so a
chunk that two neighbouring samples share is decoded once and files are read forwards. While
they run, the producer writes the batch's padding and gathers all its token columns at once.
With a single decode thread there is no pool. On the pipelined path (``decode_path``, chosen
once by `resolve_decode_path`) the producer plans each batch (and reads its compressed chunks)
and a thread of their own decodes the chunks or reads the uncompressed samples
(`ChunkPipeline`), so that thread does nothing else; inline, the producer decodes each batch
itself, after its padding and token columns.

On the pipelined path a checker thread verifies the whole-sample checksums of a batch while the
next one decodes (`check_decoded`); a batch reaches the consumer only once every sample in it
passed. Inline it does not run: on cores the decode threads keep busy, hashing right after
decoding, while the bytes are in cache, costs less than hashing them again later. Padding is
written only where a buffer may hold stale rows (``HostBuffers.clean_from``). Before a batch is
decoded, the next one's samples are handed to the storage (`Dataset.will_read`): on local disk
their chunks come in from the device while this batch decodes. At most ``prefetch`` batches
wait in the output queue, so memory is bounded by ``(prefetch + 2)`` batch buffers whatever the
speed of the consumer.

The consumer's hand-off is kept free of thread wake-ups while the producer is ahead: waking
the producer from inside ``__next__`` lets it take the consumer's core for a scheduler tick on
a busy machine, and the consumer then waits inside the hand-off for a batch that is ready. A
used buffer therefore goes back quietly while another decoded batch is waiting, and the
producer finds it by polling; it is woken only when the queue is about to run dry.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import queue
import threading
import time
from collections import deque
from collections.abc import Iterable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np
import torch

from hsstore.loader.batching import WAIT, padded_length
from hsstore.loader.chunk_pipeline import ChunkPipeline, RunsTo, SamplesRead
from hsstore.loader.collate import (
    HostBuffers,
    Placements,
    RawBatch,
    fill_padding,
    placements,
    write_tokens,
)
from hsstore.loader.damaged import blank
from hsstore.loader.dataset_handle import DatasetSource, LayerChoice
from hsstore.loader.decode_paths import resolve_decode_path
from hsstore.loader.dequant import dequantize_batch
from hsstore.loader.shutdown import POLL_S, await_stopped, close_at_exit, put_unless_stopped

_FIRST_POLL_S = 0.001
# How long `close` gives the producer before it shuts the decode pools under it.
FIRST_JOIN_S = 5.0
# Less stale padding than this is zeroed by the producer: a hand-off costs as much.
_ZERO_HERE_BYTES = 1 << 20
_END = object()
# One sample to decode: (storage position, stored tokens, first row in the batch's flattened
# [B * T] tokens, tokens taken).
_Placed = tuple[int, int, int, int]


@dataclass(frozen=True)
class BatchShape:
    """How planned batches become tensors."""

    packed: bool
    max_tokens: int
    batch_size: int | None = None
    pad_to_multiple_of: int = 8
    pad_token_id: int = 0

    @property
    def capacity(self) -> int:
        return self.max_tokens if self.packed else (self.batch_size or 1) * self.max_tokens

    def dims(self, tokens: np.ndarray) -> tuple[int, int]:
        if self.packed:
            return 1, self.max_tokens
        return len(tokens), padded_length(tokens, self.pad_to_multiple_of, self.max_tokens)


class BatchFetcher:
    """Iterator of host ``RawBatch`` es for a sequence of planned batches.

    With ``reuse_buffers`` a yielded batch stays valid until the next one is requested (its
    buffer then goes back to the ring); without it every batch owns fresh tensors (needed when
    batches leave the process, as from DataLoader workers). Batches of an fp8 dataset are
    decoded in their stored form (fp8 states and scales) and, with ``dequantize``, turned into
    values here, once per batch; without it they leave in that form for the device to
    dequantize (`hsstore.loader.dequant`).
    """

    def __init__(
        self,
        source: DatasetSource,
        choice: LayerChoice,
        shape: BatchShape,
        batches: Iterable[tuple[np.ndarray, np.ndarray] | object],
        *,
        num_threads: int = 4,
        prefetch: int = 2,
        reuse_buffers: bool = True,
        pin_memory: bool = False,
        ring: list[HostBuffers] | None = None,
        dequantize: bool = True,
        skip: frozenset[int] = frozenset(),
        decode_path: str = "auto",
    ):
        if num_threads < 1 or prefetch < 1:
            raise ValueError("num_threads and prefetch must be >= 1")
        self.decode_path = resolve_decode_path(decode_path, num_threads)
        pipelined = self.decode_path == "pipelined"
        self.source, self.choice, self.shape = source, choice, shape
        self._layers = choice.read
        self._reuse, self._pin, self._dequantize = reuse_buffers, pin_memory, dequantize
        self._skip = skip
        # Buffers handed back with a wake-up (None: wake up to stop).
        self._free: queue.Queue[HostBuffers | None] = queue.Queue()
        self._returned: deque[HostBuffers] = deque()  # handed back quietly (see _take_free)
        if reuse_buffers:
            # A caller-owned ring survives epochs: fresh pages cost a fault each on first touch.
            for buf in (
                ring
                if ring is not None
                else self.make_ring(source, choice, shape, prefetch, pin_memory, dequantize)
            ):
                self._free.put(buf)
        self._out: queue.Queue = queue.Queue(maxsize=prefetch)
        self._held: HostBuffers | None = None
        self._stop = threading.Event()
        self._local = threading.local()
        self._num_threads = num_threads
        self._pool = (
            ThreadPoolExecutor(num_threads, thread_name_prefix="hsstore-decode")
            if num_threads > 1
            else None
        )
        self._checker = (
            ThreadPoolExecutor(1, thread_name_prefix="hsstore-check")
            if source.verify_reads and pipelined
            else None
        )
        # One decode thread, pipelined: batches are planned by the producer and decoded
        # (compressed chunks) or read (uncompressed samples) on a thread that does nothing else
        # (`ChunkPipeline`).
        self._pipeline = (
            ChunkPipeline(self._stop, compressed=source.compressed)
            if num_threads == 1 and pipelined
            else None
        )
        self._thread = threading.Thread(
            target=self._produce, args=(iter(batches),), name="hsstore-plan", daemon=True
        )
        close_at_exit(self)
        self._thread.start()

    @staticmethod
    def make_ring(
        source: DatasetSource,
        choice: LayerChoice,
        shape: BatchShape,
        prefetch: int,
        pin: bool,
        dequantize: bool = True,
    ) -> list[HostBuffers]:
        """The ``prefetch + 1`` reusable buffers a fetcher with these settings needs."""
        return [
            _buffers(source, choice.read, shape.capacity, pin, dequantize)
            for _ in range(prefetch + 1)
        ]

    def _new_buffers(self, capacity: int) -> HostBuffers:
        """A one-shot buffer (batches leaving the process own their memory)."""
        return _buffers(
            self.source, self._layers, capacity, self._pin, self._dequantize, prefault=False
        )

    # --- producer side ---------------------------------------------------------------------

    def _produce(self, batches: Iterator[tuple[np.ndarray, np.ndarray] | object]) -> None:
        try:
            upcoming = next(batches, None)
            while upcoming is not None:
                if upcoming is WAIT:  # nothing held: now the plan may wait for its next batch
                    upcoming = next(batches, None)
                    continue
                samples, tokens = upcoming  # type: ignore[misc]
                upcoming = next(batches, None)
                b, t = self.shape.dims(tokens)
                if self._reuse:
                    buf = self._take_free()
                    if buf is None:
                        return
                else:
                    buf = self._new_buffers(b * t)
                raw = buf.view(b, t, tokens, samples)
                places = placements(self.shape.packed, tokens)
                todo = self._decode_order(samples, places, t)
                tokens_rows = raw.hidden.view(b * t, *raw.hidden.shape[2:])
                # Until the padding is written, all this batch's rows may hold data.
                clean_from, buf.clean_from = buf.clean_from, max(buf.clean_from, b * t)
                # The samples whose checksums the checker verifies, from every decode task.
                unchecked: list[tuple[int, int]] | None = [] if self._checker else None
                futures = [
                    self._pool.submit(self._decode_claimed, tokens_rows, todo, unchecked)
                    for _ in range(min(self._num_threads, len(todo)))
                ] if self._pool is not None else []  # fmt: skip
                try:  # while the samples decode (padding and token columns lie elsewhere)
                    stale: list[torch.Tensor] | None = [] if self._checker else None
                    buf.clean_from = fill_padding(
                        raw, places, self.shape.packed, self.shape.pad_token_id, clean_from, stale
                    )
                    zeroed = self._zero(stale) if stale else None
                    input_ids, loss_mask = self.source.read_tokens_many(samples, tokens)
                    scales = None
                    if raw.scales is not None:
                        scales = self.source.read_scales_many(samples, tokens, self._layers)
                    write_tokens(raw, places, self.shape.packed, input_ids, loss_mask, scales)
                    if self._skip:  # no task reads these rows: blank them here
                        blank(raw, places, samples, self._skip)
                    if upcoming is not None and upcoming is not WAIT:  # its reads from disk
                        self.source.will_read(upcoming[0], self._layers)
                except BaseException:
                    todo.clear()
                    raise
                samples_read = None
                if self._pipeline is not None:  # planned here, read on the pipeline's thread
                    read = functools.partial(self._decode_claimed, tokens_rows, todo, unchecked)
                    decoding, samples_read = self._pipeline.run_batch(read)
                    futures.append(decoding)
                elif self._pool is None:  # one decode thread: this one, with no hand-off
                    self._decode_claimed(tokens_rows, todo, unchecked)
                values = buf.values_view(b, t)
                decoded_here = not futures
                if zeroed is not None:  # the dequantization and the consumer wait for it too
                    futures.append(zeroed)
                if values is not None and decoded_here:
                    if zeroed is not None:
                        zeroed.result()
                    raw = dequantize_batch(raw, values)
                elif values is not None:  # once the batch's decode tasks are done
                    decoded = list(futures)
                    executor = self._pool or self._pipeline.executor  # type: ignore[union-attr]
                    futures.append(executor.submit(self._dequantize_after, decoded, raw, values))
                    raw = dataclasses.replace(raw, hidden=values, scales=None)
                if unchecked is not None:  # the checker's, as the samples are read
                    futures.append(
                        self._checker.submit(
                            self._check_after, list(futures), tokens_rows, unchecked, samples_read
                        )
                    )
                if not self._put((buf, raw, futures)):
                    return
            self._put(_END)
        except BaseException as exc:  # handed to the consumer, which re-raises it
            self._put(exc)

    def _zero(self, stale: list[torch.Tensor]) -> Future | None:
        """Zero the ``stale`` hidden states of a batch's padding: on the checker thread when
        there is much of it (the rows a short batch, such as an epoch's last, leaves behind in a
        reused buffer), so that the decoding of the batch does not wait for it; else here."""
        if sum(rows.nbytes for rows in stale) < _ZERO_HERE_BYTES:
            _zero_rows(stale)
            return None
        return self._checker.submit(_zero_rows, stale)  # type: ignore[union-attr]

    @staticmethod
    def _dequantize_after(decoded: list[Future], raw: RawBatch, values: torch.Tensor) -> None:
        """Dequantize a batch into ``values`` once its decode tasks are done: a pool task
        queued after them, so every one of them has started (or ended) before it waits."""
        for f in decoded:
            f.result()
        dequantize_batch(raw, values)

    def _check_after(
        self,
        decoded: list[Future],
        tokens_rows: torch.Tensor,
        unchecked: list[tuple[int, int]],
        samples_read: SamplesRead | None,
    ) -> None:  # runs on the checker thread
        """Verify the checksums of a batch's samples: those the pipeline's thread reads
        (``samples_read``) as it reads them, the others once the batch's decode tasks are
        done."""
        done: list[tuple[int, int]] = []
        while samples_read is not None and (more := samples_read.after(len(done))) is not None:
            self.source.check_decoded(tokens_rows, more)
            done += more
        for f in decoded:
            f.result()
        if done:
            checked = set(done)
            unchecked = [placed for placed in unchecked if placed not in checked]
        self.source.check_decoded(tokens_rows, unchecked)

    def _decode_order(
        self, samples: np.ndarray, places: Placements, seq_len: int
    ) -> deque[_Placed]:
        """The batch's samples in storage order, each with the row of the batch's flattened
        ``[B * T]`` tokens where it starts."""
        order = np.argsort(samples, kind="stable")
        if self._skip:
            order = order[~np.isin(samples[order], list(self._skip))]
        first_rows = places.rows[order] * seq_len + places.starts[order]
        return deque(
            zip(
                samples[order].tolist(),
                self.source.num_tokens[samples[order]].tolist(),
                first_rows.tolist(),
                places.takes[order].tolist(),
            )
        )

    def _take_free(self) -> HostBuffers | None:
        """A free ring buffer, or None once stopped.

        Quietly returned buffers are noticed by polling, with a timeout of a quarter of the
        time waited so far (1 ms to 100 ms): a buffer handed back one training step after the
        producer filled the ring is picked up about a quarter of a step later, and an idle
        loader wakes ten times a second.
        """
        started = time.monotonic()
        while not self._stop.is_set():
            with contextlib.suppress(IndexError):
                return self._returned.popleft()
            waited = time.monotonic() - started
            try:
                return self._free.get(timeout=min(POLL_S, max(_FIRST_POLL_S, waited / 4)))
            except queue.Empty:
                continue
        return None

    def _put(self, item: object) -> bool:
        return put_unless_stopped(self._out, item, self._stop)

    def _decode_claimed(
        self,
        tokens_rows: torch.Tensor,
        todo: deque[_Placed],
        unchecked: list[tuple[int, int]] | None,
        runs_to: RunsTo | None = None,
    ) -> None:
        """Decode the samples claimed from ``todo`` into ``tokens_rows`` (the batch's states,
        ``[B * T, L', H]``) until none is left (``popleft`` is atomic, so the batch's tasks
        share the work without a lock) or the fetcher stops. Whole samples go through one
        `read_hidden_many_into` call per task (its checks and views paid once per batch), their
        checksums left to the checker (``unchecked``), their chunks to ``runs_to`` if given."""
        try:
            self.source.read_hidden_many_into(
                tokens_rows, self._claim(tokens_rows, todo), self._layers, unchecked, runs_to
            )
        except BaseException:
            todo.clear()  # the batch is lost: its other tasks stop at their next claim
            raise

    def _claim(self, tokens_rows: torch.Tensor, todo: deque[_Placed]) -> Iterator[tuple[int, int]]:
        """(sample, first row) of the whole samples claimed from ``todo``, one at a time; a
        truncated sample is decoded here, on the side."""
        while todo and not self._stop.is_set():
            try:
                i, full, first, take = todo.popleft()
            except IndexError:  # another task took the last one
                return
            if take == full:
                yield i, first
            else:
                self._decode_truncated(tokens_rows[first : first + take], i, full)

    def _decode_truncated(self, dst: torch.Tensor, i: int, full: int) -> None:
        """Decode a sample whole into a per-thread scratch and keep its head."""
        scratch = getattr(self._local, "scratch", None)
        need = full * dst.shape[1] * dst.shape[2]
        if scratch is None or scratch.numel() < need:
            scratch = self._local.scratch = torch.empty(need, dtype=dst.dtype)
        whole = scratch[:need].view(full, dst.shape[1], dst.shape[2])
        self.source.read_hidden_into(i, whole, self._layers)
        dst.copy_(whole[: dst.shape[0]])

    # --- consumer side ---------------------------------------------------------------------

    def __iter__(self) -> BatchFetcher:
        return self

    def __next__(self) -> RawBatch:
        if self._stop.is_set():
            raise StopIteration
        if self._held is not None:
            self._give_back(self._held)
            self._held = None
        item = self._get()
        if item is _END:
            self.close()
            raise StopIteration
        if isinstance(item, BaseException):
            self.close()
            raise item
        buf, raw, futures = item
        try:
            for f in futures:
                f.result()
        except BaseException:
            self._cancel(futures)
            self.close()
            raise
        if self._reuse:
            self._held = buf
        return raw

    def _give_back(self, buf: HostBuffers) -> None:
        """Return the buffer of the batch the consumer is done with (see the module doc)."""
        if self._out.qsize() > 1:  # a decoded batch stays ready after the one taken next
            self._returned.append(buf)
        else:
            self._free.put(buf)  # the producer may be needed right now: wake it

    def _get(self) -> object:
        while not self._stop.is_set():
            try:
                return self._out.get(timeout=POLL_S)
            except queue.Empty:
                continue
        return _END

    @staticmethod
    def _cancel(futures: list[Future]) -> None:
        for f in futures:
            f.cancel()

    def close(self) -> None:
        """Stop producing and release the threads (idempotent; also on garbage collection):
        returns once the producer has left any storage call it was in."""
        if not self._stop.is_set():
            self._stop.set()
            # Wake a producer waiting for a free buffer or for room in the queue, so that it
            # sees the stop now rather than at its next poll.
            self._free.put(None)
            with contextlib.suppress(queue.Empty):
                self._out.get_nowait()
            pools = [p for p in (self._pool, self._checker, self._pipeline) if p is not None]
            for pool in pools:
                pool.shutdown(wait=False, cancel_futures=True)
            if self._thread is not threading.current_thread():
                self._thread.join(timeout=FIRST_JOIN_S)
            for pool in pools:
                pool.shutdown(wait=True)
        await_stopped(self._thread)

    def __del__(self) -> None:
        # Not contextlib.suppress: at interpreter exit this module's globals may already be
        # None when the last reference goes, and a failing __del__ prints a traceback.
        try:  # noqa: SIM105
            self.close()
        except Exception:
            pass


def _zero_rows(stale: list[torch.Tensor]) -> None:
    for rows in stale:
        rows.zero_()


def _buffers(
    source: DatasetSource,
    layers: list[int],
    capacity: int,
    pin: bool,
    dequantize: bool,
    prefault: bool = True,
) -> HostBuffers:
    """Host buffers for batches of ``layers`` of ``source``: values, or for a scaled dataset
    the stored form (plus room for the values when they are dequantized on the host)."""
    width = source.scales_width(layers)
    return HostBuffers(
        capacity,
        len(layers),
        source.hidden_size,
        source.dtype if width is None else source.stored_dtype,
        pin,
        prefault,
        scales_width=width,
        values_dtype=source.dtype if dequantize else None,
    )
