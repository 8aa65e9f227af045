"""How one read of a segment's rows is done: the strategies `SegmentReader.read_rows` runs.

A caller chooses one per read (a sample read by a dataset, verify's pass, a loader's batch) and
hands it to ``read_rows``; each says in its docstring what it checks, on which threads it
decodes and when ``out`` is filled. Every strategy decodes rows [start, stop) of the given
stored layers (None: all) into ``out`` [n, len(layers), H], a C-contiguous array of the
storage dtype, and reads the rows of all layers of an uncompressed segment as plain byte ranges
(`read_raw_rows`): a part of a chunk cannot be checked against the chunk's crc, and the sample
checksum covers those bytes.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar

import numpy as np
import xxhash

from hsstore.errors import FormatError
from hsstore.segment.rows import RowsRead, ShardRun, read_raw_rows

if TYPE_CHECKING:
    from hsstore.segment.reader import SegmentReader

# A sample's read is split between threads only where each share decodes at least this much:
# handing a share to a pool thread costs tens of microseconds, a MiB decodes in about 0.5 ms.
PARALLEL_MIN_BYTES = 1 << 20


class RowRead:
    """A way to read rows of one segment (the subclasses below)."""

    __slots__ = ()

    def read(
        self,
        reader: SegmentReader,
        start: int,
        stop: int,
        layers: Sequence[int] | None,
        out: np.ndarray,
    ) -> None:
        raise NotImplementedError


@dataclass(frozen=True, slots=True)
class ChunkChecked(RowRead):
    """Decoded on the calling thread, shard by shard, each compressed chunk checked against its
    crc32c as it decodes; any layers. ``crc=False``: chunks are not checked, for a caller that
    verifies the sample checksum over the decoded bytes later. ``out`` is filled on return."""

    crc: bool = True
    streams: ClassVar[bool] = False

    def read(
        self,
        reader: SegmentReader,
        start: int,
        stop: int,
        layers: Sequence[int] | None,
        out: np.ndarray,
    ) -> None:
        _decode_here(reader, start, stop, layers, out, None, self.crc, stream=self.streams)


@dataclass(frozen=True, slots=True)
class Streamed(ChunkChecked):
    """As `ChunkChecked`, with the chunks that fill whole rows of ``out`` decoded into it around
    the caches (`ChunkCodec.decode_into` with ``stream``): for an ``out`` nothing reads again
    soon, such as a loader's batch whose checksums another core takes."""

    streams: ClassVar[bool] = True


@dataclass(slots=True)
class Hashed(RowRead):
    """All layers only (else `FormatError`): decoded on the calling thread, every piece placed
    in ``out`` fed to ``hasher`` in row order right after it lands, while it is still in cache,
    so the sample checksum costs no extra pass over memory. Chunk crcs are not checked: the
    checksum covers the same bytes once decoded. The caller finishes the checksum (the token
    columns) and compares it."""

    hasher: xxhash.xxh3_64

    def read(
        self,
        reader: SegmentReader,
        start: int,
        stop: int,
        layers: Sequence[int] | None,
        out: np.ndarray,
    ) -> None:
        if not _all_layers(reader, layers):
            raise FormatError("a sample checksum covers all layers")
        _decode_here(reader, start, stop, None, out, self.hasher, False, stream=False)


@dataclass(slots=True)
class InShares(RowRead):
    """Compressed rows of all layers, in layers_per_chunk == num_layers layouts, cut into up
    to ``threads`` shares of whole chunks (at least `PARALLEL_MIN_BYTES` of decoded bytes
    each) and decoded at once, the first share by the calling thread and the others on the
    process's read pool, so one read of a large sample keeps several cores decoding. With a
    ``hasher``, as `Hashed`: the shares are fed to it in row order, each as it is done; without
    one, as `ChunkChecked` with ``crc``. A read that makes one share is that strategy's.
    ``out`` is filled on return; after an error, no share is still writing to it."""

    threads: int
    hasher: xxhash.xxh3_64 | None = None
    crc: bool = True

    def read(
        self,
        reader: SegmentReader,
        start: int,
        stop: int,
        layers: Sequence[int] | None,
        out: np.ndarray,
    ) -> None:
        alone: RowRead = Hashed(self.hasher) if self.hasher is not None else _checked(self.crc)
        man = reader.manifest
        in_rows = _all_layers(reader, layers) and man.layout.layers_per_chunk == man.num_layers
        if self.threads > 1 and in_rows and not reader.raw_rows:
            shares = shares_of(reader, start, stop, self.threads)
            if len(shares) > 1:
                self._read_shares(reader, shares, out, alone)
                return
        alone.read(reader, start, stop, layers, out)

    def _read_shares(
        self, reader: SegmentReader, shares: list[tuple[int, int]], out: np.ndarray, first: RowRead
    ) -> None:
        """The first share read here with ``first``, the others on the read pool without
        checking their chunks' crcs where the hasher covers them.

        A share no pool thread has started by the time this thread gets to it is taken back and
        decoded here: when many callers read at once and keep the pool busy, each does its own
        work instead of waiting in the pool's queue."""
        start = shares[0][0]
        rest = _checked(self.crc and self.hasher is None)
        out_bytes = _out_bytes(out)
        pool = _READ_POOL.get(len(shares) - 1)
        futures: list[Future[None]] = [
            pool.submit(rest.read, reader, lo, hi, None, out[lo - start : hi - start])
            for lo, hi in shares[1:]
        ]
        try:
            lo, hi = shares[0]
            first.read(reader, lo, hi, None, out[: hi - start])
            for (lo, hi), share in zip(shares[1:], futures, strict=True):
                if share.cancel():
                    rest.read(reader, lo, hi, None, out[lo - start : hi - start])
                else:
                    share.result()
                if self.hasher is not None:
                    self.hasher.update(out_bytes[lo - start : hi - start])
        finally:
            for pending in futures:  # after an error: the shares still running write to `out`
                pending.cancel()
            # (a cancelled share counts as done only once a pool thread has dropped it)
            wait([share for share in futures if not share.cancelled()])


@dataclass(slots=True)
class HandedOff(RowRead):
    """Compressed chunks planned on the calling thread, shard by shard, and each `ShardRun`
    handed to ``runs_to`` to be read and decoded elsewhere (a loader's pipeline; each chunk
    checked against its crc32c there as ``crc`` says, written around the caches with
    ``stream`` as `Streamed` writes): ``out`` is filled once every run has been decoded, not on
    return. Uncompressed rows of all layers are read here, filled on return."""

    runs_to: Callable[[ShardRun], None]
    crc: bool = True
    stream: bool = False

    def read(
        self,
        reader: SegmentReader,
        start: int,
        stop: int,
        layers: Sequence[int] | None,
        out: np.ndarray,
    ) -> None:
        all_layers = _all_layers(reader, layers)
        if reader.raw_rows and all_layers:
            read_raw_rows(reader, start, stop, _out_bytes(out), None)
            return
        rows = _rows_read(reader, start, stop, layers, all_layers, out, None, self.crc, self.stream)
        for first, last in _shard_spans(reader, start, stop):
            self.runs_to(rows.plan(first, last))


# The reads that hold no state of their own, made once (a batch makes one read per sample).
CHUNK_CHECKED, CHUNKS_UNCHECKED = ChunkChecked(True), ChunkChecked(False)
STREAMED, STREAMED_UNCHECKED = Streamed(True), Streamed(False)


def _checked(crc: bool) -> ChunkChecked:
    return CHUNK_CHECKED if crc else CHUNKS_UNCHECKED


def _all_layers(reader: SegmentReader, layers: Sequence[int] | None) -> bool:
    return layers is None or list(layers) == list(range(reader.manifest.num_layers))


def _out_bytes(out: np.ndarray) -> np.ndarray:
    return out.reshape(out.shape[0], -1).view(np.uint8)


def _decode_here(
    reader: SegmentReader,
    start: int,
    stop: int,
    layers: Sequence[int] | None,
    out: np.ndarray,
    hasher: xxhash.xxh3_64 | None,
    crc: bool,
    *,
    stream: bool,
) -> None:
    """Rows [start, stop) decoded on this thread, shard by shard (`RowsRead.decode_chunks`)."""
    all_layers = _all_layers(reader, layers)
    if reader.raw_rows and all_layers:
        read_raw_rows(reader, start, stop, _out_bytes(out), hasher)
        return
    rows = _rows_read(reader, start, stop, layers, all_layers, out, hasher, crc, stream)
    for first, last in _shard_spans(reader, start, stop):
        rows.decode_chunks(first, last)


def _rows_read(
    reader: SegmentReader,
    start: int,
    stop: int,
    layers: Sequence[int] | None,
    all_layers: bool,
    out: np.ndarray,
    hasher: xxhash.xxh3_64 | None,
    crc: bool,
    stream: bool,
) -> RowsRead:
    """The compressed read of rows [start, stop) of ``layers`` (``all_layers``: all of them, in
    order) into ``out``: for each layer chunk, the positions in ``out`` of the wanted layers it
    holds."""
    man = reader.manifest
    lpc = man.layout.layers_per_chunk
    whole_rows = all_layers and lpc == man.num_layers
    by_chunk: dict[int, list[tuple[int, int]]] = {}
    for pos, layer in enumerate(range(man.num_layers) if layers is None else layers):
        by_chunk.setdefault(layer // lpc, []).append((pos, layer % lpc))
    return RowsRead(reader, start, stop, by_chunk, out, _out_bytes(out), hasher, crc, whole_rows,
                    stream=stream)  # fmt: skip


def _shard_spans(reader: SegmentReader, start: int, stop: int) -> Iterator[tuple[int, int]]:
    """The first and last row chunk of rows [start, stop) in each shard, in order."""
    layout = reader.manifest.layout
    rpc, cps = layout.rows_per_chunk, layout.chunks_per_shard
    c, last = start // rpc, (stop - 1) // rpc
    while c <= last:
        end = min(last, (c // cps + 1) * cps - 1)
        yield c, end
        c = end + 1


def shares_of(reader: SegmentReader, start: int, stop: int, threads: int) -> list[tuple[int, int]]:
    """Rows [start, stop) cut at chunk boundaries into at most ``threads`` runs of nearly
    equal numbers of chunks, each decoding at least `PARALLEL_MIN_BYTES`."""
    rpc = reader.manifest.layout.rows_per_chunk
    first, last = start // rpc, (stop - 1) // rpc
    n = last - first + 1
    k = min(threads, n, (stop - start) * reader.row_bytes_chunk // PARALLEL_MIN_BYTES)
    if k < 2:
        return [(start, stop)]
    bounds = [first + n * s // k for s in range(k + 1)]
    return [(max(start, bounds[s] * rpc), min(stop, bounds[s + 1] * rpc)) for s in range(k)]


class _ReadPool:
    """The process's threads that decode shares of one sample's chunks beside the caller.

    One pool for all datasets, created on first use and again in a forked child (a parent's
    threads, and the state of its lock, do not carry over); it grows to the largest number of
    helpers asked for. Its threads only decode and never wait on other tasks, and a caller
    decodes itself any share still queued when it gets there, so any number of callers may
    share it.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._pool: ThreadPoolExecutor | None = None
        self._size = 0

    def get(self, helpers: int) -> ThreadPoolExecutor:
        with self._lock:
            if self._pool is None or self._size < helpers:
                if self._pool is not None:
                    self._pool.shutdown(wait=False)  # running shares finish; new ones go here
                self._pool = ThreadPoolExecutor(helpers, thread_name_prefix="hsstore-read")
                self._size = helpers
            return self._pool

    def forget(self) -> None:
        """In a forked child: start afresh."""
        self.__init__()  # type: ignore[misc]


_READ_POOL = _ReadPool()
if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_READ_POOL.forget)
