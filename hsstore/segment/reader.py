"""Reading one segment: Zarr v3 arrays of states and token columns + a Parquet index.

Readers decode shard files directly: they read the shard index once, then only the chunks that
hold the rows asked for, into buffers the caller provides. `check_shard` re-reads a whole shard
for `verify`. Writing a segment is `hsstore.segment.writer`.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Sequence

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from hsstore.codec import tiers
from hsstore.codec.codecs import ChunkCodec, crc32c
from hsstore.errors import FormatError, HsstoreError, IntegrityError
from hsstore.segment.row_reads import CHUNK_CHECKED, RowRead
from hsstore.spec import paths
from hsstore.spec.manifest import FileInfo, Manifest, SegmentInfo
from hsstore.spec.sample_index import INDEX_SCHEMA
from hsstore.spec.segment_layout import CRC_BYTES, ShardIndex, decode_column
from hsstore.storage.damage import read_io
from hsstore.storage.store import Storage


class SegmentReader:
    """Reads rows of one committed segment; thread-safe, buffers reused per thread."""

    def __init__(self, storage: Storage, manifest: Manifest, info: SegmentInfo):
        self.storage = storage
        self.manifest = manifest
        self.info = info
        self.codec = ChunkCodec(manifest.codec, manifest.storage_dtype.itemsize)
        self._shard_indexes: dict[int, np.ndarray] = {}
        self._columns: dict[str, np.ndarray] = {}
        self._lock = threading.Lock()
        layout = manifest.layout
        self.n_layer_chunks = manifest.num_layers // layout.layers_per_chunk
        self.row_bytes_chunk = (
            layout.layers_per_chunk * manifest.hidden_size * manifest.storage_dtype.itemsize
        )
        # Rows of all layers are plain byte ranges (`read_raw_rows`, `RawSamplesRead`).
        self.raw_rows = (
            layout.layers_per_chunk == manifest.num_layers and not manifest.codec.compressed
        )

    def key(self, relpath: str) -> str:
        return paths.segment_file(self.info.id, relpath)

    def where(self, relpath: str) -> str:
        return self.storage.path_of(self.key(relpath))

    def read_small(self, relpath: str, *, copy: bool = True) -> bytes:
        """A small file, checked against the size and crc32c the manifest recorded. The index
        is read from its copy when it is missing or damaged and the copy is intact (``copy``
        False: the file itself or an error)."""
        expected = self.info.files.get(relpath)
        if expected is None:
            raise FormatError("file is not listed in the manifest", path=self.where(relpath))
        try:
            return self._read_checked(relpath, expected)
        except IntegrityError:
            if not copy or relpath != paths.INDEX:
                raise
            try:
                return self._read_checked(paths.INDEX_COPY, expected)
            except (HsstoreError, OSError):
                pass
            raise

    def _read_checked(self, relpath: str, expected: FileInfo) -> bytes:
        where = self.where(relpath)
        try:
            data = read_io(self.storage.read_bytes, self.key(relpath))
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
            data = (
                self.read_small(paths.INDEX)
                if self._copy_intact()
                else read_io(self.storage.read_bytes, self.key(paths.INDEX))
            )
            with pq.ParquetFile(pa.BufferReader(data)) as index_file:
                column = index_file.read(columns=["sample_id"], use_threads=False)
            return [str(x) for x in column.column("sample_id").to_pylist()]
        except Exception:  # damaged Parquet fails in many ways; salvage is best effort
            return []

    def _copy_intact(self) -> bool:
        try:
            self._read_checked(paths.INDEX_COPY, self.info.files[paths.INDEX])
        except (HsstoreError, OSError, KeyError):
            return False
        return True

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
        if name == paths.SCALES:
            arr = tiers.shape_scales(arr, self.manifest.tier, self.manifest.num_layers)
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
        size = self.shard_size(shard)
        nbytes = self.index_nbytes
        buf = memoryview(bytearray(nbytes))
        key, ranges = self.key(relpath), [(size - nbytes, nbytes)]
        (got,) = read_io(lambda: list(self.storage.read_ranges(key, ranges, [buf])))
        if len(got) != nbytes:
            raise IntegrityError("shard index is truncated", path=self.where(relpath))
        return self.parse_shard_index(buf, size - nbytes, self.where(relpath))

    @property
    def index_nbytes(self) -> int:
        return ShardIndex.nbytes(self.manifest.layout.chunks_per_shard, self.n_layer_chunks)

    def shard_size(self, shard: int) -> int:
        """The shard's size on storage, checked against the manifest."""
        relpath = paths.shard_relpath(shard)
        where = self.where(relpath)
        expected = self.info.files.get(relpath)
        if expected is None:
            raise IntegrityError(f"shard {shard} is not listed in the manifest", path=where)
        try:
            size = read_io(self.storage.size, self.key(relpath))
        except FileNotFoundError as exc:
            raise IntegrityError("committed shard file is missing", path=where) from exc
        except FormatError as exc:  # a FIFO or device where the shard belongs
            raise IntegrityError(exc.message, path=where) from exc
        if size != expected.size:
            raise IntegrityError(
                f"shard has {size} bytes, manifest says {expected.size} (truncated?)", path=where
            )
        if size < self.index_nbytes:
            raise IntegrityError("shard is shorter than its index", path=where)
        return size

    def parse_shard_index(self, raw: memoryview, data_end: int, where: str) -> ShardIndex:
        compressed = self.manifest.codec.compressed
        return ShardIndex.decode(
            raw,
            data_end,
            chunks_per_shard=self.manifest.layout.chunks_per_shard,
            layer_chunks=self.n_layer_chunks,
            raw_chunk_nbytes=None if compressed else self.manifest.chunk_nbytes + CRC_BYTES,
            where=where,
        )

    def read_rows(
        self,
        start: int,
        stop: int,
        layers: Sequence[int] | None,
        out: np.ndarray,
        how: RowRead = CHUNK_CHECKED,
    ) -> None:
        """Decode rows [start, stop) of the given stored layers (None: all) into ``out``
        [n, len(layers), H], a C-contiguous array of the storage dtype, the way ``how`` says
        (`hsstore.segment.row_reads`; by default on this thread, each chunk checked against
        its crc32c)."""
        how.read(self, start, stop, layers, out)

    def will_read_rows(
        self,
        starts: np.ndarray,
        stops: np.ndarray,
        layers: Sequence[int] | None,
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
            key = self.key(paths.shard_relpath(shard))
            try:
                ranges = self.shard_index(shard).byte_ranges(in_shard, layer_chunks)
                self.storage.will_read(key, ranges)
            except (HsstoreError, OSError):
                continue  # a hint fails nothing: the read that needs these bytes reports it
