"""verify's sample pass: every sample decoded and checked against its checksum, a window of
consecutive samples of one segment at a time.

A window is one read of a few MiB of rows (`SegmentReader.read_rows`) and one hashing call for
all of its samples (`failing_samples`), done on a pool of threads a few windows ahead of the
thread that collects them. The time goes by bytes rather than by samples, and what is held is
the windows being decoded and the index and token columns of the segments they belong to,
however many samples the dataset has. A sample that does not pass in its window is read again
alone, as `Dataset.read` reads it: the error that read raises is what names its damage.
"""

from __future__ import annotations

import contextlib
from collections import deque
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import replace

import numpy as np
import pyarrow as pa
import xxhash

from hsstore.cores import default_read_threads
from hsstore.dataset.dataset import Dataset
from hsstore.dataset.joined_index import JoinedIndex
from hsstore.dataset.sample_checks import failing_samples, token_columns
from hsstore.errors import HsstoreError, IntegrityError
from hsstore.segment.reader import SegmentReader
from hsstore.segment.row_reads import HandedOff, InShares
from hsstore.segment.rows import ShardRun
from hsstore.spec.manifest import Manifest
from hsstore.spec.sample_index import finish_checksum
from hsstore.storage.damage import read_ranges_io
from hsstore.storage.store import Storage

# Rows of states one window decodes: large enough that the per-window work (a read call, a
# hashing call, a few numpy operations) is small beside the bytes, small enough that the
# windows being decoded at once stay a few tens of MiB.
WINDOW_BYTES = 8 << 20

Checked = Callable[[int, int], None]  # (samples, their states bytes): a window is done
Failed = Callable[[str, HsstoreError | OSError], None]  # (sample id, why): a sample is bad


class _Segment:
    """One segment's samples, cut into windows, and the reads of them."""

    def __init__(
        self, storage: Storage, manifest: Manifest, reader: SegmentReader, index: pa.Table
    ):
        self.storage, self.manifest, self.reader = storage, manifest, reader
        self.index = JoinedIndex([index])
        self.ids = index.column("sample_id")
        self.ends = self.index.row + self.index.len
        self.row_bytes = (
            manifest.num_layers * manifest.hidden_size * manifest.storage_dtype.itemsize
        )
        self._alone: Dataset | None = None
        self.threads = default_read_threads()  # a large sample's share of chunks, as `Dataset.read`

    def windows(self) -> list[tuple[int, int]]:
        """Samples [a, b) of each window: consecutive samples spanning at most `WINDOW_BYTES`
        of rows (a larger sample alone)."""
        rows = max(1, WINDOW_BYTES // self.row_bytes)
        starts, out, a = self.index.row, [], 0
        while a < self.index.num_samples:
            b = max(a + 1, int(np.searchsorted(self.ends, starts[a] + rows, "right")))
            out.append((a, b))
            a = b
        return out

    def nbytes(self, a: int, b: int) -> int:
        """The states bytes of samples [a, b) (their tokens, without padding rows)."""
        return int(self.index.len[a:b].sum()) * self.row_bytes

    def check_window(self, a: int, b: int) -> np.ndarray:
        """Samples [a, b) decoded at once and hashed in one call; those that do not pass, or
        all of them where the window does not read or cannot be hashed so."""
        lo, hi = int(self.index.row[a]), int(self.ends[b - 1])
        man = self.manifest
        out = np.empty((hi - lo, man.num_layers, man.hidden_size), man.storage_dtype)
        everyone = np.arange(a, b)
        if b - a == 1:  # a sample as large as a window: hashed as its rows land, in cache
            return everyone if self._fails_alone(a, out) else everyone[:0]
        try:
            # No chunk crc: each sample's checksum covers its decoded bytes.
            self.reader.read_rows(lo, hi, None, out, HandedOff(_read_as_one, crc=False))
        except (HsstoreError, OSError):
            return everyone
        failing = failing_samples(out, everyone, self.index.row[a:b] - lo, self.index,
                                  [self.reader])  # fmt: skip
        if failing is None:
            return self._hash_each(out, a, b)
        return everyone[failing]

    def _fails_alone(self, k: int, out: np.ndarray) -> bool:
        """Whether sample ``k``, decoded into ``out`` and hashed as it lands, fails to read or
        to match its checksum."""
        row, n = int(self.index.row[k]), int(self.index.len[k])
        hasher = xxhash.xxh3_64()
        try:
            self.reader.read_rows(row, row + n, None, out, InShares(self.threads, hasher))
            columns = token_columns(self.reader, row, n)
        except (HsstoreError, OSError):
            return True
        return finish_checksum(hasher, *columns) != int(self.index.checksum[k])

    def _hash_each(self, out: np.ndarray, a: int, b: int) -> np.ndarray:
        """`check_window`'s hashing sample by sample, where it cannot be done in one call."""
        states, lo = out.reshape(len(out), -1), int(self.index.row[a])
        failing = []
        try:
            for k in range(a, b):
                row, n = int(self.index.row[k]), int(self.index.len[k])
                hasher = xxhash.xxh3_64(states[row - lo : row - lo + n])
                columns = token_columns(self.reader, row, n)
                if finish_checksum(hasher, *columns) != int(self.index.checksum[k]):
                    failing.append(k)
        except (HsstoreError, OSError):  # a column that does not read: each sample names it
            return np.arange(a, b)
        return np.array(failing, np.int64)

    def read_alone(self, k: int) -> HsstoreError | OSError | None:
        """What reading sample ``k`` alone raises (None when it reads and checks out); an
        OSError of its read that is not damage is raised, as `Dataset.read` raises it."""
        try:
            if self._alone is None:
                self._alone = Dataset(
                    self.storage,
                    verify_reads=True,
                    manifest=replace(self.manifest, segments=(self.reader.info,)),
                )
        except (HsstoreError, OSError) as exc:  # its index, read once already, fails now
            return exc
        try:
            self._alone.read(k)
        except HsstoreError as exc:
            return exc
        return None

    def sample_id(self, k: int) -> str:
        return str(self.ids[k])


def _read_as_one(run: ShardRun) -> None:
    """Decode ``run``'s chunks from one read of the bytes they span where they lie back to back
    (as a segment's chunks are written): on small chunks, a read per chunk costs as much again
    as decoding it."""
    ranges = run.ranges
    start, end = ranges[0][0], ranges[-1][0] + ranges[-1][1]
    back_to_back = end - start == sum(nbytes for _, nbytes in ranges)
    reading = read_ranges_io(
        run.storage, run.key, [(start, end - start)] if back_to_back else ranges
    )
    if back_to_back:
        span = next(reading)
        if len(span) != end - start:
            raise IntegrityError("shard is truncated", path=run.where)
        run.decode(span[offset - start : offset - start + nbytes] for offset, nbytes in ranges)
    else:
        run.decode(reading)
    for _ in reading:  # none left: this ends the read, and the storage releases what it held
        pass


class SamplePass:
    """Checks the samples of the segments `add`-ed, in order, on ``workers`` threads; reports
    each window checked to ``checked`` and each bad sample to ``failed``, in sample order, on
    the calling thread (`sample_pass`)."""

    def __init__(
        self,
        storage: Storage,
        manifest: Manifest,
        *,
        workers: int,
        checked: Checked,
        failed: Failed,
    ):
        self.storage, self.manifest = storage, manifest
        self.checked, self.failed = checked, failed
        self.pool = ThreadPoolExecutor(workers, thread_name_prefix="hsstore-verify")
        # Windows queued beyond those being decoded: enough to keep every thread busy while
        # this one collects; a queued window holds no buffer yet.
        self.ahead = 2 * workers
        self.pending: deque[tuple[_Segment, int, int, Future[np.ndarray]]] = deque()

    def add(self, reader: SegmentReader, index: pa.Table) -> None:
        """Check every sample of ``reader``'s segment (``index``: its sample index, read)."""
        segment = _Segment(self.storage, self.manifest, reader, index)
        for a, b in segment.windows():
            self.pending.append((segment, a, b, self.pool.submit(segment.check_window, a, b)))
            self.collect(keep=self.ahead)

    def collect(self, *, keep: int) -> None:
        """Report the windows done, oldest first, until at most ``keep`` are left."""
        while len(self.pending) > keep:
            segment, a, b, window = self.pending.popleft()
            for k in window.result().tolist():
                why = segment.read_alone(k)
                if why is not None:
                    self.failed(segment.sample_id(k), why)
            self.checked(b - a, segment.nbytes(a, b))

    def close(self) -> None:
        """Stop: windows not started are dropped, those being decoded waited for."""
        for *_, window in self.pending:
            window.cancel()
        self.pool.shutdown(wait=True)


@contextlib.contextmanager
def sample_pass(
    storage: Storage, manifest: Manifest, *, workers: int, checked: Checked, failed: Failed
) -> Iterator[SamplePass]:
    """A `SamplePass` whose every window is checked and reported when the block ends."""
    samples = SamplePass(storage, manifest, workers=workers, checked=checked, failed=failed)
    try:
        yield samples
        samples.collect(keep=0)
    finally:
        samples.close()
