"""Reading one segment: Zarr v3 arrays of states and token columns + a Parquet index.

Readers decode shard files directly: they read the shard index once, then only the chunks that
hold the rows asked for, into buffers the caller provides. `check_shard` re-reads a whole shard
for `verify`. Writing a segment is `hsstore.segment_writer`.
"""

from __future__ import annotations

import json
import os
import threading
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import xxhash

from hsstore.errors import FormatError, HsstoreError, IntegrityError
from hsstore.format import paths
from hsstore.format.codecs import ChunkCodec, crc32c
from hsstore.format.manifest import Manifest, SegmentInfo
from hsstore.format.sample_index import INDEX_SCHEMA
from hsstore.format.segment_layout import CRC_BYTES, EMPTY, ShardIndex, decode_column
from hsstore.format.store import Storage

# Decode buffers are per thread and shared by every segment reader, so a reading thread holds
# about two chunks of scratch however many segments it has touched.
_THREAD_SCRATCH = threading.local()

# A sample's read is split between threads only where each share decodes at least this much:
# handing a share to a pool thread costs tens of microseconds, a MiB decodes in about 0.5 ms.
PARALLEL_MIN_BYTES = 1 << 20


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


@dataclass
class ChunkProblem:
    chunk: tuple[int, int]  # (row chunk within the segment, layer chunk)
    rows: tuple[int, int]  # the segment rows [lo, hi) it holds
    reason: str


@dataclass
class ShardCheck:
    """What `SegmentReader.check_shard` found in one shard file."""

    shard: int
    rows: tuple[int, int]  # the segment rows [lo, hi) the shard holds
    nbytes: int = 0  # bytes read
    error: str | None = None  # the whole shard is unusable (missing, truncated, bad index)
    chunks: list[ChunkProblem] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return self.error is None and not self.chunks


class SegmentReader:
    """Reads rows of one committed segment; thread-safe, buffers reused per thread."""

    def __init__(self, storage: Storage, manifest: Manifest, info: SegmentInfo):
        self.storage = storage
        self.manifest = manifest
        self.info = info
        self._codec = ChunkCodec(manifest.codec, manifest.storage_dtype.itemsize)
        self._shard_indexes: dict[int, np.ndarray] = {}
        self._columns: dict[str, np.ndarray] = {}
        self._lock = threading.Lock()
        layout = manifest.layout
        self._n_layer_chunks = manifest.num_layers // layout.layers_per_chunk
        self._row_bytes_chunk = (
            layout.layers_per_chunk * manifest.hidden_size * manifest.storage_dtype.itemsize
        )

    def _key(self, relpath: str) -> str:
        return paths.segment_file(self.info.id, relpath)

    def where(self, relpath: str) -> str:
        return self.storage.path_of(self._key(relpath))

    def read_small(self, relpath: str) -> bytes:
        """A small file, checked against the size and crc32c the manifest recorded."""
        expected = self.info.files.get(relpath)
        where = self.where(relpath)
        if expected is None:
            raise FormatError("file is not listed in the manifest", path=where)
        try:
            data = self.storage.read_bytes(self._key(relpath))
        except FileNotFoundError as exc:
            raise IntegrityError("committed file is missing", path=where) from exc
        if len(data) != expected.size:
            raise IntegrityError(
                f"file has {len(data)} bytes, manifest says {expected.size}", path=where
            )
        if expected.crc32c is not None and crc32c(data) != expected.crc32c:
            raise IntegrityError("crc32c mismatch (corrupted bytes)", path=where)
        return data

    def index(self) -> pa.Table:
        # ParquetFile, read on this thread: pq.read_table goes through pyarrow.dataset, whose
        # fragments can be released later on an Arrow pool thread; one holding our Python
        # buffer at interpreter exit aborts the process (it cannot take the GIL any more).
        with pq.ParquetFile(pa.BufferReader(self.read_small(paths.INDEX))) as index_file:
            table = index_file.read(use_threads=False)
        if not table.schema.equals(INDEX_SCHEMA, check_metadata=False):
            raise FormatError("index has an unexpected schema", path=self.where(paths.INDEX))
        self._check_rows(table)
        return table

    def _check_rows(self, table: pa.Table) -> None:
        """Every sample's rows lie inside the segment's arrays, one after another (on chunk
        boundaries in a sample-aligned layout): an index that points elsewhere would return
        other samples' states, or padding, as this sample's."""
        starts = table.column("row_offset").to_numpy()
        lengths = table.column("num_tokens").to_numpy()
        ends = starts + lengths
        layout = self.manifest.layout
        problem = None
        if len(starts) and (starts[0] != 0 or np.any(lengths < 1)):
            problem = "samples must start at row 0 and have at least one token"
        elif len(starts) > 1 and np.any(starts[1:] < ends[:-1]):
            problem = "samples overlap"
        elif len(starts) and ends[-1] != self.info.num_rows:
            problem = f"samples end at row {ends[-1]}, the arrays have {self.info.num_rows}"
        elif int(lengths.sum()) != self.info.num_tokens:
            problem = (
                f"samples hold {int(lengths.sum())} tokens, manifest says {self.info.num_tokens}"
            )
        elif layout.sample_aligned and np.any(starts % layout.rows_per_chunk):
            problem = "a sample does not start on a chunk boundary of the aligned layout"
        elif not layout.sample_aligned and np.any(starts[1:] != ends[:-1]):
            problem = "samples leave gaps in a layout without alignment"
        if problem:
            raise IntegrityError(
                f"index rows are inconsistent: {problem}", path=self.where(paths.INDEX)
            )

    def salvage_sample_ids(self) -> list[str]:
        """The sample ids a damaged index still yields (its sample_id column, if that part
        decodes), so a report can name what the damage affects; [] when nothing is readable."""
        try:
            data = self.storage.read_bytes(self._key(paths.INDEX))
            with pq.ParquetFile(pa.BufferReader(data)) as index_file:
                column = index_file.read(columns=["sample_id"], use_threads=False)
            return [str(x) for x in column.column("sample_id").to_pylist()]
        except Exception:  # damaged Parquet fails in many ways; salvage is best effort
            return []

    def stats(self) -> dict:
        return json.loads(self.read_small(paths.STATS))

    def column(self, name: str) -> np.ndarray:
        """A whole per-token column of this segment (decoded once, then cached)."""
        arr = self._columns.get(name)
        if arr is not None:
            return arr
        relpath = paths.column_relpath(name)
        dtype = np.dtype(self.manifest.columns[name]).newbyteorder("<")
        arr = decode_column(self.read_small(relpath), dtype, where=self.where(relpath))
        if arr.shape[0] != self.info.num_rows:
            raise IntegrityError(
                f"column has {arr.shape[0]} rows, expected {self.info.num_rows}",
                path=self.where(relpath),
            )
        self._columns[name] = arr
        return arr

    def shard_index(self, shard: int) -> ShardIndex:
        idx = self._shard_indexes.get(shard)
        if idx is not None:
            return idx
        with self._lock:
            idx = self._shard_indexes.get(shard)
            if idx is None:
                idx = self._load_shard_index(shard)
                self._shard_indexes[shard] = idx
        return idx

    def _load_shard_index(self, shard: int) -> ShardIndex:
        relpath = paths.shard_relpath(shard)
        size = self._shard_size(shard)
        nbytes = self._index_nbytes
        buf = memoryview(bytearray(nbytes))
        (got,) = self.storage.read_ranges(self._key(relpath), [(size - nbytes, nbytes)], [buf])
        if len(got) != nbytes:
            raise IntegrityError("shard index is truncated", path=self.where(relpath))
        return self._parse_shard_index(buf, size - nbytes, self.where(relpath))

    @property
    def _index_nbytes(self) -> int:
        return ShardIndex.nbytes(self.manifest.layout.chunks_per_shard, self._n_layer_chunks)

    def _shard_size(self, shard: int) -> int:
        """The shard's size on storage, checked against the manifest."""
        relpath = paths.shard_relpath(shard)
        where = self.where(relpath)
        expected = self.info.files.get(relpath)
        if expected is None:
            raise IntegrityError(f"shard {shard} is not listed in the manifest", path=where)
        try:
            size = self.storage.size(self._key(relpath))
        except FileNotFoundError as exc:
            raise IntegrityError("committed shard file is missing", path=where) from exc
        except FormatError as exc:  # a FIFO or device where the shard belongs
            raise IntegrityError(exc.message, path=where) from exc
        if size != expected.size:
            raise IntegrityError(
                f"shard has {size} bytes, manifest says {expected.size} (truncated?)", path=where
            )
        if size < self._index_nbytes:
            raise IntegrityError("shard is shorter than its index", path=where)
        return size

    def _parse_shard_index(self, raw: memoryview, data_end: int, where: str) -> ShardIndex:
        compressed = self.manifest.codec.compressed
        return ShardIndex.decode(
            raw,
            data_end,
            chunks_per_shard=self.manifest.layout.chunks_per_shard,
            layer_chunks=self._n_layer_chunks,
            raw_chunk_nbytes=None if compressed else self.manifest.chunk_nbytes + CRC_BYTES,
            where=where,
        )

    def check_shard(self, shard: int) -> ShardCheck:
        """Re-read one whole shard: its size, index, and every chunk's crc32c and decoded size.
        Never raises for damage; the result names the rows each problem affects."""
        layout = self.manifest.layout
        lo = shard * layout.rows_per_shard
        report = ShardCheck(shard, (lo, min(lo + layout.rows_per_shard, self.info.num_rows)))
        relpath = paths.shard_relpath(shard)
        where = self.where(relpath)
        try:
            size = self._shard_size(shard)
            data = memoryview(self.storage.read_bytes(self._key(relpath)))
            report.nbytes = len(data)
            if len(data) != size:
                raise IntegrityError("shard changed size while being read", path=where)
            idx = self._parse_shard_index(
                data[size - self._index_nbytes :], size - self._index_nbytes, where
            )
        except IntegrityError as exc:
            report.error = exc.message
            return report
        except OSError as exc:  # unreadable (permissions, I/O error): damage all the same
            report.error = f"cannot read shard ({exc.strerror or exc})"
            return report
        rpc = layout.rows_per_chunk
        for local in range(layout.chunks_per_shard):
            c = shard * layout.chunks_per_shard + local
            rows = (c * rpc, min((c + 1) * rpc, self.info.num_rows))
            for j in range(self._n_layer_chunks):
                offset, nbytes = idx.chunk(local, j)
                if offset == EMPTY:
                    if rows[0] < rows[1]:
                        report.chunks.append(
                            ChunkProblem((c, j), rows, "chunk of committed rows is missing")
                        )
                    continue
                try:
                    self._codec.check(
                        data[offset : offset + nbytes], self.manifest.chunk_nbytes, what=where
                    )
                except HsstoreError as exc:
                    report.chunks.append(ChunkProblem((c, j), rows, exc.message))
        return report

    def _scratch(self, name: str, nbytes: int) -> memoryview:
        bufs = getattr(_THREAD_SCRATCH, "bufs", None)
        if bufs is None:
            bufs = _THREAD_SCRATCH.bufs = {}
        buf = bufs.get(name)
        if buf is None or len(buf) < nbytes:
            buf = bufs[name] = np.empty(max(nbytes, 1), dtype=np.uint8)
        return memoryview(buf)[:nbytes]

    def read_rows(
        self,
        start: int,
        stop: int,
        layers: Sequence[int] | None,
        out: np.ndarray,
        *,
        hasher: xxhash.xxh3_64 | None = None,
        crc: bool | None = None,
        threads: int = 1,
    ) -> None:
        """Decode rows [start, stop) of the given stored layers into ``out`` [n, len(layers), H].

        ``out`` is a C-contiguous array of the storage dtype. ``layers=None`` means all layers.
        With a ``hasher`` (all layers only), every piece placed in ``out`` is fed to it in order
        right after it lands, while it is still in cache (the sample checksum costs no extra
        pass over memory). ``crc``: check each chunk's crc32c; by default only without a
        ``hasher``, whose checksum covers the same bytes once decoded.

        ``threads`` > 1: compressed rows of all layers are cut into up to that many shares of
        whole chunks (at least `PARALLEL_MIN_BYTES` of decoded bytes each), decoded at once,
        the first by this thread, so one read of a large sample keeps several cores decoding.
        """
        man = self.manifest
        layout = man.layout
        rpc, lpc, cps = layout.rows_per_chunk, layout.layers_per_chunk, layout.chunks_per_shard
        all_layers = layers is None or list(layers) == list(range(man.num_layers))
        whole_rows = all_layers and lpc == man.num_layers
        out_bytes = out.reshape(out.shape[0], -1).view(np.uint8)
        if hasher is not None and not all_layers:
            raise FormatError("a sample checksum covers all layers")
        if whole_rows and not man.codec.compressed:
            self._read_raw_rows(start, stop, out_bytes, hasher)
            return
        if crc is None:
            crc = hasher is None
        if threads > 1 and whole_rows:
            shares = self._shares(start, stop, threads)
            if len(shares) > 1:
                self._read_shares(shares, out, out_bytes, hasher, crc)
                return
        wanted = range(man.num_layers) if layers is None else layers
        by_chunk: dict[int, list[tuple[int, int]]] = {}
        for pos, layer in enumerate(wanted):
            by_chunk.setdefault(layer // lpc, []).append((pos, layer % lpc))
        read = _RowsRead(self, start, stop, by_chunk, out, out_bytes, hasher, crc, whole_rows)
        c, last = start // rpc, (stop - 1) // rpc
        while c <= last:  # shard by shard
            end = min(last, (c // cps + 1) * cps - 1)
            read.decode_chunks(c, end)
            c = end + 1

    def will_read_rows(
        self, starts: np.ndarray, stops: np.ndarray, layers: Sequence[int] | None
    ) -> None:
        """Rows [starts[k], stops[k]) of the given stored layers (None: all) are about to be
        read: hand the storage the bytes of their chunks, shard by shard, so that reads from
        disk are under way before the decoding gets to them (`Storage.will_read`)."""
        if not len(starts):
            return
        layout = self.manifest.layout
        rpc, lpc, cps = layout.rows_per_chunk, layout.layers_per_chunk, layout.chunks_per_shard
        first = np.asarray(starts, np.int64) // rpc
        counts = (np.asarray(stops, np.int64) - 1) // rpc - first + 1
        # Every row chunk of every run: first[k], first[k] + 1, ... for counts[k] chunks.
        ends = np.cumsum(counts)
        chunks = np.unique(np.arange(ends[-1]) - np.repeat(ends - counts - first, counts))
        wanted = range(self.manifest.num_layers) if layers is None else layers
        layer_chunks = sorted({layer // lpc for layer in wanted})
        for shard in np.unique(chunks // cps).tolist():
            in_shard = chunks[chunks // cps == shard] - shard * cps
            key = self._key(paths.shard_relpath(shard))
            try:
                self.storage.will_read(
                    key, self.shard_index(shard).byte_ranges(in_shard, layer_chunks)
                )
            except (HsstoreError, OSError):
                continue  # a hint fails nothing: the read that needs these bytes reports it

    def _shares(self, start: int, stop: int, threads: int) -> list[tuple[int, int]]:
        """Rows [start, stop) cut at chunk boundaries into at most ``threads`` runs of nearly
        equal numbers of chunks, each decoding at least `PARALLEL_MIN_BYTES`."""
        rpc = self.manifest.layout.rows_per_chunk
        first, last = start // rpc, (stop - 1) // rpc
        n = last - first + 1
        k = min(threads, n, (stop - start) * self._row_bytes_chunk // PARALLEL_MIN_BYTES)
        if k < 2:
            return [(start, stop)]
        bounds = [first + n * s // k for s in range(k + 1)]
        return [(max(start, bounds[s] * rpc), min(stop, bounds[s + 1] * rpc)) for s in range(k)]

    def _read_shares(
        self,
        shares: list[tuple[int, int]],
        out: np.ndarray,
        out_bytes: np.ndarray,
        hasher: xxhash.xxh3_64 | None,
        crc: bool,
    ) -> None:
        """Decode all layers of each share of rows, the first here and the others on the read
        pool; feed the ``hasher`` the shares in row order, each as it is done.

        A share no pool thread has started by the time this thread gets to it is taken back and
        decoded here: when many callers read at once and keep the pool busy, each does its own
        work instead of waiting in the pool's queue."""
        start = shares[0][0]
        pool = _READ_POOL.get(len(shares) - 1)
        futures: list[Future[None]] = [
            pool.submit(self.read_rows, lo, hi, None, out[lo - start : hi - start], crc=crc)
            for lo, hi in shares[1:]
        ]
        try:
            lo, hi = shares[0]
            self.read_rows(lo, hi, None, out[: hi - start], hasher=hasher, crc=crc)
            for (lo, hi), share in zip(shares[1:], futures, strict=True):
                if share.cancel():
                    self.read_rows(lo, hi, None, out[lo - start : hi - start], crc=crc)
                else:
                    share.result()
                if hasher is not None:
                    hasher.update(out_bytes[lo - start : hi - start])
        finally:
            for pending in futures:  # after an error: the shares still running write to `out`
                pending.cancel()
            # (a cancelled share counts as done only once a pool thread has dropped it)
            wait([share for share in futures if not share.cancelled()])

    def _read_raw_rows(
        self, start: int, stop: int, out_bytes: np.ndarray, hasher: xxhash.xxh3_64 | None
    ) -> None:
        """Uncompressed, all layers: a chunk is its rows then a 4-byte crc32c, so the wanted
        rows of each chunk are one byte range of the shard, read straight into ``out`` (the
        storage reads ranges that lie nearly back to back together). The whole-sample checksum
        verifies the bytes, since a partial chunk cannot be checked against its crc."""
        layout = self.manifest.layout
        rpc, cps, rb = layout.rows_per_chunk, layout.chunks_per_shard, self._row_bytes_chunk
        c, last = start // rpc, (stop - 1) // rpc
        while c <= last:  # shard by shard
            shard = c // cps
            end = min(last, (shard + 1) * cps - 1)
            key = self._key(paths.shard_relpath(shard))
            ranges, into = [], []
            for local, _, offset, _ in self.shard_index(shard).chunks(
                c - shard * cps, end - shard * cps, [0]
            ):
                crow0 = (shard * cps + local) * rpc
                if offset == EMPTY:
                    raise IntegrityError(
                        f"chunk ({crow0 // rpc}, 0) of committed rows is missing",
                        path=self.storage.path_of(key),
                    )
                lo, hi = max(start, crow0), min(stop, crow0 + rpc)
                ranges.append((offset + (lo - crow0) * rb, (hi - lo) * rb))
                into.append(memoryview(out_bytes[lo - start : hi - start]).cast("B"))
            for (_, nbytes), got in zip(
                ranges, self.storage.read_ranges(key, ranges, into), strict=True
            ):
                if len(got) != nbytes:
                    raise IntegrityError("shard is truncated", path=self.storage.path_of(key))
                if hasher is not None:
                    hasher.update(got)
            c = end + 1


class _RowsRead:
    """One compressed `SegmentReader.read_rows` call: its chunks decoded shard by shard, each
    as its bytes arrive from the storage (`Storage.read_ranges`), into ``out`` or, for a chunk
    only part of whose rows or layers are wanted, into this thread's scratch and copied from
    there. Per-chunk work is kept to the decode itself: shard state is looked up once per
    shard, and the location string of a chunk is only built for an error."""

    def __init__(
        self,
        reader: SegmentReader,
        start: int,
        stop: int,
        by_chunk: dict[int, list[tuple[int, int]]],
        out: np.ndarray,
        out_bytes: np.ndarray,
        hasher: xxhash.xxh3_64 | None,
        crc: bool,
        whole_rows: bool,
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
        self.chunk_nbytes = self.rpc * reader._row_bytes_chunk

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

    def decode_chunks(self, first: int, last: int) -> None:
        """Row chunks ``first..last``, all in one shard."""
        reader, rpc, start, stop = self.reader, self.rpc, self.start, self.stop
        man = reader.manifest
        shard = first // self.cps
        base = shard * self.cps
        key = reader._key(paths.shard_relpath(shard))
        where = reader.storage.path_of(key)
        plan = reader.shard_index(shard).chunks(first - base, last - base, list(self.by_chunk))
        for local, j, offset, _ in plan:
            if offset == EMPTY:
                raise IntegrityError(
                    f"chunk ({base + local}, {j}) of committed rows is missing", path=where
                )
        reuse = self._reusable(plan, base)
        views = reader.storage.read_ranges(
            key, [(offset, nbytes) for k, (_, _, offset, nbytes) in enumerate(plan) if k != reuse]
        )
        last_j = plan[-1][1]
        for k, (local, j, _, nbytes) in enumerate(plan):
            c = base + local
            crow0 = c * rpc
            lo, hi = max(start, crow0), min(stop, crow0 + rpc)
            whole = self.whole_rows and lo == crow0 and hi == crow0 + rpc
            if k != reuse:
                encoded = next(views)
                if len(encoded) != nbytes:
                    raise IntegrityError("shard is truncated", path=where)
                if whole:
                    dst = self.flat[(lo - start) * self.rb : (hi - start) * self.rb]
                else:
                    _THREAD_SCRATCH.decoded = None
                    dst = reader._scratch("chunk", self.chunk_nbytes)
                try:
                    # The sample checksum, when it is verified, covers the decoded bytes: the
                    # chunk crc would check the same bytes a second time.
                    reader._codec.decode_into(encoded, dst, what=where, crc=self.crc)
                except IntegrityError as exc:
                    raise IntegrityError(exc.message, path=f"{where} chunk ({c}, {j})") from None
                if not whole:
                    _THREAD_SCRATCH.decoded = (reader, c, j, self.crc)
            if not whole:
                chunk = np.frombuffer(
                    reader._scratch("chunk", self.chunk_nbytes), man.storage_dtype
                )
                rows = chunk.reshape(rpc, self.lpc, man.hidden_size)[lo - crow0 : hi - crow0]
                if self.whole_rows:
                    self.out[lo - start : hi - start] = rows
                else:
                    for pos, within in self.by_chunk[j]:
                        self.out[lo - start : hi - start, pos] = rows[:, within]
            if self.hasher is not None and j == last_j:
                self.hasher.update(self.flat[(lo - start) * self.rb : (hi - start) * self.rb])
        for _ in views:  # none left: this ends the read, and the storage releases what it held
            pass
