"""Getting a local read's bytes off the disk before its decoding needs them.

`LocalStorage` tells the kernel which byte ranges a read needs next (`posix_fadvise(WILLNEED)`),
so the device reads exactly those instead of the kernel's readahead guess around each read,
and reads them while the CPU decodes. Hints never change what a read returns, and a failed hint
fails nothing: the read that follows reports what is wrong.
"""

from __future__ import annotations

import contextlib
import ctypes
import enum
import errno
import os
import platform
import sys
import threading
from collections.abc import Callable, Sequence

# Hints need posix_fadvise and non-blocking reads (Linux).
SUPPORTED = hasattr(os, "posix_fadvise") and hasattr(os, "RWF_NOWAIT")


class ReadHints(enum.Enum):
    """How a local read gets bytes not yet in the page cache off the disk (`LocalStorage`).

    IN_ORDER (the default where hints work): each range is asked for a few ahead of its
    decoding (`ColdRanges`), so the disk reads exactly what comes next while the CPU decodes.
    ALL_AT_ONCE: one hint for the whole read before its first range, for devices that serve
    many requests in flight better than a few. NONE: no hints, the kernel's own readahead
    around each read (a file system where hints cost more than they bring)."""

    IN_ORDER = "in order"
    ALL_AT_ONCE = "all at once"
    NONE = "none"


# One readahead hint at most: the kernel reads at most the larger of the device's readahead
# window and its largest request per hint (1.25-4 MiB on the devices seen here;
# `force_page_cache_ra`).
HINT_PIECE_BYTES = 1 << 20

PAGE_BYTES = os.sysconf("SC_PAGE_SIZE")

# A cold read asks for this many ranges beyond the one it waits for (`ColdRanges`).
COLD_RANGES_AHEAD = 2


class _Range(ctypes.Structure):
    _fields_ = [("off", ctypes.c_uint64), ("len", ctypes.c_uint64)]


class _CacheStat(ctypes.Structure):
    _fields_ = [
        (name, ctypes.c_uint64)
        for name in ("nr_cache", "nr_dirty", "nr_writeback", "nr_evicted", "nr_recently_evicted")
    ]


_CACHESTAT = 451  # the syscall's number (Linux 6.5+) on every architecture but alpha


def _cachestat_syscall() -> Callable[..., int] | None:
    """libc's ``syscall``, through which `cachestat` is called; None off Linux."""
    if sys.platform != "linux" or platform.machine() == "alpha":
        return None
    try:
        # Through PyDLL, which keeps the GIL: the call takes a microsecond, and a thread that
        # let go of the GIL for it would wait for it back behind the loader's other threads.
        syscall = ctypes.PyDLL(None, use_errno=True).syscall
    except (OSError, AttributeError):
        return None
    syscall.restype = ctypes.c_long
    return syscall


# None once the kernel has refused `cachestat` (older than 6.5, or a seccomp filter).
_syscall = _cachestat_syscall()


_probe = threading.local()  # each thread's cachestat arguments, made once


def cachestat_pages(fd: int, offset: int, nbytes: int = 1) -> int | None:
    """How many of the pages holding bytes [offset, offset + nbytes) of the file are in its page
    cache, by `cachestat`, which looks without reading; None where the kernel lacks it (then
    never asked again)."""
    global _syscall
    syscall = _syscall
    if syscall is None:
        return None
    args = getattr(_probe, "args", None)
    if args is None:
        span, stat = _Range(), _CacheStat()
        args = _probe.args = (span, stat, ctypes.byref(span), ctypes.byref(stat))
    span, stat, span_ref, stat_ref = args
    span.off, span.len = offset, nbytes
    if syscall(_CACHESTAT, fd, span_ref, stat_ref, 0) == 0:
        return stat.nr_cache
    if ctypes.get_errno() in (errno.ENOSYS, errno.EPERM):
        _syscall = None
    return None


def cached(fd: int, offset: int) -> bool:
    """Whether the byte at ``offset`` of the file is in the page cache (or on its way there).

    `cachestat` answers without touching the page. Where the kernel lacks it, a 1-byte read
    that fails with EAGAIN rather than wait for the disk answers instead; such a miss starts
    the read of that page, which on a fast device may land before the read looks again, so
    that probe can call a cold page cached (a hint then skipped, a read then not paced).
    True where neither works, so the caller does nothing it would not have done without it."""
    pages = cachestat_pages(fd, offset)
    if pages is not None:
        return pages > 0
    try:
        os.preadv(fd, [bytearray(1)], offset, os.RWF_NOWAIT)
    except BlockingIOError:
        return False
    except OSError:
        return True
    return True


def resident(fd: int, offset: int, nbytes: int) -> bool:
    """Whether the range is in the page cache: every page of it, by one `cachestat`; where the
    kernel lacks that, judged on its ends (`ends_cached`)."""
    pages = cachestat_pages(fd, offset, nbytes)
    if pages is not None:
        return pages >= (offset + nbytes - 1) // PAGE_BYTES - offset // PAGE_BYTES + 1
    return ends_cached(fd, offset, nbytes)


def ends_cached(fd: int, offset: int, nbytes: int) -> bool:
    """Whether the first and last byte of the span are in the page cache: the test for a span
    that may hold pages no read wants (the layers a read skips), which stay cold in a warm
    file."""
    return cached(fd, offset) and cached(fd, offset + nbytes - 1)


def advise(fd: int, ranges: Sequence[tuple[int, int]], *, unless_resident: bool) -> None:
    """Start reading the ranges from disk now (returns once the reads are queued), so the reads
    that follow wait only for reads already under way.

    Without it a read of an uncached page waits for it, and the kernel's on-demand readahead
    reads around it by its own guess of what comes next, which knows nothing of where a sample
    ends. Pages read this way carry no readahead marks, so the reads that follow start no
    further readahead. The kernel caps one hint at the device's largest request or readahead
    window, hence the pieces.

    With ``unless_resident`` a range already in the page cache is left alone: the hint would
    look up every one of its pages again, so it is probed first (`resident`)."""
    for offset, nbytes in ranges:
        if not nbytes or (unless_resident and resident(fd, offset, nbytes)):
            continue
        for at in range(offset, offset + nbytes, HINT_PIECE_BYTES):
            piece = min(HINT_PIECE_BYTES, offset + nbytes - at)
            os.posix_fadvise(fd, at, piece, os.POSIX_FADV_WILLNEED)


def merged(ranges: Sequence[tuple[int, int]]) -> list[tuple[int, int]]:
    """The ranges, in order, with those that lie back to back merged into one."""
    out: list[tuple[int, int]] = []
    for offset, nbytes in ranges:
        if out and out[-1][0] + out[-1][1] == offset:
            out[-1] = (out[-1][0], out[-1][1] + nbytes)
        else:
            out.append((offset, nbytes))
    return out


class ColdRanges:
    """The ranges of a file that a read decodes in turn, while they are not in memory, asked of
    the disk a few at a time so that they arrive in order, each while an earlier one decodes.

    Asked for all at once (one hint), the ranges share the device's bandwidth and arrive
    together: the decoding starts only once the whole run is in, so a cold read of a small
    compressed sample is its transfer, then its decode. Here the first range is asked for
    alone and arrives after its own transfer; each range, once it is in, asks for those up to
    `COLD_RANGES_AHEAD` beyond it, which come in while it decodes (`tools/bench_cold.py`
    compares the two; docs/PERFORMANCE.md, "Cold reads").
    """

    def __init__(
        self,
        fd: int,
        ranges: Sequence[tuple[int, int]],
        hint: Callable[[Sequence[tuple[int, int]]], None],
    ):
        self.fd, self.ranges, self.hint = fd, ranges, hint
        self.asked = 0  # the first range not asked for yet
        self._probe = bytearray(1)
        self._ask_through(0)

    def arrive(self, k: int) -> None:
        """Range ``k`` is next to decode: wait for its bytes, then ask for the next ones."""
        offset, nbytes = self.ranges[k]
        if nbytes:
            # A read of a page under I/O waits for it (an error is the caller's read's to report).
            with contextlib.suppress(OSError):
                os.preadv(self.fd, [self._probe], offset + nbytes - 1)
        self._ask_through(k + COLD_RANGES_AHEAD)

    def _ask_through(self, last: int) -> None:
        last = min(last, len(self.ranges) - 1)
        if self.asked <= last:
            with contextlib.suppress(OSError):
                self.hint(self.ranges[self.asked : last + 1])
            self.asked = last + 1
