"""Keeping the HTTP client's response buffers in the heap rather than in fresh pages.

obstore collects each ranged GET's body into one buffer of the range's size (up to
`object_store.SPLIT_BYTES`, 16 MiB), allocated by the process's ``malloc`` on one of the tokio
runtime's threads and freed once the bytes are copied out. glibc serves a block of 128 KiB or
more with its own ``mmap`` and returns it with ``munmap`` (its threshold rises only after such a
block is freed, and each arena gives back any free top of heap past twice that threshold), so
under many requests in flight most bodies land in pages the kernel must fault in and zero
first, a cost per byte on the scale of the read itself (docs/PERFORMANCE.md, "Remote reads").
Raising both thresholds once keeps those blocks in the arenas, where the next response reuses
them.

The setting is process-wide and lasts, so it is made only when asked
(`hsstore.tuning.tune_process`, which the command line and the loader call; importing hsstore or
opening a storage never does), only on glibc, only once, and never over a choice the user made through glibc's own environment
variables (``MALLOC_MMAP_THRESHOLD_``, ``MALLOC_TRIM_THRESHOLD_``, ``MALLOC_TOP_PAD_``,
``MALLOC_MMAP_MAX_``) or with ``HSSTORE_MALLOC_TUNING=0``. Its cost is memory kept for reuse: each arena keeps up to
`TRIM_THRESHOLD` of free heap instead of returning it.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import os
import platform

from hsstore import settings

# glibc's mallopt parameters (malloc.h).
_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
# Blocks below this come from the arenas: every response buffer (16 MiB at most) with room.
MMAP_THRESHOLD = 32 << 20
# Free heap an arena keeps: a few batches of responses in flight.
TRIM_THRESHOLD = 64 << 20
_GLIBC_VARIABLES = (
    "MALLOC_MMAP_THRESHOLD_",
    "MALLOC_TRIM_THRESHOLD_",
    "MALLOC_TOP_PAD_",
    "MALLOC_MMAP_MAX_",
)


@functools.cache
def keep_response_buffers() -> bool:
    """Raise glibc's mmap and trim thresholds once per process (see the module's docstring);
    True when they are set (now or before), False where this process leaves malloc alone.
    (Two threads racing on the first call both set the same values, which is harmless.)"""
    if not settings.current().malloc_tuning:
        return False
    if any(name in os.environ for name in _GLIBC_VARIABLES):
        return False
    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    # mallopt returns 1 on success; the mmap threshold first, since setting it also fixes the
    # trim threshold's dynamic adjustment.
    return bool(
        mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD) and mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD)
    )
