"""Decoding rows of one segment's states: what the read strategies of
`hsstore.segment.row_reads` do for each shard, compressed chunk by chunk or, uncompressed,
straight into the caller's buffer (a batch's samples together: `RawSamplesRead`)."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from typing import NoReturn, Protocol

import numpy as np
import xxhash

from hsstore.codec.codecs import ChunkCodec
from hsstore.errors import HsstoreError, IntegrityError
from hsstore.spec import paths
from hsstore.spec.manifest import Manifest
from hsstore.spec.segment_layout import EMPTY, ShardIndex, raw_rows_range
from hsstore.storage.damage import read_ranges_into_io, read_ranges_io
from hsstore.storage.store import Storage

# How many bytes of a batch's small uncompressed samples one `Storage.read_many_into` call
# reads: few calls, yet threads sharing a batch each take a fair part of it. Reads handed to a
# thread of their own go in larger calls: each hand-off waits for the interpreter lock the
# planning thread holds.
READ_MANY_BYTES = 4 << 20
HANDED_OFF_READ_BYTES = 16 << 20
# Decode buffers are per thread and shared by every segment reader, so a reading thread holds
# about two chunks of scratch however many segments it has touched.
_THREAD_SCRATCH = threading.local()


class ShardSource(Protocol):
    """What reading rows needs of a segment's reader (`hsstore.segment.reader.SegmentReader`)."""

    storage: Storage
    manifest: Manifest
    codec: ChunkCodec
    row_bytes_chunk: int  # bytes of one row of one layer chunk

    def key(self, relpath: str) -> str: ...

    def shard_index(self, shard: int) -> ShardIndex: ...


def scratch(name: str, nbytes: int) -> memoryview:
    """This thread's buffer ``name``, at least ``nbytes`` long (grown as needed)."""
    bufs = getattr(_THREAD_SCRATCH, "bufs", None)
    if bufs is None:
        bufs = _THREAD_SCRATCH.bufs = {}
    buf = bufs.get(name)
    if buf is None or len(buf) < nbytes:
        buf = bufs[name] = np.empty(max(nbytes, 1), dtype=np.uint8)
    return memoryview(buf)[:nbytes]


def raw_rows_plan(
    reader: ShardSource, start: int, stop: int
) -> list[tuple[str, list[tuple[int, int]]]]:
    """Uncompressed, all layers: per shard, its key and the byte ranges that hold rows
    [start, stop), one per chunk (`raw_rows_range`); read in order, back to back, they are the
    rows' bytes. On small samples this runs once per sample of a batch, so the per-shard work
    is kept to plain integers."""
    layout = reader.manifest.layout
    rpc, cps, rb = layout.rows_per_chunk, layout.chunks_per_shard, reader.row_bytes_chunk
    plan = []
    c, last = start // rpc, (stop - 1) // rpc
    while c <= last:  # shard by shard
        shard = c // cps
        base = shard * cps
        end = min(last, base + cps - 1)
        key = reader.key(paths.shard_relpath(shard))
        ranges = []
        for offset in reader.shard_index(shard).offsets(c - base, end - base):
            crow0 = c * rpc
            if offset == EMPTY:
                raise IntegrityError(
                    f"chunk ({c}, 0) of committed rows is missing", path=reader.storage.path_of(key)
                )
            lo, hi = max(start, crow0), min(stop, crow0 + rpc)
            ranges.append(raw_rows_range(offset, lo - crow0, hi - lo, rb))
            c += 1
        plan.append((key, ranges))
    return plan


def read_raw_rows(
    reader: ShardSource, start: int, stop: int, out_bytes: np.ndarray, hasher: xxhash.xxh3_64 | None
) -> None:
    """Uncompressed, all layers: the rows' byte ranges (`raw_rows_plan`) read straight into
    ``out`` (the storage reads ranges that lie nearly back to back together). The
    whole-sample checksum verifies the bytes, since a partial chunk cannot be checked against
    its crc."""
    flat = memoryview(out_bytes).cast("B")
    at = 0
    for key, ranges in raw_rows_plan(reader, start, stop):
        into = []
        for _, nbytes in ranges:
            into.append(flat[at : at + nbytes])
            at += nbytes
        got = read_ranges_into_io(reader.storage, key, ranges, into)
        for (_, nbytes), view in zip(ranges, got, strict=True):
            if len(view) != nbytes:
                raise IntegrityError("shard is truncated", path=reader.storage.path_of(key))
            if hasher is not None:
                hasher.update(view)


class RawSamplesRead:
    """Whole samples of uncompressed segments, planned into the rows of one batch (``out``,
    a C-contiguous array of the storage dtype, rows first) until a few MiB are (`add`), then
    read in one `Storage.read_many_into` call (`read`), here or, handed to ``runs_to``, on
    another thread (`flush`): on small samples, reading them one by one costs as much again as
    the copy. A sample whose bytes did not all arrive is read again on its own
    (``read_one(i, row)``, under the rules of a single sample's read), which raises the error
    that names its problem or, the problem gone, reads it. Their checksums are the caller's
    (`hsstore.dataset.sample_checks.check_samples`): hashing each sample as it lands, while it is in
    cache, is the single sample's read."""

    __slots__ = ("storage", "out", "read_one", "runs_to", "reads", "samples", "nbytes")

    def __init__(
        self,
        storage: Storage,
        out: np.ndarray,
        read_one: Callable[[int, int], None],
        runs_to: Callable[[PlannedRead], None] | None = None,
    ):
        self.storage, self.out, self.read_one, self.runs_to = storage, out, read_one, runs_to
        self.reads: list[tuple[str, int, int, int]] = []
        self.samples: list[tuple[int, int, int]] = []  # (i, row, its first read)
        self.nbytes = 0

    def add(self, reader: ShardSource, start: int, stop: int, i: int, row: int) -> bool:
        """Plan sample ``i`` (rows [start, stop) of ``reader``'s segment) to land at ``row``;
        True once enough is planned to `flush`."""
        try:
            plan = raw_rows_plan(reader, start, stop)
        except (HsstoreError, OSError):
            self.read_one(i, row)  # raises what is wrong, naming the sample
            plan = []
        self.samples.append((i, row, len(self.reads)))
        at = row * self.out.strides[0]
        for key, ranges in plan:
            for offset, nbytes in ranges:
                self.reads.append((key, offset, nbytes, at))
                self.nbytes += nbytes
                at += nbytes
        return self.nbytes >= (READ_MANY_BYTES if self.runs_to is None else HANDED_OFF_READ_BYTES)

    def flush(self) -> RawSamplesRead:
        """`read` what is planned here, or hand it to ``runs_to`` to be read there; returns an
        empty read of the same batch for what comes next."""
        if self.samples and self.runs_to is not None:
            self.runs_to(self)
        elif self.samples:
            self.read()
        return RawSamplesRead(self.storage, self.out, self.read_one, self.runs_to)

    def read(self) -> list[tuple[int, int]]:
        """Read what is planned (a sample whose bytes did not all arrive read alone); returns
        ``(i, row)`` of the samples read."""
        flat = memoryview(self.out).cast("B")
        whole = self.storage.read_many_into(self.reads, flat) if self.reads else 0
        ends = [first for _, _, first in self.samples[1:]] + [len(self.reads)]
        for (i, row, _), end in zip(self.samples, ends):
            if end > whole:
                self.read_one(i, row)
        return [(i, row) for i, row, _ in self.samples]


class RowsRead:
    """One compressed read of rows (`hsstore.segment.row_reads`): its chunks decoded shard by
    shard, each as its bytes arrive from the storage (`Storage.read_ranges`), into ``out`` or,
    for a chunk only part of whose rows or layers are wanted, into this thread's scratch and
    copied from there. Per-chunk work is kept to the decode itself: shard state is looked up
    once per shard, and the location string of a chunk is only built for an error."""

    def __init__(
        self,
        reader: ShardSource,
        start: int,
        stop: int,
        by_chunk: dict[int, list[tuple[int, int]]],
        out: np.ndarray,
        out_bytes: np.ndarray,
        hasher: xxhash.xxh3_64 | None,
        crc: bool,
        whole_rows: bool,
        *,
        stream: bool = False,
    ):
        self.reader, self.start, self.stop, self.by_chunk = reader, start, stop, by_chunk
        self.out, self.flat, self.rb = out, out_bytes.reshape(-1), out_bytes.shape[1]
        self.hasher, self.crc, self.whole_rows = hasher, crc, whole_rows
        layout = reader.manifest.layout
        self.rpc, self.lpc, self.cps = (
            layout.rows_per_chunk,
            layout.layers_per_chunk,
            layout.chunks_per_shard,
        )
        self.chunk_nbytes = self.rpc * reader.row_bytes_chunk
        # Whole chunks go to ``out`` around the caches (`ChunkCodec.decode_into`): for an
        # ``out`` nothing reads again soon (no hasher here, a loader's batch).
        self.stream = stream

    def _whole(self, c: int) -> bool:
        """Whether chunk ``c`` decodes straight into ``out`` (all its rows and layers wanted)."""
        crow0 = c * self.rpc
        return self.whole_rows and self.start <= crow0 and crow0 + self.rpc <= self.stop

    def _reusable(self, plan: list[tuple[int, int, int, int]], base: int) -> int:
        """Which entry of ``plan`` this thread's scratch holds decoded already, or -1.

        A chunk cut by a sample boundary is usually needed again by the neighbouring sample:
        the thread's scratch keeps the last one decoded (chunks never change), with whether its
        crc was checked (a read without a sample checksum needs that). Chunks decoded straight
        into ``out`` leave the scratch alone, so only the first chunk that goes through it can
        find it holding the chunk it wants."""
        cached = getattr(_THREAD_SCRATCH, "decoded", None)
        if cached is None or cached[0] is not self.reader:
            return -1
        candidates = (0, len(plan) - 1) if self.whole_rows else (0,)
        for k in candidates:
            local, j = plan[k][0], plan[k][1]
            if not self._whole(base + local):
                key = (self.reader, base + local, j)
                return k if cached in ((*key, True), (*key, self.crc)) else -1
        return -1

    def plan(self, first: int, last: int) -> ShardRun:
        """Row chunks ``first..last``, all in one shard, planned: which bytes to read and
        where each chunk lands, checked against the shard's index."""
        reader = self.reader
        shard = first // self.cps
        base = shard * self.cps
        key = reader.key(paths.shard_relpath(shard))
        where = reader.storage.path_of(key)
        plan = reader.shard_index(shard).chunks(first - base, last - base, list(self.by_chunk))
        for local, j, offset, _ in plan:
            if offset == EMPTY:
                raise IntegrityError(
                    f"chunk ({base + local}, {j}) of committed rows is missing", path=where
                )
        return ShardRun(self, key, where, base, plan, plan[-1][1])

    def decode_chunks(self, first: int, last: int) -> None:
        """Row chunks ``first..last``, all in one shard, read and decoded here."""
        run = self.plan(first, last)
        reuse = self._reusable(run.plan, run.base)
        ranges = run.ranges
        if reuse >= 0:
            del ranges[reuse]
        views = read_ranges_io(self.reader.storage, run.key, ranges)
        run.decode(views, reuse)
        for _ in views:  # none left: this ends the read, and the storage releases what it held
            pass


class ShardRun:
    """The chunks one `RowsRead` wants of one shard, planned apart from their bytes, so that
    one thread may read them (``ranges``) while another decodes them (`decode`)."""

    __slots__ = ("read", "key", "where", "base", "plan", "last_j", "report")

    def __init__(
        self,
        read: RowsRead,
        key: str,
        where: str,
        base: int,
        plan: list[tuple[int, int, int, int]],
        last_j: int,
    ):
        self.read, self.key, self.where, self.base = read, key, where, base
        self.plan, self.last_j = plan, last_j  # (local row chunk, layer chunk, offset, nbytes)
        # How a failed decode is raised when it runs apart from the read that planned it (the
        # dataset's reader sets it, so that the error names the sample).
        self.report: Callable[[HsstoreError | OSError], NoReturn] | None = None

    @property
    def storage(self) -> Storage:
        return self.read.reader.storage

    @property
    def ranges(self) -> list[tuple[int, int]]:
        """The (offset, nbytes) of each planned chunk, in order."""
        return [(offset, nbytes) for _, _, offset, nbytes in self.plan]

    @property
    def nbytes(self) -> int:
        return sum(nbytes for *_, nbytes in self.plan)

    def split(self, max_bytes: int) -> list[ShardRun]:
        """This run cut into runs of consecutive chunks of at most ``max_bytes`` each (a chunk
        larger than that alone)."""
        parts: list[ShardRun] = []
        lo, size = 0, 0
        for k, (*_, nbytes) in enumerate(self.plan):
            if k > lo and size + nbytes > max_bytes:
                parts.append(self._part(lo, k))
                lo, size = k, 0
            size += nbytes
        parts.append(self._part(lo, len(self.plan)))
        return parts

    def _part(self, lo: int, hi: int) -> ShardRun:
        part = ShardRun(self.read, self.key, self.where, self.base, self.plan[lo:hi], self.last_j)
        part.report = self.report
        return part

    def decode(self, views: Iterator[memoryview], reuse: int = -1) -> None:
        """Decode the planned chunks from ``views`` (their bytes, in order; none for entry
        ``reuse``, which this thread's scratch holds decoded)."""
        if self.report is None:
            return self._decode(views, reuse)
        try:
            return self._decode(views, reuse)
        except (HsstoreError, OSError) as exc:
            self.report(exc)

    def _decode(self, views: Iterator[memoryview], reuse: int) -> None:
        read = self.read
        man = read.reader.manifest
        rpc, start, stop, where, base, last_j = (
            read.rpc, read.start, read.stop, self.where, self.base, self.last_j
        )  # fmt: skip
        flat, rb, whole_rows, hasher, crc, stream = (
            read.flat,
            read.rb,
            read.whole_rows,
            read.hasher,
            read.crc,
            read.stream,
        )
        decode = read.reader.codec.decode_into
        for k, (local, j, _, nbytes) in enumerate(self.plan):
            c = base + local
            crow0 = c * rpc
            lo, hi = max(start, crow0), min(stop, crow0 + rpc)
            whole = whole_rows and lo == crow0 and hi == crow0 + rpc
            placed = flat[(lo - start) * rb : (hi - start) * rb]  # these rows' bytes in ``out``
            if k != reuse:
                encoded = next(views)
                if len(encoded) != nbytes:
                    raise IntegrityError("shard is truncated", path=where)
                if whole:
                    dst = placed
                else:
                    _THREAD_SCRATCH.decoded = None
                    dst = scratch("chunk", read.chunk_nbytes)
                try:
                    # The sample checksum, when it is verified, covers the decoded bytes: the
                    # chunk crc would check the same bytes a second time.
                    decode(encoded, dst, what=where, crc=crc, stream=stream and whole)
                except IntegrityError as exc:
                    raise IntegrityError(exc.message, path=f"{where} chunk ({c}, {j})") from None
                if not whole:
                    _THREAD_SCRATCH.decoded = (read.reader, c, j, crc)
            if not whole:
                chunk = np.frombuffer(scratch("chunk", read.chunk_nbytes), man.storage_dtype)
                rows = chunk.reshape(rpc, read.lpc, man.hidden_size)[lo - crow0 : hi - crow0]
                if whole_rows:
                    read.out[lo - start : hi - start] = rows
                else:
                    for pos, within in read.by_chunk[j]:
                        read.out[lo - start : hi - start, pos] = rows[:, within]
            if hasher is not None and j == last_j:
                hasher.update(placed)


# A read planned on one thread and done on another (a loader's `ChunkPipeline`).
PlannedRead = ShardRun | RawSamplesRead
