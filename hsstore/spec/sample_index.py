"""What a segment's ``index.parquet`` holds, and the checksum each of its rows carries.

One row per sample (docs/FORMAT.md, "The sample index"). The checksum is XXH3-64 over the sample's
stored bytes in a fixed order, so a reader can check a whole-sample read without a second
pass: it feeds the states to the hasher as they are decoded (`finish_checksum` adds the rest).
"""

from __future__ import annotations

import sys
from collections.abc import Sequence

import numpy as np
import pyarrow as pa
import xxhash

from hsstore import settings

try:  # built where xxHash's header was there at build time (setup.py)
    from hsstore.spec import _xxh3_many
    from hsstore.spec._xxh3_many import xxh3_spans
except ImportError:
    _xxh3_many = xxh3_spans = None

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


def sample_checksum(
    hidden: np.ndarray,
    input_ids: np.ndarray,
    loss_mask: np.ndarray,
    scales: np.ndarray | None = None,
) -> int:
    """XXH3-64 of a sample's stored bytes: states [T, L, H], then input_ids, then loss_mask,
    then (scaled dtypes only) the per-token scales."""
    hasher = xxhash.xxh3_64()
    hasher.update(memoryview(np.ascontiguousarray(hidden)).cast("B"))
    return finish_checksum(hasher, input_ids, loss_mask, scales)


def finish_checksum(
    hasher: xxhash.xxh3_64 | RowHasher,
    input_ids: np.ndarray,
    loss_mask: np.ndarray,
    scales: np.ndarray | None = None,
) -> int:
    """Finish a sample checksum from a hasher that has seen its states bytes (the columns'
    bytes as stored: a C-contiguous array hashes as its raw bytes)."""
    hasher.update(np.ascontiguousarray(input_ids))
    hasher.update(np.ascontiguousarray(loss_mask))
    if scales is not None:
        hasher.update(np.ascontiguousarray(scales))
    return hasher.intdigest()


def fast_hashing() -> bool:
    """Whether `span_checksums` hashes in one compiled call: the module was built, and ``HSSTORE_NO_FAST_DECODE=1`` does not ask for the portable path."""
    return xxh3_spans is not None and not settings.current().no_fast_decode


def span_checksums(buffers: Sequence[object], spans: np.ndarray) -> np.ndarray | None:
    """XXH3-64 of each row of ``spans`` ([k, P, 3] int64: P spans (index into ``buffers``,
    byte offset, byte length) hashed one after another), in one compiled call that lets go of
    the GIL: a batch's sample checksums, each over its states and its columns. None where the
    compiled module was not built or ``HSSTORE_NO_FAST_DECODE=1`` (then hash with ``xxhash``
    itself)."""
    if not fast_hashing():
        return None
    spans = np.ascontiguousarray(spans, np.int64)
    out = np.empty(spans.shape[0], np.uint64)
    xxh3_spans(buffers, spans, spans.shape[1], out)
    return out


def row_magnitudes(stored: np.ndarray, rowmax: np.ndarray) -> bool:
    """Write into ``rowmax`` [..., L] the largest magnitude bits of each row of ``stored``
    [..., L, H] (2- or 4-byte values, C-contiguous) in one compiled pass, as
    `RowHasher.copy_rows` measures them; False, having written nothing, where the compiled
    module does not have it (`RowHasher.available`) or the arrays do not fit it."""
    if not (RowHasher.available() and stored.itemsize in (2, 4) and stored.shape[-1]):
        return False
    if not (stored.flags.c_contiguous and rowmax.flags.c_contiguous):
        return False
    _xxh3_many.row_magnitudes(stored, rowmax, stored.shape[-1], stored.itemsize)
    return True


_NO_FLOATS = np.empty(0, np.float32)


class RowHasher:
    """A sample checksum that is fed the states as the writer copies them into its shard
    buffer (`copy_rows`), each row hashed while it is in the cache; `finish_checksum` takes it
    as it takes an ``xxhash.xxh3_64``. For one thread at a time."""

    def __init__(self) -> None:
        self._state = _xxh3_many.new_state()

    @staticmethod
    def available() -> bool:
        """Whether the compiled module has it (`fast_hashing`, and built with `copy_rows`),
        on a little-endian machine (the stored byte order, which `copy_rows` reads natively)."""
        return (
            fast_hashing() and hasattr(_xxh3_many, "row_magnitudes") and sys.byteorder == "little"
        )

    def reset(self) -> None:
        _xxh3_many.state_reset(self._state)

    def update(self, data: object) -> None:
        _xxh3_many.state_update(self._state, data)

    def intdigest(self) -> int:
        return _xxh3_many.state_digest(self._state)

    def copy_rows(
        self,
        src: np.ndarray,
        dst: np.ndarray,
        rowmax: np.ndarray,
        sampled: np.ndarray | None = None,
        first: int = 0,
        every: int = 0,
        *,
        chunk_rows: int = 0,
        at: int = 0,
    ) -> None:
        """Copy ``src`` [N, L, H] (2- or 4-byte values) into ``dst`` (same shape, C-contiguous
        both), hash it, and write into ``rowmax`` [N, L] the largest magnitude bits of each
        row (the values' bits with the sign cleared, as `hsstore.segment.stats.row_absmax`
        gives them), in one pass. With ``every`` > 0 also write into ``sampled`` [k, L, H]
        float32 the rows ``first``, ``first + every``, ... of ``src`` (bf16 or float32) as
        float32 values.

        With ``chunk_rows``, ``dst`` is a buffer of chunks of ``chunk_rows`` rows of 2-byte
        values, each stored as its byte planes (`hsstore.codec.codecs.ChunkCodec.encode_planes`
        reads them), and ``src`` goes to its rows ``at .. at + N``."""
        if sampled is None:
            sampled = _NO_FLOATS
        _xxh3_many.copy_rows(self._state, src, dst, rowmax, src.shape[-1], src.itemsize,
                             sampled, src.shape[1], first, every, chunk_rows, at)  # fmt: skip
