"""Writing and reading one segment: Zarr v3 arrays of states and token columns + a Parquet index.

A segment is written by exactly one writer, whole shards at a time (two writers never touch
the same file), and becomes visible only when a manifest that lists it is published. Readers
decode shard files directly: they read the shard index once, then only the chunks that hold
the rows asked for, into buffers the caller provides.
"""

from __future__ import annotations

import contextlib
import functools
import io
import json
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import xxhash
import zstandard

from hsstore.codecs import ChunkCodec, check_crc, crc32c
from hsstore.errors import FormatError, IntegrityError
from hsstore.format import paths, zarr_meta
from hsstore.format.manifest import COLUMN_DTYPES, FileInfo, Manifest, SegmentInfo, now_iso
from hsstore.format.store import Storage
from hsstore.stats import RowFlags, StatsAccumulator

INDEX_SCHEMA = pa.schema(
    [
        pa.field("sample_id", pa.string(), nullable=False),
        pa.field("row_offset", pa.int64(), nullable=False),
        pa.field("num_tokens", pa.int64(), nullable=False),
        pa.field("num_loss_tokens", pa.int64(), nullable=False),
        pa.field("checksum", pa.uint64(), nullable=False),
        pa.field("zero_rows", pa.int32(), nullable=False),
        pa.field("nonfinite_rows", pa.int32(), nullable=False),
        pa.field("source", pa.string(), nullable=True),
    ]
)
_COLUMN_ZSTD_LEVEL = 3


def sample_checksum(hidden: np.ndarray, input_ids: np.ndarray, loss_mask: np.ndarray) -> int:
    """XXH3-64 of a sample's stored bytes: states [T, L, H], then input_ids, then loss_mask."""
    hasher = xxhash.xxh3_64()
    hasher.update(memoryview(np.ascontiguousarray(hidden)).cast("B"))
    return finish_checksum(hasher, input_ids, loss_mask)


def finish_checksum(hasher: xxhash.xxh3_64, input_ids: np.ndarray, loss_mask: np.ndarray) -> int:
    """Finish a sample checksum from a hasher that has seen its states bytes."""
    hasher.update(memoryview(np.ascontiguousarray(input_ids)).cast("B"))
    hasher.update(memoryview(np.ascontiguousarray(loss_mask)).cast("B"))
    return hasher.intdigest()


@dataclass
class _PendingSample:
    sample_id: str
    row_offset: int
    num_tokens: int
    num_loss_tokens: int
    checksum: int
    flags: RowFlags
    source: str | None


class ShardFlusher:
    """Two reusable shard buffers and a background thread that encodes and writes full ones.

    Filling shard n+1 overlaps encoding and writing shard n (whose chunks are encoded in a
    pool of threads); at most one shard is in flight, so memory is two shards per writer.
    Owned by a `Writer` and reused across its segments (fresh memory is slow to first touch).
    """

    def __init__(self, shape: tuple[int, int, int], dtype: np.dtype, encode_threads: int):
        self.shape, self.dtype = shape, dtype
        self._buffers: list[np.ndarray | None] = [np.empty(shape, dtype), None]
        self._current = 0
        self._pool = ThreadPoolExecutor(max_workers=encode_threads)
        self._thread = ThreadPoolExecutor(max_workers=1)
        self._inflight: Future[None] | None = None

    def buffer(self) -> np.ndarray:
        buf = self._buffers[self._current]
        if buf is None:
            buf = self._buffers[self._current] = np.empty(self.shape, self.dtype)
        return buf

    def submit(self, job: Callable[[np.ndarray], None]) -> None:
        """Run ``job(buffer)`` in the background on the buffer just filled; switch buffers."""
        self.wait()
        self._inflight = self._thread.submit(job, self.buffer())
        self._current ^= 1

    def wait(self) -> None:
        """Block until the shard in flight is written; re-raise its error if it failed."""
        inflight, self._inflight = self._inflight, None
        if inflight is not None:
            inflight.result()

    def map(self, fn: Callable[[Any], Any], items: list[Any]) -> list[Any]:
        return list(self._pool.map(fn, items))

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self.wait()
        self._thread.shutdown(wait=True)
        self._pool.shutdown(wait=True)


@dataclass
class SegmentWriter:
    """Fills one segment through the writer's `ShardFlusher`."""

    storage: Storage
    manifest: Manifest
    segment_id: str
    flusher: ShardFlusher
    rows: int = 0
    bytes_written: int = 0
    _rows_in_buffer: int = 0
    _shards_written: int = 0
    _files: dict[str, FileInfo] = field(default_factory=dict)
    _samples: list[_PendingSample] = field(default_factory=list)
    _input_ids: list[np.ndarray] = field(default_factory=list)
    _loss_masks: list[np.ndarray] = field(default_factory=list)

    def __post_init__(self) -> None:
        layout = self.manifest.layout
        self._codec = ChunkCodec(self.manifest.codec, self.manifest.storage_dtype.itemsize)
        self._stats = StatsAccumulator(self.manifest.num_layers, self.manifest.dtype)
        expected = (layout.rows_per_shard, self.manifest.num_layers, self.manifest.hidden_size)
        if self.flusher.shape != expected:
            raise FormatError(f"shard buffer shape {self.flusher.shape} != {expected}")

    @property
    def num_samples(self) -> int:
        return len(self._samples)

    def raw_bytes(self) -> int:
        return (
            self.rows
            * self.manifest.num_layers
            * self.manifest.hidden_size
            * (self.manifest.storage_dtype.itemsize)
        )

    def add(
        self,
        sample_id: str,
        input_ids: np.ndarray,
        loss_mask: np.ndarray,
        hidden: np.ndarray,
        source: str | None,
    ) -> None:
        """Append one validated sample; ``hidden`` is [T, L, H] in the storage dtype."""
        flags = self._stats.update(hidden)
        checksum = sample_checksum(hidden, input_ids, loss_mask)
        t = hidden.shape[0]
        self._samples.append(
            _PendingSample(sample_id, self.rows, t, int(loss_mask.sum()), checksum, flags, source)
        )
        self._input_ids.append(input_ids)
        self._loss_masks.append(loss_mask)
        done = 0
        cap = self.flusher.shape[0]
        while done < t:
            n = min(t - done, cap - self._rows_in_buffer)
            buf = self.flusher.buffer()
            buf[self._rows_in_buffer : self._rows_in_buffer + n] = hidden[done : done + n]
            self._rows_in_buffer += n
            done += n
            if self._rows_in_buffer == cap:
                self._flush_shard()
        self.rows += t

    def _flush_shard(self) -> None:
        job = functools.partial(self._write_shard, self._rows_in_buffer, self._shards_written)
        self.flusher.submit(job)
        self._shards_written += 1
        self._rows_in_buffer = 0

    def _write_shard(self, filled: int, shard: int, buffer: np.ndarray) -> None:
        """Encode the chunks of one shard (in the pool) and write the shard file. Background."""
        layout = self.manifest.layout
        rpc, lpc = layout.rows_per_chunk, layout.layers_per_chunk
        n_layer_chunks = self.manifest.num_layers // lpc
        row_chunks = -(-filled // rpc)
        buffer[filled : row_chunks * rpc] = 0  # the edge chunk is padded with fill
        pieces = [
            buffer[c * rpc : (c + 1) * rpc, j * lpc : (j + 1) * lpc]
            for c in range(row_chunks)
            for j in range(n_layer_chunks)
        ]
        encoded = self.flusher.map(self._codec.encode, pieces)
        index = np.full((layout.chunks_per_shard, n_layer_chunks, 1, 2), zarr_meta.EMPTY, "<u8")
        offset = 0
        flat = index.reshape(-1, 2)
        for k, parts in enumerate(encoded):
            nbytes = sum(len(p) for p in parts)
            flat[k] = (offset, nbytes)
            offset += nbytes
        relpath = paths.shard_relpath(shard)
        blobs = [p for parts in encoded for p in parts] + zarr_meta.encode_shard_index(index)
        size = self.storage.write_file(paths.segment_file(self.segment_id, relpath), blobs)
        self._files[relpath] = FileInfo(size)
        self.bytes_written += size

    def finalize(self) -> SegmentInfo:
        """Write the remaining shard, the metadata and the index; make every file durable."""
        if not self._samples:
            raise FormatError("cannot finalize an empty segment")
        if self._rows_in_buffer:
            self._flush_shard()
        self.flusher.wait()
        man = self.manifest
        small: dict[str, bytes] = {
            "zarr.json": zarr_meta.group_json({"hsstore": {"segment": self.segment_id}}),
            f"{paths.STATES}/zarr.json": zarr_meta.states_array_json(
                num_rows=self.rows,
                num_layers=man.num_layers,
                hidden_size=man.hidden_size,
                storage_dtype=man.storage_dtype,
                logical_dtype=man.dtype,
                layout=man.layout,
                codec=man.codec,
            ),
            paths.STATS: json.dumps(self._stats.to_json()).encode(),
            paths.INDEX: self._index_bytes(),
        }
        columns = {"input_ids": self._input_ids, "loss_mask": self._loss_masks}
        for name, parts in columns.items():
            dtype = np.dtype(COLUMN_DTYPES[name]).newbyteorder("<")
            data = np.concatenate(parts).astype(dtype, copy=False)
            body = zstandard.ZstdCompressor(level=_COLUMN_ZSTD_LEVEL).compress(data.tobytes())
            small[f"{name}/zarr.json"] = zarr_meta.column_array_json(
                num_rows=self.rows, dtype=dtype, zstd_level=_COLUMN_ZSTD_LEVEL
            )
            small[paths.column_relpath(name)] = body + crc32c(body).to_bytes(4, "little")
        for relpath, data in small.items():
            self.storage.write_file(paths.segment_file(self.segment_id, relpath), [data])
            self._files[relpath] = FileInfo(len(data), crc32c(data))
            self.bytes_written += len(data)
        self.storage.sync(paths.segment_file(self.segment_id, rel) for rel in self._files)
        return SegmentInfo(
            id=self.segment_id,
            num_samples=len(self._samples),
            num_tokens=self.rows,
            num_shards=self._shards_written,
            files=dict(self._files),
            committed_at=now_iso(),
        )

    def sample_ids(self) -> list[str]:
        return [s.sample_id for s in self._samples]

    def _index_table(self) -> pa.Table:
        s = self._samples
        return pa.table(
            {
                "sample_id": [x.sample_id for x in s],
                "row_offset": [x.row_offset for x in s],
                "num_tokens": [x.num_tokens for x in s],
                "num_loss_tokens": [x.num_loss_tokens for x in s],
                "checksum": [x.checksum for x in s],
                "zero_rows": [x.flags.zero_rows for x in s],
                "nonfinite_rows": [x.flags.nonfinite_rows for x in s],
                "source": [x.source for x in s],
            },
            schema=INDEX_SCHEMA,
        )

    def _index_bytes(self) -> bytes:
        sink = io.BytesIO()
        pq.write_table(self._index_table(), sink, compression="zstd")
        return sink.getvalue()


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
        self._local = threading.local()
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
        return table

    def stats(self) -> dict:
        return json.loads(self.read_small(paths.STATS))

    def column(self, name: str) -> np.ndarray:
        """A whole per-token column of this segment (decoded once, then cached)."""
        arr = self._columns.get(name)
        if arr is not None:
            return arr
        relpath = paths.column_relpath(name)
        body = check_crc(memoryview(self.read_small(relpath)), what=self.where(relpath))
        dtype = np.dtype(self.manifest.columns[name]).newbyteorder("<")
        try:
            raw = zstandard.ZstdDecompressor().decompress(bytes(body))
        except zstandard.ZstdError as exc:
            raise IntegrityError(
                f"column does not decode: {exc}", path=self.where(relpath)
            ) from exc
        arr = np.frombuffer(raw, dtype=dtype)
        if arr.shape[0] != self.info.num_tokens:
            raise IntegrityError(
                f"column has {arr.shape[0]} rows, expected {self.info.num_tokens}",
                path=self.where(relpath),
            )
        self._columns[name] = arr
        return arr

    def shard_index(self, shard: int) -> np.ndarray:
        idx = self._shard_indexes.get(shard)
        if idx is not None:
            return idx
        with self._lock:
            idx = self._shard_indexes.get(shard)
            if idx is None:
                idx = self._load_shard_index(shard)
                self._shard_indexes[shard] = idx
        return idx

    def _load_shard_index(self, shard: int) -> np.ndarray:
        relpath = paths.shard_relpath(shard)
        where = self.where(relpath)
        expected = self.info.files.get(relpath)
        if expected is None:
            raise IntegrityError(f"shard {shard} is not listed in the manifest", path=where)
        try:
            size = self.storage.size(self._key(relpath))
        except FileNotFoundError as exc:
            raise IntegrityError("committed shard file is missing", path=where) from exc
        if size != expected.size:
            raise IntegrityError(
                f"shard has {size} bytes, manifest says {expected.size} (truncated?)", path=where
            )
        n_chunks = self.manifest.layout.chunks_per_shard * self._n_layer_chunks
        nbytes = zarr_meta.shard_index_nbytes(n_chunks)
        buf = bytearray(nbytes)
        got = self.storage.read_into(self._key(relpath), size - nbytes, memoryview(buf))
        if got != nbytes:
            raise IntegrityError("shard index is truncated", path=where)
        body = check_crc(memoryview(buf), what=f"{where} (shard index)")
        idx = np.frombuffer(body, dtype="<u8").reshape(
            self.manifest.layout.chunks_per_shard, self._n_layer_chunks, 2
        )
        data_end = size - nbytes
        present = idx[:, :, 0] != zarr_meta.EMPTY
        if np.any(idx[present][:, 0] + idx[present][:, 1] > data_end):
            raise IntegrityError("shard index points past the end of the data", path=where)
        if not self.manifest.codec.compressed:
            # Raw chunks are read row by row at computed offsets: their size must be exact.
            raw = self.manifest.layout.rows_per_chunk * self._row_bytes_chunk + 4
            if np.any(idx[present][:, 1] != raw):
                raise IntegrityError(
                    f"shard index lists a raw chunk that is not {raw} bytes", path=where
                )
        return idx

    def _scratch(self, name: str, nbytes: int) -> memoryview:
        bufs = getattr(self._local, "bufs", None)
        if bufs is None:
            bufs = self._local.bufs = {}
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
    ) -> None:
        """Decode rows [start, stop) of the given stored layers into ``out`` [n, len(layers), H].

        ``out`` is a C-contiguous array of the storage dtype. ``layers=None`` means all layers.
        With a ``hasher`` (all layers only), every piece placed in ``out`` is fed to it in order
        right after it lands, while it is still in cache (the sample checksum costs no extra
        pass over memory).
        """
        man = self.manifest
        layout = man.layout
        rpc, lpc, cps = layout.rows_per_chunk, layout.layers_per_chunk, layout.chunks_per_shard
        all_layers = layers is None or list(layers) == list(range(man.num_layers))
        whole_rows = all_layers and lpc == man.num_layers
        chunk_nbytes = rpc * self._row_bytes_chunk
        wanted = range(man.num_layers) if layers is None else layers
        by_chunk: dict[int, list[tuple[int, int]]] = {}
        for pos, layer in enumerate(wanted):
            by_chunk.setdefault(layer // lpc, []).append((pos, layer % lpc))
        out_bytes = out.reshape(out.shape[0], -1).view(np.uint8)
        if hasher is not None and not all_layers:
            raise FormatError("a sample checksum covers all layers")
        if whole_rows and not man.codec.compressed:
            self._read_raw_rows(start, stop, out_bytes, hasher)
            return

        for c in range(start // rpc, (stop - 1) // rpc + 1):
            crow0 = c * rpc
            lo, hi = max(start, crow0), min(stop, crow0 + rpc)
            shard, local = divmod(c, cps)
            idx = self.shard_index(shard)
            key = self._key(paths.shard_relpath(shard))
            for j, positions in by_chunk.items():
                offset, nbytes = (int(v) for v in idx[local, j])
                if offset == zarr_meta.EMPTY:
                    raise IntegrityError(
                        f"chunk ({c}, {j}) of committed rows is missing",
                        path=self.storage.path_of(key),
                    )
                what = f"{self.storage.path_of(key)} chunk ({c}, {j})"
                if whole_rows and lo == crow0 and hi == crow0 + rpc:
                    encoded = self._read_chunk(key, offset, nbytes)
                    dst = memoryview(out_bytes[lo - start : hi - start]).cast("B")
                    self._codec.decode_into(encoded, dst, what=what)
                    continue  # whole_rows means a single layer chunk: the row loop ends here
                scratch = self._scratch("chunk", chunk_nbytes)
                # A chunk cut by a sample boundary is usually needed again by the neighbouring
                # sample: the thread's scratch keeps the last one decoded (chunks never change).
                if getattr(self._local, "decoded", None) != (c, j):
                    self._local.decoded = None
                    self._codec.decode_into(
                        self._read_chunk(key, offset, nbytes), scratch, what=what
                    )
                    self._local.decoded = (c, j)
                chunk = np.frombuffer(scratch, dtype=man.storage_dtype).reshape(
                    rpc, lpc, man.hidden_size
                )
                rows = chunk[lo - crow0 : hi - crow0]
                if whole_rows:
                    out[lo - start : hi - start] = rows
                else:
                    for pos, within in positions:
                        out[lo - start : hi - start, pos] = rows[:, within]
            if hasher is not None:
                hasher.update(out_bytes[lo - start : hi - start])

    def _read_chunk(self, key: str, offset: int, nbytes: int) -> memoryview:
        encoded = self._scratch("enc", nbytes)
        if self.storage.read_into(key, offset, encoded) != nbytes:
            raise IntegrityError("shard is truncated", path=self.storage.path_of(key))
        return encoded

    def _read_raw_rows(
        self, start: int, stop: int, out_bytes: np.ndarray, hasher: xxhash.xxh3_64 | None
    ) -> None:
        """Uncompressed, all layers: the wanted rows of consecutive chunks sit back to back in
        the shard, separated only by each chunk's 4-byte crc32c, so a whole run of chunks is one
        scatter read straight into ``out`` (crc bytes go to a junk buffer). The whole-sample
        checksum verifies the bytes, since a partial chunk cannot be checked against its crc.
        """
        layout = self.manifest.layout
        rpc, cps, rb = layout.rows_per_chunk, layout.chunks_per_shard, self._row_bytes_chunk
        junk = self._scratch("junk", 64)
        c, last = start // rpc, (stop - 1) // rpc
        run_lo = 0
        while c <= last:
            shard = c // cps
            idx = self.shard_index(shard)
            key = self._key(paths.shard_relpath(shard))
            run: list[memoryview] = []
            run_start = prev_end = -1
            run_rows = 0
            # Runs stay a few MiB so the checksum reads them back from cache.
            while c <= last and c // cps == shard and len(run) < 1000 and run_rows * rb < (4 << 20):
                offset, nbytes = (int(v) for v in idx[c % cps, 0])
                if offset == zarr_meta.EMPTY:
                    raise IntegrityError(
                        f"chunk ({c}, 0) of committed rows is missing",
                        path=self.storage.path_of(key),
                    )
                crow0 = c * rpc
                lo, hi = max(start, crow0), min(stop, crow0 + rpc)
                file_start = offset + (lo - crow0) * rb
                if run:
                    gap = file_start - prev_end
                    if not 0 <= gap <= len(junk):
                        break
                    if gap:
                        run.append(junk[:gap])
                else:
                    run_start = file_start
                run.append(memoryview(out_bytes[lo - start : hi - start]).cast("B"))
                if not run_rows:
                    run_lo = lo
                run_rows += hi - lo
                prev_end = file_start + (hi - lo) * rb
                c += 1
            if self.storage.read_scatter(key, run_start, run) != prev_end - run_start:
                raise IntegrityError("shard is truncated", path=self.storage.path_of(key))
            if hasher is not None:
                hasher.update(out_bytes[run_lo - start : run_lo - start + run_rows])
