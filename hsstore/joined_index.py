"""The sample index of every segment of a dataset's version, joined: one row per sample."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import pyarrow as pa

from hsstore.format.sample_index import INDEX_SCHEMA


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
