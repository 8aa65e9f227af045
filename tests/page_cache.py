"""What the page cache holds of a file, asked of the kernel without reading it, and emptying
it: for the tests of reads that must find their bytes on the disk and of writes that must
leave none in the cache."""

from __future__ import annotations

import ctypes
import mmap
import os
from pathlib import Path

PAGE = mmap.PAGESIZE


def evict(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)  # dirty pages cannot be dropped
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


_libc = ctypes.CDLL(None, use_errno=True)
_libc.mmap.restype = ctypes.c_void_p
_libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int,
                       ctypes.c_long]  # fmt: skip
_libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
_libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_char_p]


def cached_pages(path: Path) -> list[int]:
    """The page numbers of the file that are in the page cache (`mincore`, which, unlike a
    probing read, starts no readahead of its own)."""
    size = os.path.getsize(path)
    fd = os.open(path, os.O_RDONLY)
    try:
        addr = _libc.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
        assert addr not in (None, ctypes.c_void_p(-1).value), ctypes.get_errno()
        try:
            vec = ctypes.create_string_buffer(-(-size // PAGE))
            assert _libc.mincore(addr, size, vec) == 0, ctypes.get_errno()
            return [p for p, flag in enumerate(vec.raw) if flag & 1]
        finally:
            _libc.munmap(addr, size)
    finally:
        os.close(fd)


def evictable(path: Path) -> bool:
    """Whether this file system drops clean pages on request (tmpfs keeps them)."""
    evict(path)
    return not cached_pages(path)
