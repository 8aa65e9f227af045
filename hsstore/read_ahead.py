"""Getting a read's bytes off storage before its decoding needs them.

Where the storage `reads_ahead` (local disk), a read tells it which byte ranges come next
(`Storage.will_read`), so the device reads exactly those instead of the readahead window
around a page fault, and reads them while the CPU decodes. Hints never change what a read
returns, and a failed hint fails nothing: the read that follows reports what is wrong.
"""

from __future__ import annotations

import contextlib

import numpy as np

from hsstore.format import zarr_meta
from hsstore.format.store import Storage


def chunk_ranges(entries: np.ndarray, layer_chunks: list[int]) -> list[tuple[int, int]]:
    """The (offset, nbytes) ranges of a shard's chunks that a read is about to decode
    (``entries``: its shard index rows for those row chunks; ``layer_chunks``: the layer
    chunks it reads), merged where they lie back to back."""
    ranges: list[tuple[int, int]] = []
    for row in entries.tolist():
        for j in layer_chunks:
            offset, nbytes = row[j]
            if offset == zarr_meta.EMPTY:
                continue  # reported by the read itself
            if ranges and ranges[-1][0] + ranges[-1][1] == offset:
                ranges[-1] = (ranges[-1][0], ranges[-1][1] + nbytes)
            else:
                ranges.append((offset, nbytes))
    return ranges


# A cold read asks for this many chunks beyond the one it waits for (`ColdChunks`).
COLD_CHUNKS_AHEAD = 2


class ColdChunks:
    """The chunks of one shard that a read decodes, while they are not in memory, asked of
    the storage a few at a time so that they arrive in order, each while an earlier one
    decodes.

    Asked for all at once (one hint), the chunks share the device's bandwidth and arrive
    together: the decoding starts only once the whole run is in, so a cold read of a small
    compressed sample was its transfer, then its decode. Here the first chunk is asked for
    alone and arrives after its own transfer; each chunk, once it is in, asks for those up to
    `COLD_CHUNKS_AHEAD` beyond it, which come in while it decodes. On a disk moving ~1 GB/s,
    every read cold: 1.10-1.24x the speed of all-at-once hints on small samples, 1.28-1.29x on
    large ones (`tools/bench_cold.py`; docs/PERFORMANCE.md, "Cold reads").
    """

    def __init__(
        self,
        storage: Storage,
        key: str,
        mapped: memoryview,
        chunks: dict[int, list[tuple[int, int]]],
    ):
        self.storage, self.key, self.mapped, self.chunks = storage, key, mapped, chunks
        self.asked = min(chunks)  # the first row chunk not asked for yet
        self._ask_through(self.asked)

    @classmethod
    def start(
        cls,
        storage: Storage,
        key: str,
        mapped: memoryview,
        entries: np.ndarray,
        first: int,
        layer_chunks: list[int],
    ) -> ColdChunks | None:
        """Row chunks ``first, first + 1, ...`` (``entries``: their rows of the shard index)
        are about to be decoded from ``mapped``: None if their bytes are in memory already
        (judged on the first and last), else a stream that has asked for the first chunk."""
        chunks: dict[int, list[tuple[int, int]]] = {}
        for c, row in enumerate(entries.tolist(), start=first):
            ranges = [(row[j][0], row[j][1]) for j in layer_chunks if row[j][0] != zarr_meta.EMPTY]
            if ranges:
                chunks[c] = ranges
        if not chunks:
            return None
        lo = min(offset for ranges in chunks.values() for offset, _ in ranges)
        hi = max(offset + nbytes for ranges in chunks.values() for offset, nbytes in ranges)
        # Out of bounds: the read reports the truncated shard. A hint fails nothing: the read
        # that follows needs the same descriptor and bytes, and reports what is wrong.
        try:
            if hi > len(mapped) or storage.resident(key, lo, hi - lo):
                return None
            return cls(storage, key, mapped, chunks)
        except OSError:
            return None

    def arrive(self, c: int) -> None:
        """Row chunk ``c`` is next to decode: wait for its bytes, then ask for the next ones."""
        ranges = self.chunks.get(c)
        if ranges is None:
            return
        offset, nbytes = ranges[-1]
        self.mapped[offset + nbytes - 1]  # noqa: B018 (a fault on a page under I/O waits for it)
        self._ask_through(c + COLD_CHUNKS_AHEAD)

    def _ask_through(self, last: int) -> None:
        while self.asked <= last:
            ranges = self.chunks.get(self.asked)
            self.asked += 1
            if ranges is not None:
                with contextlib.suppress(OSError):
                    self.storage.will_read(self.key, ranges, unless_resident=False)
