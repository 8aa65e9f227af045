"""`LocalStorage`: a dataset in a local directory.

Put-if-absent is a hard link of a fully written, fsynced temporary file, which is atomic and
fails if the name exists. Reads are `preadv`s through a bounded cache of descriptors (a batch
of many ranges in one call from C, `_pread_many.c`); bytes not yet in the page cache are asked
of the disk ahead of their use (`hsstore.storage.read_ahead`). No read goes through a memory
map, so an unreadable sector is an EIO, never a SIGBUS.
"""

from __future__ import annotations

import array
import contextlib
import functools
import os
import shutil
import stat
import threading
import uuid
from collections import OrderedDict
from collections.abc import Callable, Iterable, Iterator, Sequence
from pathlib import Path

from hsstore import settings
from hsstore.errors import FormatError, NotADatasetError, no_such_path
from hsstore.storage import direct_write, read_ahead
from hsstore.storage._pread_many import pread_spans
from hsstore.storage.read_ahead import ReadHints
from hsstore.storage.store import TEMP_PREFIX, ObjectInfo, Storage, holds

# A run of ranges read with one `preadv`: at most this many bytes (then the next run), at
# most this many gap bytes between two ranges, at most this many buffers (IOV_MAX is 1024).
_RUN_BYTES = 4 << 20
_GAP_BYTES = 64
_MAX_IOV = 1000
# Where the gaps of a run go: bytes never looked at, so every thread shares it.
_JUNK = memoryview(bytearray(_GAP_BYTES))
# A buffer of the reading thread's that a read without ``into`` lands its ranges in, one after
# another: a copy that sits in the core's cache decodes without faulting in the pages of a
# memory map of the page cache (which would also have to be dropped again, or the process's
# RSS grows with the data read).
_STAGING = threading.local()
_STAGING_MIN_BYTES = 64 << 10


class LocalStorage(Storage):
    """A dataset in a local directory."""

    def __init__(
        self,
        root: str | os.PathLike[str],
        *,
        max_open_files: int = 128,
        read_hints: ReadHints | None = None,
        direct_writes: bool | None = None,
    ):
        """``read_hints``: how reads get bytes off the disk (`ReadHints`; default IN_ORDER
        where the system supports hints, else NONE). ``direct_writes``: whether large files
        are written around the page cache (`hsstore.storage.direct_write`; default: the
        ``HSSTORE_DIRECT_WRITES`` setting, on)."""
        self.root = str(Path(root).expanduser())
        self.direct_writes = (
            settings.current().direct_writes if direct_writes is None else direct_writes
        )
        supported = ReadHints.IN_ORDER if read_ahead.SUPPORTED else ReadHints.NONE
        self.read_hints = read_hints or supported
        # key -> [fd, readers using it]. A descriptor evicted while a thread still reads
        # through it is closed by the last user (closing it under a reader could hand its
        # number to another file mid-read).
        self._fds: OrderedDict[str, list[int]] = OrderedDict()
        self._evicted: dict[int, int] = {}
        self._fd_lock = threading.Lock()
        self._max_open = max_open_files
        self._pid = os.getpid()

    def _abs(self, key: str) -> str:
        return os.path.join(self.root, key)

    def read_bytes(self, key: str) -> bytes:
        fd = _open_regular(self._abs(key))
        with open(fd, "rb", closefd=True) as f:
            return f.read()

    def _open_fd(self, key: str) -> int:
        """The cached descriptor of ``key``, held until `_release_fd` (plain calls rather than a
        context manager: this runs on every read, where a generator's cost showed)."""
        with self._fd_lock:
            # Descriptors are per process: after a fork, start a fresh cache (never close the
            # parent's numbers, which the parent still uses).
            if self._pid != os.getpid():
                self._fds, self._evicted, self._pid = OrderedDict(), {}, os.getpid()
            entry = self._fds.get(key)
            if entry is None:
                entry = self._fds[key] = [_open_regular(self._abs(key)), 0]
                while len(self._fds) > self._max_open:
                    _, (old, users) = self._fds.popitem(last=False)
                    if users:
                        self._evicted[old] = users
                    else:
                        os.close(old)
            else:
                self._fds.move_to_end(key)
            entry[1] += 1
            return entry[0]

    def _release_fd(self, key: str, fd: int) -> None:
        with self._fd_lock:
            current = self._fds.get(key)
            if current is not None and current[0] == fd:
                current[1] -= 1
            elif fd in self._evicted:
                self._evicted[fd] -= 1
                if not self._evicted[fd]:
                    del self._evicted[fd]
                    os.close(fd)

    def read_ranges(
        self,
        key: str,
        ranges: Sequence[tuple[int, int]],
        into: Sequence[memoryview] | None = None,
    ) -> Iterator[memoryview]:
        """Into the caller's buffers: `preadv`s, one per run of ranges that lie (nearly) back to
        back. Otherwise each range is read into a buffer of this thread's, reused for the next
        range: a view is valid until the next one is asked for or the read ends. Ranges not
        yet in the page cache are asked of the disk ahead of their use (`read_hints`)."""
        if into is not None:
            return self._read_into(key, ranges, into)
        return self._read_staged(key, ranges)

    def _read_staged(self, key: str, ranges: Sequence[tuple[int, int]]) -> Iterator[memoryview]:
        if not ranges:
            return
        staging = _take_staging(max(nbytes for _, nbytes in ranges))
        fd = self._open_fd(key)
        try:
            cold = self._cold(key, fd, ranges)
            for k, (offset, nbytes) in enumerate(ranges):
                if cold is not None:
                    cold.arrive(k)
                yield staging[: _preadv_full(fd, [staging[:nbytes]], offset)]  # short past the end
        finally:
            self._release_fd(key, fd)
            _give_back_staging(staging)

    def _cold(
        self, key: str, fd: int, ranges: Sequence[tuple[int, int]]
    ) -> read_ahead.ColdRanges | None:
        """The pacing of a read whose bytes are not in the page cache (judged on the ends of
        their span), after asking for its first range; None when there is nothing to do."""
        if self.read_hints is ReadHints.NONE:
            return None
        lo = min(offset for offset, _ in ranges)
        hi = max(offset + nbytes for offset, nbytes in ranges)
        try:
            if hi > os.fstat(fd).st_size or read_ahead.ends_cached(fd, lo, hi - lo):
                return None  # past the end: the read reports it
            if self.read_hints is ReadHints.ALL_AT_ONCE:
                read_ahead.advise(fd, ranges, unless_resident=False)
                return None
        except OSError:  # a hint fails nothing: the read that follows reports what is wrong
            return None
        return read_ahead.ColdRanges(fd, ranges, functools.partial(self._advise, key))

    def _advise(self, key: str, ranges: Sequence[tuple[int, int]]) -> None:
        fd = self._open_fd(key)
        try:
            read_ahead.advise(fd, ranges, unless_resident=False)
        finally:
            self._release_fd(key, fd)

    def _read_into(
        self, key: str, ranges: Sequence[tuple[int, int]], into: Sequence[memoryview]
    ) -> Iterator[memoryview]:
        """Runs of ranges separated by at most `_GAP_BYTES` (a chunk's crc between rows read
        straight into the caller's buffers) go as one `preadv`, the gaps into a junk buffer;
        runs stay a few MiB, so what the caller does with each range next finds it in cache.
        A read of several runs has them all coming from disk at once first."""
        if sum(nbytes for _, nbytes in ranges) > _RUN_BYTES:
            with contextlib.suppress(OSError):  # a hint fails nothing
                self.will_read(key, read_ahead.merged(ranges))
        fd = self._open_fd(key)
        try:
            k = 0
            while k < len(ranges):
                start, want = ranges[k]
                iov, end, first = [into[k][:want]], start + want, k
                k += 1
                while k < len(ranges) and len(iov) < _MAX_IOV - 1 and end - start < _RUN_BYTES:
                    offset, nbytes = ranges[k]
                    if not 0 <= offset - end <= _GAP_BYTES:
                        break
                    if offset > end:
                        iov.append(_JUNK[: offset - end])
                    iov.append(into[k][:nbytes])
                    end, k = offset + nbytes, k + 1
                if _preadv_full(fd, iov, start) == end - start:
                    for i in range(first, k):
                        yield into[i][: ranges[i][1]]
                    continue
                for i in range(first, k):  # past the end of the file: how much each range got
                    offset, nbytes = ranges[i]
                    yield into[i][: _preadv_full(fd, [into[i][:nbytes]], offset)]
        finally:
            self._release_fd(key, fd)

    def read_many_into(self, reads: Sequence[tuple[str, int, int, int]], into: memoryview) -> int:
        """All the ranges in one call that holds no interpreter lock (`pread_spans`): on small
        samples, a `preadv` per range from Python costs as much again as the copy, in taking
        the lock back after each one from whichever thread holds it meanwhile."""
        held: dict[str, int] = {}
        spans = array.array("q")
        try:
            for key, offset, nbytes, at in reads:
                fd = held.get(key)
                if fd is None:
                    try:
                        fd = held[key] = self._open_fd(key)
                    except OSError:  # the caller's read of this range reports it
                        break
                spans.extend((fd, offset, nbytes, at))
            return pread_spans(spans, into)
        finally:
            for key, fd in held.items():
                self._release_fd(key, fd)

    def will_read(self, key: str, ranges: Sequence[tuple[int, int]]) -> None:
        """Start reading the ranges not yet in the page cache from disk now, all at once."""
        if not ranges or self.read_hints is ReadHints.NONE:
            return
        fd = self._open_fd(key)
        try:
            read_ahead.advise(fd, read_ahead.merged(ranges), unless_resident=True)
        finally:
            self._release_fd(key, fd)

    def size(self, key: str) -> int:
        st = os.stat(self._abs(key))
        if not stat.S_ISREG(st.st_mode):
            what = _FILE_KINDS.get(stat.S_IFMT(st.st_mode), "not a regular file")
            raise FormatError(f"is {what} where a dataset file belongs", path=self._abs(key))
        return st.st_size

    def exists(self, key: str) -> bool:
        return os.path.exists(self._abs(key))

    def check_root(self) -> None:
        if not os.path.isdir(self.root):
            if not os.path.exists(self.root):
                raise no_such_path(self.root)
            raise NotADatasetError("not a directory", path=self.root)

    def stat(self, key: str) -> ObjectInfo:
        st = os.stat(self._abs(key))
        return ObjectInfo(key, st.st_size, st.st_mtime)

    def put(self, key: str, data: bytes) -> None:
        _publish_via_temp(self._abs(key), data, os.replace, durable=False)

    def write_file(self, key: str, pieces: Iterable[bytes | memoryview]) -> int:
        path = self._abs(key)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        pieces = list(pieces)
        size = sum(len(piece) for piece in pieces)
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0)
        with _naming(path):
            fd = os.open(path, flags, 0o666)
            try:
                direct_write.write_pieces(fd, pieces, size, direct=self.direct_writes)
            finally:
                os.close(fd)
        return size

    def sync(self, keys: Iterable[str]) -> None:
        dirs: set[str] = set()
        for key in keys:
            path = self._abs(key)
            fd = os.open(path, os.O_RDONLY)
            try:
                with _naming(path):
                    os.fsync(fd)
            finally:
                os.close(fd)
            dirs.add(os.path.dirname(path))
        for d in sorted(dirs, key=len, reverse=True):
            _fsync_dir(d)

    def put_if_absent(self, key: str, data: bytes) -> bool:
        path = self._abs(key)
        try:
            _publish_via_temp(path, data, os.link, durable=True)
        except FileExistsError:
            return holds(self, key, data)
        _fsync_dir(os.path.dirname(path))
        return True

    def list(self, prefix: str) -> list[str]:
        try:
            return sorted(os.listdir(self._abs(prefix)))
        except FileNotFoundError:
            return []

    def walk(self, prefix: str) -> Iterator[ObjectInfo]:
        base = self._abs(prefix)
        for folder, _, files in os.walk(base):
            for name in files:
                path = os.path.join(folder, name)
                try:
                    st = os.stat(path)
                except FileNotFoundError:
                    continue
                key = os.path.relpath(path, self.root).replace(os.sep, "/")
                yield ObjectInfo(key, st.st_size, st.st_mtime)

    def delete_tree(self, prefix: str) -> None:
        self.close()
        shutil.rmtree(self._abs(prefix), ignore_errors=True)

    def delete(self, key: str) -> None:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self._abs(key))

    def close(self) -> None:
        """Close idle descriptors; ones in use are closed by their last reader."""
        with self._fd_lock:
            if self._pid == os.getpid():
                for fd, users in self._fds.values():
                    if users:
                        self._evicted[fd] = self._evicted.get(fd, 0) + users
                    else:
                        os.close(fd)
            self._fds = OrderedDict()

    def __getstate__(self) -> dict:
        # Pickled into worker processes: descriptors and locks do not travel.
        return {"root": self.root, "max_open": self._max_open, "direct": self.direct_writes}

    def __setstate__(self, state: dict) -> None:
        self.__init__(  # type: ignore[misc]
            state["root"], max_open_files=state["max_open"], direct_writes=state["direct"]
        )


# How often a local write starts again when its temp file was removed under it.
_TEMP_ATTEMPTS = 5


def _open_regular(path: str) -> int:
    """A read-only descriptor of the regular file at ``path``. Opened without blocking and
    checked, so a FIFO or device where a dataset file belongs is refused instead of hanging the
    reader, and a directory gets one clear message instead of a raw IsADirectoryError."""
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0))
    except IsADirectoryError:
        raise FormatError("is a directory where a dataset file belongs", path=path) from None
    kind = stat.S_IFMT(os.fstat(fd).st_mode)
    if kind != stat.S_IFREG:
        os.close(fd)
        what = _FILE_KINDS.get(kind, "not a regular file")
        raise FormatError(f"is {what} where a dataset file belongs", path=path)
    if hasattr(os, "O_NONBLOCK"):
        os.set_blocking(fd, True)
    return fd


_FILE_KINDS = {
    stat.S_IFDIR: "a directory",
    stat.S_IFIFO: "a FIFO (named pipe)",
    stat.S_IFCHR: "a character device",
    stat.S_IFBLK: "a block device",
    stat.S_IFSOCK: "a socket",
}


@contextlib.contextmanager
def _naming(path: str) -> Iterator[None]:
    """Make an OSError raised while writing ``path`` name it.

    A full disk raises ENOSPC from write() or fsync() with no file name, which would leave the
    user with a bare "No space left on device".
    """
    try:
        yield
    except OSError as exc:
        if exc.filename is None:
            exc.filename = path
        raise


def _fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _take_staging(nbytes: int) -> memoryview:
    """This thread's staging buffer if it holds ``nbytes``, else a new one (a thread may hold a
    read open while it starts another: that read then has its own)."""
    kept = getattr(_STAGING, "buf", None)
    if kept is not None and len(kept) >= nbytes:
        _STAGING.buf = None
        return kept
    return memoryview(bytearray(max(_STAGING_MIN_BYTES, 1 << (nbytes - 1).bit_length())))


def _give_back_staging(buf: memoryview) -> None:
    """Kept by the thread that ends the read (an abandoned read may end in another thread,
    when it is collected), if larger than the one it keeps."""
    kept = getattr(_STAGING, "buf", None)
    if kept is None or len(buf) > len(kept):
        _STAGING.buf = buf


def _publish_via_temp(
    path: str, data: bytes, publish: Callable[[str, str], None], *, durable: bool
) -> None:
    """Write ``data`` to a fresh temporary file beside ``path`` (fsynced if ``durable``), then
    ``publish(tmp, path)``: a rename or a hard link. A gc told to take young temporary files
    (``--grace 0``) may remove the file or its folder before that: nothing was published, so
    it is written again."""
    folder = os.path.dirname(path)
    for attempt in range(_TEMP_ATTEMPTS):
        os.makedirs(folder, exist_ok=True)
        tmp = os.path.join(folder, f"{TEMP_PREFIX}{uuid.uuid4().hex}")
        try:
            with _naming(path), open(tmp, "xb") as f:
                f.write(data)
                if durable:
                    f.flush()
                    os.fsync(f.fileno())
            publish(tmp, path)
            return
        except FileNotFoundError:
            if attempt == _TEMP_ATTEMPTS - 1:
                raise
        finally:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp)


def _preadv_full(fd: int, buffers: list[memoryview], offset: int) -> int:
    """`preadv` until the buffers are full or the file ends (a read may return short after a
    signal or under memory pressure); returns the bytes read."""
    want = sum(map(len, buffers))
    done = os.preadv(fd, buffers, offset)
    while 0 < done < want:
        rest, skip = [], done
        for b in buffers:
            if skip >= len(b):
                skip -= len(b)
            else:
                rest.append(b[skip:])
                skip = 0
        got = os.preadv(fd, rest, offset + done)
        if not got:
            break
        done += got
    return done
