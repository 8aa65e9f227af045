"""The bytes of a segment's data files, both ways: what the writer lays down and the reader
takes apart, in one place.

A states shard file (Zarr v3 ``sharding_indexed``, index at the end) holds its encoded chunks
back to back (`hsstore.codec.codecs.ChunkCodec`: ``bytes -> [blosc] -> crc32c``), then the
shard index: for each inner chunk, in C order of (row chunk, layer chunk), its (offset, nbytes)
as two little-endian uint64, both `EMPTY` for a chunk never written, then the crc32c of those
bytes (little endian). A per-token column file is one zstd frame, then the crc32c of that
frame. zarr-python reads both as they are (`states_array_json` and `column_array_json` in
`hsstore.spec.zarr_meta` describe them).
"""

from __future__ import annotations

import struct
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import zstandard

from hsstore.codec.codecs import check_crc, crc32c
from hsstore.errors import IntegrityError

EMPTY = 2**64 - 1
ENTRY_BYTES = 16  # (offset, nbytes), little-endian uint64 each
CRC_BYTES = 4
COLUMN_ZSTD_LEVEL = 3


@dataclass(frozen=True)
class ShardIndex:
    """The index of one shard: where each of its chunks lies in the file.

    ``entries`` is uint64 [chunks per shard, layer chunks, 2] of (offset, nbytes)."""

    entries: np.ndarray

    @staticmethod
    def nbytes(chunks_per_shard: int, layer_chunks: int) -> int:
        """The index's size at the end of every shard file of this layout."""
        return chunks_per_shard * layer_chunks * ENTRY_BYTES + CRC_BYTES

    @classmethod
    def of_sizes(cls, sizes: Sequence[int], chunks_per_shard: int, layer_chunks: int) -> ShardIndex:
        """The index of a shard whose first ``len(sizes)`` chunks (C order) were written back
        to back from offset 0 with these sizes; the rest never were."""
        entries = np.full((chunks_per_shard * layer_chunks, 2), EMPTY, "<u8")
        ends = np.cumsum(np.asarray(sizes, np.uint64), dtype=np.uint64)
        entries[: len(sizes), 0] = ends - np.asarray(sizes, np.uint64)
        entries[: len(sizes), 1] = sizes
        return cls(entries.reshape(chunks_per_shard, layer_chunks, 2))

    def encode(self) -> list[bytes]:
        """The index's bytes, to follow the chunks in the shard file."""
        body = np.ascontiguousarray(self.entries, dtype="<u8").tobytes()
        return [body, struct.pack("<I", crc32c(body))]

    @classmethod
    def decode(
        cls,
        raw: memoryview,
        data_end: int,
        *,
        chunks_per_shard: int,
        layer_chunks: int,
        raw_chunk_nbytes: int | None,
        where: str,
    ) -> ShardIndex:
        """Parse and check the index read from the end of a shard whose chunk data ends at
        ``data_end``. ``raw_chunk_nbytes``: every chunk's exact encoded size when the codec
        stores raw bytes (such chunks are read row by row at computed offsets)."""
        body = check_crc(raw, what=f"{where} (shard index)")
        entries = np.frombuffer(bytes(body), dtype="<u8").reshape(chunks_per_shard, layer_chunks, 2)
        present = entries[:, :, 0] != EMPTY
        if np.any(entries[present][:, 0] + entries[present][:, 1] > data_end):
            raise IntegrityError("shard index points past the end of the data", path=where)
        if raw_chunk_nbytes is not None and np.any(entries[present][:, 1] != raw_chunk_nbytes):
            raise IntegrityError(
                f"shard index lists a raw chunk that is not {raw_chunk_nbytes} bytes", path=where
            )
        return cls(entries)

    def chunk(self, local: int, layer_chunk: int) -> tuple[int, int]:
        """(offset, nbytes) of one chunk; offset `EMPTY` for a chunk never written."""
        offset, nbytes = self.entries[local, layer_chunk].tolist()
        return offset, nbytes

    def offsets(self, first: int, last: int) -> list[int]:
        """The offsets of row chunks ``first..last`` (local to the shard), of layer chunk 0."""
        return self.entries[first : last + 1, 0, 0].tolist()

    def chunks(
        self, first: int, last: int, layer_chunks: Sequence[int]
    ) -> list[tuple[int, int, int, int]]:
        """(local row chunk, layer chunk, offset, nbytes) of row chunks ``first..last`` (local
        to the shard) and the given layer chunks, in reading order."""
        rows = self.entries[first : last + 1].tolist()
        return [
            (local, j, *row[j]) for local, row in enumerate(rows, start=first) for j in layer_chunks
        ]

    def byte_ranges(
        self, locals_: np.ndarray, layer_chunks: Sequence[int]
    ) -> list[tuple[int, int]]:
        """The (offset, nbytes) ranges of the given row chunks' (local to the shard) and layer
        chunks' bytes, merged where they lie back to back; chunks never written are left out."""
        ranges: list[tuple[int, int]] = []
        for row in self.entries[locals_].tolist():
            for j in layer_chunks:
                offset, nbytes = row[j]
                if offset == EMPTY:
                    continue  # reported by the read itself
                if ranges and ranges[-1][0] + ranges[-1][1] == offset:
                    ranges[-1] = (ranges[-1][0], ranges[-1][1] + nbytes)
                else:
                    ranges.append((offset, nbytes))
        return ranges


def raw_rows_range(chunk_offset: int, row: int, rows: int, row_bytes: int) -> tuple[int, int]:
    """(offset, nbytes) of ``rows`` rows from row ``row`` of an uncompressed chunk that starts
    at ``chunk_offset``: such a chunk is its rows back to back, then its crc32c."""
    return chunk_offset + row * row_bytes, rows * row_bytes


def encode_column(values: np.ndarray) -> bytes:
    """A per-token column file: ``values`` (already in their stored dtype) as one zstd frame,
    then its crc32c."""
    body = zstandard.ZstdCompressor(level=COLUMN_ZSTD_LEVEL).compress(values.tobytes())
    return body + struct.pack("<I", crc32c(body))


def decode_column(data: bytes, dtype: np.dtype, *, where: str) -> np.ndarray:
    """The values of a per-token column file, checked against its crc32c."""
    body = check_crc(memoryview(data), what=where)
    try:
        raw = zstandard.ZstdDecompressor().decompress(bytes(body))
    except zstandard.ZstdError as exc:
        raise IntegrityError(f"column does not decode: {exc}", path=where) from exc
    return np.frombuffer(raw, dtype=dtype)
