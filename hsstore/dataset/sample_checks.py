"""The whole-sample checksum of a decoded sample, checked in one place: by a read that hashes
the states as they land (`Dataset.read_hidden_into`) and by a batch read that leaves the check
to a thread of its own (`hsstore.dataset.batch_reads.check_decoded`, the loader's checker,
which hashes a batch in one call without the GIL, so that the threads reading the next batch
and training on the last one never wait for it)."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import NoReturn

import numpy as np
import xxhash

from hsstore.dataset.joined_index import JoinedIndex
from hsstore.dataset.segment_set import is_damage
from hsstore.errors import HsstoreError, IntegrityError, StorageError
from hsstore.segment.reader import SegmentReader
from hsstore.segment.rows import ShardRun
from hsstore.spec import paths
from hsstore.spec.sample_index import finish_checksum, span_checksums
from hsstore.storage.store import Storage


def raise_as_sample_error(
    exc: HsstoreError | OSError, storage: Storage, reader: SegmentReader, sample_id: str
) -> NoReturn:
    """Raise a failed read of one sample as the sample's: damage to committed files as an
    `IntegrityError`, a storage that failed to answer as a `StorageError`, both naming it;
    any other OSError as it is. (Reads call this in their ``except``: a context manager per
    sample costs a tenth of hashing a small one.)"""
    if isinstance(exc, HsstoreError):
        cls = IntegrityError if is_damage(exc) else StorageError
        raise cls(exc.message, path=exc.path, sample_id=sample_id) from exc
    if not is_damage(exc):  # a committed file missing or unreadable is damage
        raise exc
    raise IntegrityError(
        f"cannot read a committed file ({exc.strerror or exc})",
        path=exc.filename or storage.path_of(paths.segment_dir(reader.info.id)),
        sample_id=sample_id,
    ) from exc


def hand_off_as_sample(
    runs_to: Callable[[ShardRun], None],
    where: tuple[Storage, SegmentReader, str],
    run: ShardRun,
) -> None:
    """Hand ``run`` (of the sample ``where`` names) on to ``runs_to``, to be decoded there:
    its errors are still raised as the sample's (`raise_as_sample_error`)."""
    run.report = lambda exc: raise_as_sample_error(exc, *where)
    runs_to(run)


def segment_columns(reader: SegmentReader) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
    """A segment's ``input_ids``, ``loss_mask`` and (scaled tiers) scales columns, whole, in
    the order a sample checksum covers them after the states (`finish_checksum`)."""
    scaled = reader.manifest.scaled
    scales = reader.column(paths.SCALES) if scaled else None
    return reader.column("input_ids"), reader.column("loss_mask"), scales


def token_columns(
    reader: SegmentReader, row: int, n: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
    """The stored ``input_ids``, ``loss_mask`` and (scaled tiers) scales of rows [row, row+n)."""
    ids, mask, scales = segment_columns(reader)
    return (
        ids[row : row + n],
        mask[row : row + n],
        None if scales is None else scales[row : row + n],
    )


def check_sample(
    hasher: xxhash.xxh3_64,
    columns: tuple[np.ndarray, np.ndarray, np.ndarray | None],
    expected: int,
    storage: Storage,
    reader: SegmentReader,
    sample_id: str,
) -> None:
    """Raise unless ``hasher`` (fed the sample's states bytes) and its token ``columns`` give
    the checksum its index records."""
    if finish_checksum(hasher, *columns) != expected:
        raise IntegrityError(
            "sample checksum mismatch (corrupted bytes)",
            path=storage.path_of(paths.segment_dir(reader.info.id)),
            sample_id=sample_id,
        )


def check_samples(
    decoded: np.ndarray,
    unchecked: Iterable[tuple[int, int]],
    index: JoinedIndex,
    readers: Sequence[SegmentReader],
    sample_ids: Sequence[str],
) -> None:
    """Verify the checksum of each sample ``i`` decoded into ``decoded[row:]`` (the storage
    view of a batch's rows) for each ``(i, row)`` of ``unchecked``: all of them in one call
    that lets go of the GIL (`span_checksums`), where it can; sample by sample from the first
    that fails it, so that its error names what is wrong."""
    unchecked = list(unchecked)
    failed = _first_failing(decoded, unchecked, index, readers)
    if failed == -1:
        return
    for i, first in unchecked[failed or 0 :]:
        reader = readers[index.segment[i]]
        row, n = int(index.row[i]), int(index.len[i])
        try:
            hasher = xxhash.xxh3_64(decoded[first : first + n])
            check_sample(hasher, token_columns(reader, row, n), int(index.checksum[i]),
                         reader.storage, reader, sample_ids[i])  # fmt: skip
        except (HsstoreError, OSError) as exc:
            raise_as_sample_error(exc, reader.storage, reader, sample_ids[i])


def _first_failing(
    decoded: np.ndarray,
    unchecked: list[tuple[int, int]],
    index: JoinedIndex,
    readers: Sequence[SegmentReader],
) -> int | None:
    """The position in ``unchecked`` of the first sample whose checksum fails (`failing_samples`);
    -1 if none does, None where they cannot be hashed so."""
    if not unchecked:
        return -1
    pos = np.array([i for i, _ in unchecked], np.int64)
    first = np.array([row for _, row in unchecked], np.int64)
    failing = failing_samples(decoded, pos, first, index, readers)
    if failing is None:
        return None
    return int(failing[0]) if len(failing) else -1


def failing_samples(
    decoded: np.ndarray,
    pos: np.ndarray,
    first: np.ndarray,
    index: JoinedIndex,
    readers: Sequence[SegmentReader],
) -> np.ndarray | None:
    """Which of the samples ``pos[k]``, decoded into ``decoded[first[k]:]``, fail their checksum
    (their k, ascending), all hashed in one call (`span_checksums`: each sample's rows of
    ``decoded``, then its rows of each column, in the order of `token_columns`); None where that
    call cannot be made (or a column cannot be read: a sample-by-sample check then names the
    sample)."""
    if not len(pos):
        return np.empty(0, np.int64)
    segment, row, n = index.segment[pos], index.row[pos], index.len[pos]
    states = decoded.reshape(decoded.shape[0], -1).view(np.uint8)
    buffers: list[np.ndarray] = [states]
    column_at = np.zeros(len(pos), np.int64)  # where each sample's segment's columns are
    widths: list[int] | None = None  # bytes per row of each column
    try:
        for seg in np.unique(segment).tolist():
            columns = [c for c in segment_columns(readers[seg]) if c is not None]
            if widths not in (None, [c.strides[0] for c in columns]) or not all(
                c.flags.c_contiguous for c in columns
            ):
                return None
            widths = [c.strides[0] for c in columns]
            column_at[segment == seg] = len(buffers)
            buffers += columns
    except (HsstoreError, OSError):
        return None
    assert widths is not None
    spans = np.empty((len(pos), 1 + len(widths), 3), np.int64)
    spans[:, 0] = np.stack([np.zeros_like(pos), first * states.shape[1], n * states.shape[1]], 1)
    for j, width in enumerate(widths):
        spans[:, 1 + j] = np.stack([column_at + j, row * width, n * width], 1)
    try:
        digests = span_checksums(buffers, spans)
    except ValueError:  # rows past a column's end: the sample-by-sample check names them
        return None
    if digests is None:
        return None
    return np.flatnonzero(digests != index.checksum[pos].astype(np.uint64))
