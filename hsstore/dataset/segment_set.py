"""The segments of one version that a view reads: a reader and a sample index for each, and
the segments left out because their index is damaged."""

from __future__ import annotations

import logging
import threading
import warnings
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import pyarrow as pa

from hsstore.errors import HsstoreError, IntegrityError, StorageError
from hsstore.segment.reader import SegmentReader
from hsstore.spec import paths
from hsstore.spec.manifest import Manifest
from hsstore.storage.store import Storage


@dataclass(frozen=True)
class LoadedSegments:
    """What `load_segments` found; ``ids`` are every segment of the version, read or not."""

    ids: tuple[str, ...] = ()
    readers: list[SegmentReader] = field(default_factory=list)
    tables: list[pa.Table] = field(default_factory=list)
    unreadable: dict[str, str] = field(default_factory=dict)


def load_segments(
    storage: Storage,
    manifest: Manifest,
    previous: LoadedSegments | None,
    known: Mapping[str, tuple[SegmentReader, pa.Table]] | None = None,
) -> LoadedSegments:
    """Read the index of each segment of ``manifest`` not in ``previous`` (the segments an
    earlier version of the same view loaded, kept with their readers when the version only
    appends to them) nor in ``known`` (a reader and index already read, by segment id: a
    writer's, which read the segments other writers published)."""
    known = known or {}
    previous = previous or LoadedSegments()
    readers, tables = list(previous.readers), list(previous.tables)
    seen, unreadable = previous.ids, dict(previous.unreadable)
    n = len(seen)
    if tuple(s.id for s in manifest.segments[:n]) != seen:  # a repair removed some
        readers, tables, seen, unreadable = [], [], (), {}
        n = 0
    for info in manifest.segments[n:]:
        # A segment whose index cannot be read is left out of the view, named in
        # `unreadable`: damage stays in the samples it touched (verify names them, and
        # `hsstore.repair` publishes a version without them).
        reader, table = known.get(info.id, (SegmentReader(storage, manifest, info), None))
        try:
            if table is None:
                table = reader.index()
            if table.num_rows != info.num_samples:
                raise IntegrityError(
                    f"index has {table.num_rows} rows, manifest says {info.num_samples}",
                    path=reader.where(paths.INDEX),
                )
        except HsstoreError as exc:
            if not is_damage(exc) or file_intact(reader, paths.INDEX):
                # A storage that failed to answer (the view stays at its old version), or
                # intact bytes that disagree with the manifest: neither is local damage.
                raise
            unreadable[info.id] = str(exc)
            continue
        except OSError as exc:
            if not is_damage(exc):
                raise
            unreadable[info.id] = f"{exc.filename or reader.where(paths.INDEX)}: " + (
                f"cannot read ({exc.strerror or exc})"
            )
            continue
        readers.append(reader)
        tables.append(table)
    return LoadedSegments(tuple(s.id for s in manifest.segments), readers, tables, unreadable)


def is_damage(exc: BaseException) -> bool:
    """Whether a failed read shows damage to committed files (missing, truncated, a FIFO where
    a file belongs, bytes failing their checksum), rather than a storage that failed to answer
    (a network error, an I/O error), which a later read may get past: only damage makes a
    segment unreadable or a sample's read an IntegrityError."""
    if isinstance(exc, HsstoreError):
        return not isinstance(exc, StorageError)
    return isinstance(
        exc, (FileNotFoundError, IsADirectoryError, NotADirectoryError, PermissionError)
    )


def file_intact(reader: SegmentReader, relpath: str) -> bool:
    """Whether a committed file reads with the size and crc32c the manifest recorded."""
    try:
        reader.read_small(relpath)
    except (HsstoreError, OSError):
        return False
    return True


class DamageWarning(UserWarning):
    """A view of a dataset leaves committed samples out (a segment whose index cannot be read),
    or was rebuilt around lost or damaged manifest files: `hsstore repair` makes it whole."""


logger = logging.getLogger("hsstore")
logger.addHandler(logging.NullHandler())  # a library's records go where the application says

# What this process has already said, so a view reopened (a refresh, a loader's worker) does
# not repeat it.
_said: set[tuple[Any, ...]] = set()
_said_lock = threading.Lock()


def left_out_line(ds: Any) -> str | None:
    """One line on the committed samples a view leaves out (segments whose index cannot be
    read): how many, the files, and what to do; None when it leaves none out."""
    if not ds.unreadable:
        return None
    segments = [s for s in ds.manifest.segments if s.id in ds.unreadable]
    samples = sum(s.num_samples for s in segments)
    reasons = [ds.unreadable[s.id] for s in segments]
    which = (
        f"1 segment's index cannot be read ({reasons[0]})"
        if len(segments) == 1
        else f"{len(segments)} segments' indexes cannot be read ({reasons[0]}; also "
        + ", ".join(
            ds.storage.path_of(paths.segment_file(s.id, paths.INDEX)) for s in segments[1:4]
        )
        + (" ..." if len(segments) > 4 else "")
        + ")"
    )
    return (
        f"{samples} of the {ds.manifest.num_samples} committed samples of {ds.storage.root} "
        f"(version {ds.manifest.version}) are left out: {which}; run `hsstore repair "
        f"{ds.storage.root}` to keep every sample that still reads"
    )


def say_what_is_left_out(ds: Any) -> None:
    """Warn (a `DamageWarning` and a log record) that a view leaves committed samples out or
    was rebuilt around lost manifest files, once per process for the same damage."""
    lines = []
    if ds.rebuilt is not None:
        lines.append(ds.rebuilt.describe(ds.storage))
    left_out = left_out_line(ds)
    if left_out is not None:
        lines.append(left_out)
    key = (ds.storage.root, ds.manifest.version, tuple(sorted(ds.unreadable)), bool(ds.rebuilt))
    with _said_lock:
        if not lines or key in _said:
            return
        _said.add(key)
    for line in lines:
        logger.warning(line)
        warnings.warn(line, DamageWarning, stacklevel=4)
