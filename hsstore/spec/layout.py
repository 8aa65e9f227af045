"""The chunk and shard layout of segments (`Layout`), how one is chosen, and its bounds."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from hsstore.errors import FormatError

# Sample-aligned layouts: chunks of ~1 MiB and at most 32 rows (why: `Layout.choose`).
ALIGNED_CHUNK_BYTES = 1 << 20
ALIGNED_MAX_ROWS = 32
# The largest decoded chunk a manifest may claim, so a hostile or damaged one cannot make a
# reader allocate without limit. Far above any real model (hidden 16k, 200 stored layers).
MAX_CHUNK_BYTES = 1 << 30


@dataclass(frozen=True)
class Layout:
    """How the [tokens, layers, hidden] state array of a segment is cut into chunks and shards.

    ``sample_aligned``: every sample starts at a chunk boundary (the rows after a sample, up to
    the next boundary, are zero padding that belongs to no sample), so a chunk never holds the
    rows of two samples and reading a sample decodes nothing of its neighbours.
    """

    rows_per_chunk: int
    chunks_per_shard: int
    layers_per_chunk: int
    sample_aligned: bool = False

    @property
    def rows_per_shard(self) -> int:
        return self.rows_per_chunk * self.chunks_per_shard

    def start_row(self, rows: int) -> int:
        """Where the next sample starts in a segment whose samples fill ``rows`` rows."""
        if self.sample_aligned:
            return -(-rows // self.rows_per_chunk) * self.rows_per_chunk
        return rows

    def to_json(self) -> dict[str, Any]:
        return {
            "rows_per_chunk": self.rows_per_chunk,
            "chunks_per_shard": self.chunks_per_shard,
            "layers_per_chunk": self.layers_per_chunk,
            "sample_aligned": self.sample_aligned,
        }

    @classmethod
    def choose(
        cls,
        *,
        num_layers: int,
        hidden_size: int,
        itemsize: int,
        layers_per_chunk: int | None = None,
        chunk_bytes: int | None = None,
        shard_bytes: int = 64 << 20,
        sample_aligned: bool = False,
    ) -> Layout:
        """Rows per chunk: the largest power of two within ``chunk_bytes`` (~1 MiB by default);
        ~64 MiB shards.

        Sample-aligned layouts also keep chunks to at most 32 rows: each sample pads its last
        chunk (half a chunk on average), so the padding stays at ~16 rows per sample (a few
        percent of LLM-length samples), while LLM-sized rows (10-60 KiB) still make chunks of
        0.3-1 MiB, which decode at full speed (a decode call costs ~10 us on top of its bytes).
        """
        if chunk_bytes is None:
            chunk_bytes = ALIGNED_CHUNK_BYTES if sample_aligned else 1 << 20
        sizes = {"num_layers": num_layers, "hidden_size": hidden_size, "itemsize": itemsize}
        sizes |= {"chunk_bytes": chunk_bytes, "shard_bytes": shard_bytes}
        for what, n in sizes.items():  # a zero or negative size would never end the loop below
            if isinstance(n, bool) or not isinstance(n, int) or n < 1:
                raise FormatError(f"{what} must be a positive integer, got {n!r}")
        lpc = num_layers if layers_per_chunk is None else layers_per_chunk
        if lpc < 1 or num_layers % lpc:
            raise FormatError(f"layers_per_chunk={lpc} must divide the layer count {num_layers}")
        row_bytes = lpc * hidden_size * itemsize
        max_rows = ALIGNED_MAX_ROWS if sample_aligned else 1 << 30
        rows = 1
        while rows * 2 * row_bytes <= chunk_bytes and rows * 2 <= max_rows:
            rows *= 2
        chunk = rows * row_bytes * (num_layers // lpc)
        chunks = max(1, min(1024, shard_bytes // max(chunk, 1)))
        return cls(
            rows_per_chunk=rows,
            chunks_per_shard=int(chunks),
            layers_per_chunk=lpc,
            sample_aligned=sample_aligned,
        )
