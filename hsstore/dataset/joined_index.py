"""The sample index of every segment of a dataset's version, joined: one row per sample."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import numpy as np
import pyarrow as pa

from hsstore.spec.sample_index import INDEX_SCHEMA


class ColumnSource(Protocol):
    """A segment's per-token columns (`hsstore.segment.reader.SegmentReader`)."""

    def column(self, name: str) -> np.ndarray: ...


class JoinedIndex:
    """The sample index of every segment, joined (built on first use after each refresh)."""

    def __init__(self, tables: list[pa.Table]):
        parts = [
            t.append_column("segment", pa.array(np.full(t.num_rows, k, np.int32)))
            for k, t in enumerate(tables)
        ]
        empty = INDEX_SCHEMA.empty_table().append_column("segment", pa.array([], pa.int32()))
        self.table: pa.Table = pa.concat_tables(parts) if parts else empty
        self.segment = self.table.column("segment").to_numpy()
        self.row = self.table.column("row_offset").to_numpy()
        self.len = self.table.column("num_tokens").to_numpy()
        self.checksum = self.table.column("checksum").to_numpy()
        self.num_samples = int(self.len.shape[0])

    def position(self, i: int) -> int:
        """Sample ``i`` (negative: from the end) as a position in 0..n-1."""
        n = self.num_samples
        if not -n <= i < n:
            raise IndexError(f"sample {i} out of range for a dataset of {n} samples")
        return i % n

    def positions(self, positions: Sequence[int] | np.ndarray) -> np.ndarray:
        """`position` of many samples at once."""
        n = self.num_samples
        pos = np.asarray(positions, np.int64)
        for k in np.flatnonzero((pos < -n) | (pos >= n))[:1].tolist():
            raise IndexError(f"sample {int(pos[k])} out of range for a dataset of {n} samples")
        return pos % max(n, 1)

    def gather_columns(
        self,
        positions: Sequence[int] | np.ndarray,
        takes: Sequence[int] | np.ndarray,
        names: Sequence[str],
        readers: Sequence[ColumnSource],
        sample_ids: Sequence[str],
    ) -> list[np.ndarray]:
        """Per-token columns ``names`` of the first ``takes[k]`` tokens of sample
        ``positions[k]``, for every k, back to back: one gather per segment (``readers``, one
        per segment) instead of one per sample; ``sample_ids`` name a sample in an error."""
        pos, count = np.asarray(positions, np.int64), np.asarray(takes, np.int64)
        if pos.shape != count.shape or pos.ndim != 1:
            raise ValueError("positions and takes must be 1-d and of the same length")
        pos = self.positions(pos)
        for k in np.flatnonzero((count < 0) | (count > self.len[pos]))[:1].tolist():
            sid, has = sample_ids[int(pos[k])], int(self.len[pos[k]])
            raise ValueError(f"cannot take {int(count[k])} tokens of sample {sid!r} ({has} tokens)")
        rows = np.repeat(self.row[pos] - (np.cumsum(count) - count), count)
        rows += np.arange(len(rows))
        segments = np.unique(self.segment[pos]).tolist()
        if len(segments) == 1:  # usually: then no masks
            return [readers[segments[0]].column(name)[rows] for name in names]
        seg_of, out = np.repeat(self.segment[pos], count), []
        for name in names:
            wholes = [readers[seg].column(name) for seg in segments]
            out.append(np.empty((len(rows), *wholes[0].shape[1:]), wholes[0].dtype))
            for seg, whole in zip(segments, wholes, strict=True):
                out[-1][seg_of == seg] = whole[rows[seg_of == seg]]
        return out
