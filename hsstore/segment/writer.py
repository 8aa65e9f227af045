"""Writing one segment: shards encoded in the background, then metadata, columns and index.

A segment is written by exactly one writer, whole shards at a time (two writers never touch
the same file), and becomes visible only when a manifest that lists it is published.
Reading it back is `hsstore.segment.reader`.
"""

from __future__ import annotations

import contextlib
import functools
import io
import json
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import torch

from hsstore.codec import fp8, tiers
from hsstore.codec.codecs import ChunkCodec, crc32c
from hsstore.errors import FormatError
from hsstore.segment.stats import RowFlags, StatsAccumulator, magnitude_dtype
from hsstore.spec import paths, zarr_meta
from hsstore.spec.manifest import FileInfo, Manifest, SegmentInfo, now_iso
from hsstore.spec.sample_index import INDEX_SCHEMA, RowHasher, finish_checksum, sample_checksum
from hsstore.spec.segment_layout import COLUMN_ZSTD_LEVEL, ShardIndex, encode_column
from hsstore.storage.store import Storage


@dataclass
class _PendingSample:
    sample_id: str
    row_offset: int
    num_tokens: int
    num_loss_tokens: int
    checksum: int
    flags: RowFlags | None  # None until the shard holding its last row has been written
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
        self._threads = encode_threads
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
        """``[fn(x) for x in items]``, spread over the encode threads as one task per thread
        (a contiguous run of items each): a task per item costs two thread hand-offs, as much
        as encoding a small chunk. With one encode thread it runs here, in the background
        thread that called it."""
        n = min(self._threads, len(items))
        if n <= 1:
            return [fn(x) for x in items]
        step = -(-len(items) // n)
        runs = [items[i : i + step] for i in range(0, len(items), step)]
        futures = [self._pool.submit(lambda run: [fn(x) for x in run], run) for run in runs]
        return [y for f in futures for y in f.result()]

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
    rows: int = 0  # rows of the per-token arrays so far: tokens plus alignment padding
    tokens: int = 0
    bytes_written: int = 0
    _rows_in_buffer: int = 0
    _shards_written: int = 0
    _files: dict[str, FileInfo] = field(default_factory=dict)
    _synced: set[str] = field(default_factory=set)  # files made durable before finalize
    _samples: list[_PendingSample] = field(default_factory=list)
    _input_ids: list[np.ndarray] = field(default_factory=list)
    _loss_masks: list[np.ndarray] = field(default_factory=list)
    _scales: list[np.ndarray] = field(default_factory=list)
    # Per shard written: which of its rows are all zeros / hold a NaN or Inf in some layer.
    _row_flags: list[tuple[np.ndarray, np.ndarray]] = field(default_factory=list)

    def __post_init__(self) -> None:
        layout = self.manifest.layout
        self._codec = ChunkCodec(self.manifest.codec, self.manifest.storage_dtype.itemsize)
        # Stats of a scaled dtype describe the values (states times scales), computed in fp32.
        stats_dtype = "float32" if self.manifest.scaled else self.manifest.dtype
        self._stats = StatsAccumulator(self.manifest.num_layers, stats_dtype)
        expected = (layout.rows_per_shard, self.manifest.num_layers, self.manifest.hidden_size)
        if self.flusher.shape != expected:
            raise FormatError(f"shard buffer shape {self.flusher.shape} != {expected}")
        # Unscaled states are copied into the shard buffer, hashed and measured for the
        # statistics in one compiled pass, which leaves each row's magnitude in ``_rowmax``
        # (the statistics of the shard take it from there); otherwise each is its own pass.
        self._magnitudes = None if self.manifest.scaled else magnitude_dtype(stats_dtype)
        self._hasher = RowHasher() if self._magnitudes and RowHasher.available() else None
        self._rowmax = self._new_rowmax()
        # The same pass widens the rows the statistics sample (of the dtypes it knows how to)
        # into one of two float buffers, a shard's each: one filled, one read in the background.
        self._widens = self._hasher is not None and stats_dtype in ("bfloat16", "float32")
        self._floats: list[np.ndarray | None] = [None, None]
        self._floats_at = 0
        self._picked = 0  # sampled rows in the current float buffer
        # Then no one reads the values in the shard buffer but the encoder: where it takes
        # chunks as byte planes, the pass splits each row into its chunk's planes as it copies
        # it, and the encoder codes them as they lie.
        chunk = self._chunk_values() * self.manifest.storage_dtype.itemsize
        self._planes = (
            self._widens
            and layout.layers_per_chunk == self.manifest.num_layers
            and self._codec.takes_planes(chunk)
        )

    def _chunk_values(self) -> int:
        layout = self.manifest.layout
        return layout.rows_per_chunk * layout.layers_per_chunk * self.manifest.hidden_size

    def _zero_rows(self, buffer: np.ndarray, lo: int, hi: int) -> None:
        """Zeros in rows ``lo .. hi`` of a shard buffer (in both planes of their chunks, where
        it holds planes)."""
        if not self._planes:
            buffer[lo:hi] = 0
            return
        rpc = self.manifest.layout.rows_per_chunk
        planes = buffer.reshape(-1).view(np.uint8).reshape(-1, 2, rpc, buffer[0].size)
        for c in range(lo // rpc, -(-hi // rpc)):
            planes[c, :, max(lo - c * rpc, 0) : min(hi - c * rpc, rpc)] = 0

    def _new_rowmax(self) -> np.ndarray | None:
        if self._hasher is None:
            return None
        return np.zeros((self.flusher.shape[0], self.flusher.shape[1]), self._magnitudes)

    @property
    def num_samples(self) -> int:
        return len(self._samples)

    def raw_bytes(self) -> int:
        return (
            self.tokens
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
        scales: np.ndarray | None = None,
    ) -> None:
        """Append one validated sample; ``hidden`` is [T, L, H] in the storage dtype, ``scales``
        its float32 [T] per-token scales (given exactly when the dtype is scaled)."""
        if (scales is not None) != self.manifest.scaled:
            raise FormatError(f"per-token scales go with a scaled dtype, not {self.manifest.dtype}")
        # Padding first: it goes before this sample's rows in every per-token array.
        self._pad_to(self.manifest.layout.start_row(self.rows))
        flags = None  # unscaled: counted when its shards are written (`_write_shard`)
        if scales is not None:
            values = fp8.dequantize(
                torch.from_numpy(hidden).view(self.manifest.torch_dtype),
                torch.from_numpy(scales),
                torch.float32,
            )
            flags = self._stats.update(values.numpy())
            self._scales.append(scales)
        t = hidden.shape[0]
        # In the samples before its rows: flushing a shard looks up which rows are real.
        sample = _PendingSample(sample_id, self.rows, t, int(loss_mask.sum()), 0, flags, source)
        self._samples.append(sample)
        self._input_ids.append(input_ids)
        self._loss_masks.append(loss_mask)
        if self._hasher is not None:
            self._hasher.reset()
            self._append_rows(np.ascontiguousarray(hidden))  # hashes them as it copies them
            sample.checksum = finish_checksum(self._hasher, input_ids, loss_mask)
        else:
            sample.checksum = sample_checksum(hidden, input_ids, loss_mask, scales)
            self._append_rows(hidden)
        self.tokens += t

    def _pad_to(self, row: int) -> None:
        """Zero rows up to ``row`` (a chunk boundary of a sample-aligned layout): states and
        every column, so all per-token arrays keep one row numbering."""
        pad = row - self.rows
        if not pad:
            return
        # A shard holds whole chunks, so padding up to a chunk boundary stays in this shard.
        self._zero_rows(self.flusher.buffer(), self._rows_in_buffer, self._rows_in_buffer + pad)
        self._rows_in_buffer += pad
        self.rows += pad
        for column in (self._input_ids, self._loss_masks):
            column.append(np.zeros(pad, column[-1].dtype))
        if self.manifest.scaled:
            self._scales.append(np.zeros((pad, *self._scales[-1].shape[1:]), np.float32))
        if self._rows_in_buffer == self.flusher.shape[0]:
            self._flush_shard(last=False)

    def _append_rows(self, hidden: np.ndarray) -> None:
        t, done = hidden.shape[0], 0
        cap = self.flusher.shape[0]
        while done < t:
            n = min(t - done, cap - self._rows_in_buffer)
            buf = self.flusher.buffer()
            at = self._rows_in_buffer
            if self._hasher is not None:
                floats, first, every = self._sampled_slot(done, n)
                rows, rowmax = hidden[done : done + n], self._rowmax[at : at + n]
                if self._planes:
                    rpc = self.manifest.layout.rows_per_chunk
                    self._hasher.copy_rows(rows, buf, rowmax, floats, first, every,
                                           chunk_rows=rpc, at=at)  # fmt: skip
                else:
                    self._hasher.copy_rows(rows, buf[at : at + n], rowmax, floats, first, every)
            else:
                buf[at : at + n] = hidden[done : done + n]
            self._rows_in_buffer += n
            done += n
            if self._rows_in_buffer == cap:
                self._flush_shard(last=False)
        self.rows += t

    def _sampled_slot(self, done: int, n: int) -> tuple[np.ndarray | None, int, int]:
        """Where the pass puts the sampled rows among rows ``done .. done + n`` of the sample
        being added, the first of them and the step (step 0: none, the statistics widen their
        sampled rows themselves)."""
        if not self._widens:
            return None, 0, 0
        first, count = self._stats.sampled_rows(self.tokens + done, n)
        floats = self._floats[self._floats_at]
        if floats is None:
            rows = -(-self.flusher.shape[0] // self._stats.sample_every)
            floats = np.empty((rows, *self.flusher.shape[1:]), np.float32)
            self._floats[self._floats_at] = floats
        self._picked += count
        return floats[self._picked - count : self._picked], first, self._stats.sample_every

    def _flush_shard(self, *, last: bool) -> None:
        """Hand the shard buffer to the background. A shard with more to come in its segment
        is made durable there as soon as it is written, so that the page cache never holds
        more than a shard of the segment's data unwritten and its finalize (inside a commit)
        waits for the disk to take the last shard only, not the whole segment."""
        floats = self._floats[self._floats_at]
        if floats is None and self._widens:  # no sampled row yet: none to take
            floats = np.empty((0, *self.flusher.shape[1:]), np.float32)
        job = functools.partial(
            self._write_shard,
            self._rows_in_buffer,
            self._shards_written,
            self._real_rows(),
            self._rowmax,
            None if floats is None else floats[: self._picked],
            durable=not last,
        )
        # Once submitted, the shard before it is written: its float buffer is free.
        self.flusher.submit(job)
        self._rowmax = self._new_rowmax()
        self._floats_at ^= 1
        self._picked = 0
        self._shards_written += 1
        self._rows_in_buffer = 0

    def _real_rows(self) -> np.ndarray | None:
        """Which rows of the shard being flushed belong to a sample (None: all of them)."""
        if not self.manifest.layout.sample_aligned:
            return None
        row0 = self._shards_written * self.manifest.layout.rows_per_shard
        real = np.zeros(self._rows_in_buffer, bool)
        for sample in reversed(self._samples):  # the samples that reach into this shard
            if sample.row_offset + sample.num_tokens <= row0:
                break
            real[
                max(sample.row_offset - row0, 0) : sample.row_offset + sample.num_tokens - row0
            ] = 1
        return real

    def _write_shard(
        self,
        filled: int,
        shard: int,
        real: np.ndarray | None,
        rowmax: np.ndarray | None,
        sampled: np.ndarray | None,
        buffer: np.ndarray,
        *,
        durable: bool,
    ) -> None:
        """Record the statistics of one shard's rows (``rowmax``: their magnitudes, and
        ``sampled``: the floats of the rows they sample, where taken as they were copied in),
        encode its chunks (in the pool) and write the shard file. Background (shards in order,
        one at a time)."""
        if not self.manifest.scaled:
            # One pass per shard rather than per sample: on small samples the per-call cost
            # of the statistics was most of it. Before encoding, which may reuse the buffer.
            measured = None if rowmax is None else rowmax[:filled]
            zero, nonfinite = self._stats.update_block(buffer[:filled], real, measured, sampled)
            self._row_flags.append((zero, nonfinite))
        layout = self.manifest.layout
        rpc, lpc = layout.rows_per_chunk, layout.layers_per_chunk
        n_layer_chunks = self.manifest.num_layers // lpc
        row_chunks = -(-filled // rpc)
        self._zero_rows(buffer, filled, row_chunks * rpc)  # the edge chunk is padded with fill
        if self._planes:  # whole chunks of rows, each as its byte planes
            size = self._chunk_values() * buffer.itemsize
            flat = buffer.reshape(-1).view(np.uint8)
            pieces = [flat[c * size : (c + 1) * size] for c in range(row_chunks)]
            encode = self._codec.encode_planes
        else:
            pieces = [
                buffer[c * rpc : (c + 1) * rpc, j * lpc : (j + 1) * lpc]
                for c in range(row_chunks)
                for j in range(n_layer_chunks)
            ]
            # The buffer is not read again until this shard is written, so raw parts of a
            # chunk may live in the chunk's own (warm) memory.
            encode = functools.partial(self._codec.encode, reuse_input=True)
        encoded = self.flusher.map(encode, pieces)
        index = ShardIndex.of_sizes(
            [sum(len(p) for p in parts) for parts in encoded],
            layout.chunks_per_shard,
            n_layer_chunks,
        )
        relpath = paths.shard_relpath(shard)
        blobs = [p for parts in encoded for p in parts] + index.encode()
        key = paths.segment_file(self.segment_id, relpath)
        size = self.storage.write_file(key, blobs)
        if durable:
            self.storage.sync([key])
            self._synced.add(relpath)
        self._files[relpath] = FileInfo(size)
        self.bytes_written += size

    def finalize(self) -> SegmentInfo:
        """Write the remaining shard, the metadata and the index; make every file durable."""
        if not self._samples:
            raise FormatError("cannot finalize an empty segment")
        if self._rows_in_buffer:
            self._flush_shard(last=True)
        self.flusher.wait()
        if not self.manifest.scaled:
            self._count_flags()
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
        if man.scaled:
            columns[paths.SCALES] = self._scales
        for name, parts in columns.items():
            dtype = np.dtype(man.columns[name]).newbyteorder("<")
            data = np.concatenate(parts).astype(dtype, copy=False)
            small[f"{name}/zarr.json"] = zarr_meta.column_array_json(
                num_rows=self.rows,
                dtype=dtype,
                zstd_level=COLUMN_ZSTD_LEVEL,
                width=tiers.scales_width(man.tier, man.num_layers)
                if name == paths.SCALES
                else None,
            )
            small[paths.column_relpath(name)] = encode_column(data)
        for relpath, data in small.items():
            self.storage.write_file(paths.segment_file(self.segment_id, relpath), [data])
            self._files[relpath] = FileInfo(len(data), crc32c(data))
            self.bytes_written += len(data)
        copy = paths.segment_file(self.segment_id, paths.INDEX_COPY)
        self.storage.write_file(copy, [small[paths.INDEX]])
        unsynced = [r for r in self._files if r not in self._synced]
        self.storage.sync([copy, *(paths.segment_file(self.segment_id, r) for r in unsynced)])
        return SegmentInfo(
            id=self.segment_id,
            num_samples=len(self._samples),
            num_tokens=self.tokens,
            num_shards=self._shards_written,
            files=dict(self._files),
            committed_at=now_iso(),
            padded_rows=self.rows if self.rows != self.tokens else None,
        )

    def _count_flags(self) -> None:
        """Each sample's zero and non-finite row counts, from the per-row flags of its shards."""
        zero = np.concatenate([z for z, _ in self._row_flags])
        nonfinite = np.concatenate([n for _, n in self._row_flags])
        zero_before = np.concatenate([[0], np.cumsum(zero)])
        nonfinite_before = np.concatenate([[0], np.cumsum(nonfinite)])
        for sample in self._samples:
            lo, hi = sample.row_offset, sample.row_offset + sample.num_tokens
            sample.flags = RowFlags(
                zero_rows=int(zero_before[hi] - zero_before[lo]),
                nonfinite_rows=int(nonfinite_before[hi] - nonfinite_before[lo]),
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
