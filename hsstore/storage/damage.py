"""When a failed read of a committed file is damage: the rule for I/O errors.

A missing file, a wrong size, bytes failing their checksum are damage at once. An I/O error
(EIO) is damage only when it persists, as a bad sector or a failed disk does; one a later read
gets past (a network filesystem's glitch, a path failing over) is not, and must never make a
segment unreadable, let alone make `repair` drop it. See docs/STORAGE.md, "I/O errors".
"""

from __future__ import annotations

import errno
import time
from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING, Any, TypeVar

from hsstore.errors import HsstoreError, IntegrityError

if TYPE_CHECKING:
    from hsstore.storage.store import Storage

# A read failing with EIO is tried again after each of these waits; failing every time (about
# 2 s), its file is reported damaged.
EIO_RETRY_WAITS_S = (0.1, 0.4, 1.5)
# What the report of such a file says (`hsstore.repair` checks those files once more).
PERSISTENT_EIO = "I/O error on each of"

_T = TypeVar("_T")


def read_io(read: Callable[..., _T], *args: Any) -> _T:
    """``read(*args)`` (a storage read of a committed file), with an EIO that persists over
    every retry raised as the IntegrityError naming the file (the damage rule above)."""
    for pause in (*EIO_RETRY_WAITS_S, None):
        try:
            return read(*args)
        except OSError as exc:
            _wait_or_raise(exc, pause)
    raise AssertionError("unreachable")


def read_ranges_into_io(
    storage: Storage, key: str, ranges: Sequence[tuple[int, int]], into: Sequence[memoryview]
) -> list[memoryview]:
    """`Storage.read_ranges` of a committed file into the caller's buffers, taken whole under
    the same rule (`read_io`): an I/O error surfaces while the ranges are read."""
    return read_io(lambda: list(storage.read_ranges(key, ranges, into)))


def read_ranges_io(
    storage: Storage, key: str, ranges: Sequence[tuple[int, int]]
) -> Iterator[memoryview]:
    """`Storage.read_ranges` of a committed file, view by view, under the same rule: a read
    failing with EIO part-way starts again from the range it failed on."""
    done = 0
    for pause in (*EIO_RETRY_WAITS_S, None):
        try:
            for view in storage.read_ranges(key, ranges[done:]):
                yield view
                done += 1
            return
        except OSError as exc:
            _wait_or_raise(exc, pause)


def _wait_or_raise(exc: OSError, pause: float | None) -> None:
    """After a failed try: wait ``pause`` before the next, unless the error is not an EIO or
    this was the last try (then the damage report)."""
    if exc.errno != errno.EIO or isinstance(exc, HsstoreError):
        raise exc
    if pause is None:
        raise IntegrityError(
            f"cannot read: {PERSISTENT_EIO} {len(EIO_RETRY_WAITS_S) + 1} tries over "
            f"{sum(EIO_RETRY_WAITS_S):g} s ({exc.strerror or exc}): the file is damaged",
            path=exc.filename,
        ) from exc
    time.sleep(pause)
