"""`check_shard`: re-reading one whole shard of a segment for `verify`."""

from __future__ import annotations

from dataclasses import dataclass, field

from hsstore.errors import HsstoreError, IntegrityError
from hsstore.segment.reader import SegmentReader
from hsstore.spec import paths
from hsstore.spec.segment_layout import EMPTY, ShardIndex
from hsstore.storage.damage import read_io


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


def check_shard(reader: SegmentReader, shard: int) -> ShardCheck:
    """Re-read one whole shard: its size, index, and every chunk's crc32c and decoded size.
    Never raises for damage; the result names the rows each problem affects."""
    layout = reader.manifest.layout
    lo = shard * layout.rows_per_shard
    report = ShardCheck(shard, (lo, min(lo + layout.rows_per_shard, reader.info.num_rows)))
    relpath = paths.shard_relpath(shard)
    where = reader.where(relpath)
    try:
        size = reader.shard_size(shard)
        data = memoryview(read_io(reader.storage.read_bytes, reader.key(relpath)))
        report.nbytes = len(data)
        if len(data) != size:
            raise IntegrityError("shard changed size while being read", path=where)
        idx = reader.parse_shard_index(
            data[size - reader.index_nbytes :], size - reader.index_nbytes, where
        )
    except IntegrityError as exc:
        report.error = exc.message
        return report
    except OSError as exc:  # unreadable (permissions, I/O error): damage all the same
        report.error = f"cannot read shard ({exc.strerror or exc})"
        return report
    rpc = layout.rows_per_chunk
    if _whole_shard_passes(reader, idx, data, lo):
        return report
    for local in range(layout.chunks_per_shard):
        c = shard * layout.chunks_per_shard + local
        rows = (c * rpc, min((c + 1) * rpc, reader.info.num_rows))
        for j in range(reader.n_layer_chunks):
            offset, nbytes = idx.chunk(local, j)
            if offset == EMPTY:
                if rows[0] < rows[1]:
                    report.chunks.append(
                        ChunkProblem((c, j), rows, "chunk of committed rows is missing")
                    )
                continue
            try:
                reader.codec.check(
                    data[offset : offset + nbytes], reader.manifest.chunk_nbytes, what=where
                )
            except HsstoreError as exc:
                report.chunks.append(ChunkProblem((c, j), rows, exc.message))
    return report


def _whole_shard_passes(reader: SegmentReader, idx: ShardIndex, data: memoryview, lo: int) -> bool:
    """Whether every chunk of committed rows is there and every chunk there passes its checks,
    all checked at once: the common case, where there is nothing to name."""
    layout = reader.manifest.layout
    entries = idx.entries.reshape(layout.chunks_per_shard, -1, 2)
    committed = -(-(reader.info.num_rows - lo) // layout.rows_per_chunk)  # row chunks
    present = entries[:, :, 0] != EMPTY
    if not present[: max(committed, 0)].all():
        return False
    chunks = entries[present]
    return reader.codec.all_pass(data, chunks[:, 0], chunks[:, 1], reader.manifest.chunk_nbytes)
