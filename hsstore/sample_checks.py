"""The whole-sample checksum of a decoded sample, checked in one place: by a read that hashes
the states as they land (`Dataset.read_hidden_into`) and by a batch read that leaves the check
to a thread of its own (`Dataset.check_decoded`, the loader's checker)."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import NoReturn

import numpy as np
import xxhash

from hsstore.errors import HsstoreError, IntegrityError, StorageError
from hsstore.format import paths
from hsstore.format.sample_index import finish_checksum
from hsstore.format.store import Storage
from hsstore.joined_index import JoinedIndex
from hsstore.segment import SegmentReader
from hsstore.segment_rows import ShardRun
from hsstore.segment_set import is_damage


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


def token_columns(
    reader: SegmentReader, row: int, n: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
    """The stored ``input_ids``, ``loss_mask`` and (scaled tiers) scales of rows [row, row+n)."""
    ids = reader.column("input_ids")[row : row + n]
    mask = reader.column("loss_mask")[row : row + n]
    scaled = reader.manifest.scaled
    return ids, mask, reader.column(paths.SCALES)[row : row + n] if scaled else None


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
    view of a batch's rows) for each ``(i, row)`` of ``unchecked``: one loop, one ``except``."""
    for i, first in unchecked:
        reader = readers[index.segment[i]]
        row, n = int(index.row[i]), int(index.len[i])
        try:
            hasher = xxhash.xxh3_64(decoded[first : first + n])
            check_sample(hasher, token_columns(reader, row, n), int(index.checksum[i]),
                         reader.storage, reader, sample_ids[i])  # fmt: skip
        except (HsstoreError, OSError) as exc:
            raise_as_sample_error(exc, reader.storage, reader, sample_ids[i])
