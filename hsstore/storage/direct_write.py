"""Writing a large new file around the page cache (``O_DIRECT``), where the system allows it.

Why: a buffered write costs the writing core a page-cache page per 4 KiB (allocation,
accounting, the copy, later the kernel's writeback), and on a host whose cores also run the
model (a CPU engine) every one of those CPU-seconds is one the forward waits for; on a virtual
machine whose memory was never touched the page allocation alone costs several times the
copy. Shard files are written once, in full, and read later (by then the cache would have
dropped them on a host that writes terabytes), so they need no cached copy.
`tools/bench_direct_write.py` measures the machine's CPU per token both ways, and
`tools/bench_writer_cpu.py` the writer's write stage (``HSSTORE_DIRECT_WRITES=0`` for the
page cache).

How: the pieces are copied into this thread's page-aligned stage of `STAGE_BYTES` and written
a stage at a time; the last, partial stage is written padded with zeros to `ALIGN_BYTES` and
the file cut back to its size. Where the file system refuses direct I/O (``fcntl`` setting
``O_DIRECT`` fails, or a direct write is refused as misaligned before writing anything), the
rest of the file is written through the page cache: the same bytes, the same file.
"""

from __future__ import annotations

import errno
import fcntl
import mmap
import os
import threading
from collections.abc import Sequence

# Direct I/O asks that buffer address, length and file offset be multiples of the device's
# logical block (512 B or 4 KiB); a page is both.
ALIGN_BYTES = 4096
STAGE_BYTES = 4 << 20
# Smaller files (segment metadata, indexes) are written through the page cache: one direct
# write of a few KiB waits for the device, where the cache returns at once.
MIN_BYTES = 1 << 20
SUPPORTED = hasattr(os, "O_DIRECT")
_STAGES = threading.local()


def write_pieces(fd: int, pieces: Sequence[bytes | memoryview], size: int, *, direct: bool) -> None:
    """Write ``pieces`` (bytes, ``size`` in all) to the new, empty file ``fd``; around the
    page cache if ``direct`` and the file system allows it."""
    if not (direct and SUPPORTED and size >= MIN_BYTES and _set_direct(fd, True)):
        # Buffered, so that a shard's small pieces (frame headers, lengths, checksums) are
        # gathered into few system calls, as the stage gathers them on the direct path.
        with open(fd, "wb", closefd=False) as file:
            for piece in pieces:
                file.write(piece)
        return
    stage = _stage()
    filled = 0
    direct_now = True
    for piece in map(_byte_view, pieces):
        at = 0
        while at < piece.nbytes:
            n = min(piece.nbytes - at, STAGE_BYTES - filled)
            stage[filled : filled + n] = piece[at : at + n]
            filled, at = filled + n, at + n
            if filled == STAGE_BYTES:
                direct_now = _write_out(fd, stage, direct=direct_now)
                filled = 0
    if filled:
        if direct_now:
            padded = -(-filled // ALIGN_BYTES) * ALIGN_BYTES
            stage[filled:padded] = bytes(padded - filled)
            direct_now = _write_out(fd, stage[:padded], direct=True)
            os.ftruncate(fd, size)
        else:
            _write_out(fd, stage[:filled], direct=False)


def _write_out(fd: int, view: memoryview, *, direct: bool) -> bool:
    """Write all of ``view``; whether the file is still in direct mode afterwards. A direct
    write refused as misaligned (EINVAL, nothing written) or cut short (what is left no longer
    aligned) goes on through the page cache."""
    while view.nbytes:
        try:
            n = os.write(fd, view)
        except OSError as exc:
            if not direct or exc.errno != errno.EINVAL:
                raise
            direct = _set_direct(fd, False)
            continue
        view = view[n:]
        if view.nbytes and direct:
            direct = _set_direct(fd, False)
    return direct


def _set_direct(fd: int, on: bool) -> bool:
    """Turn ``O_DIRECT`` on or off for ``fd``; whether it is on afterwards (Linux sets it
    through ``fcntl`` and refuses with EINVAL where the file system has no direct I/O)."""
    flags = fcntl.fcntl(fd, fcntl.F_GETFL)
    wanted = flags | os.O_DIRECT if on else flags & ~os.O_DIRECT
    try:
        fcntl.fcntl(fd, fcntl.F_SETFL, wanted)
    except OSError as exc:
        if exc.errno != errno.EINVAL:
            raise
        return False
    return on


def _byte_view(piece: bytes | memoryview) -> memoryview:
    return memoryview(piece).cast("B")


def _stage() -> memoryview:
    """This thread's page-aligned stage (anonymous memory is mapped at a page boundary),
    kept warm for its next file."""
    stage = getattr(_STAGES, "view", None)
    if stage is None:
        stage = _STAGES.view = memoryview(mmap.mmap(-1, STAGE_BYTES))
    return stage
