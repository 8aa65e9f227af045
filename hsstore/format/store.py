"""The storage layer: every byte hsstore reads or writes goes through a `Storage`.

Keys are '/'-separated paths relative to the dataset root. The operations are the ones an
object store also offers (whole-object put, ranged get, list, delete, put-if-absent), so the
format code never knows where a dataset lives. `LocalStorage` maps them to POSIX files;
put-if-absent is a hard link of a fully written, fsynced temporary file, which is atomic and
fails if the name exists. `hsstore.format.object_store.ObjectStorage` maps them to S3, GCS and
Azure through obstore. `open_storage` turns a location (URL or path) into one of them.
"""

from __future__ import annotations

import abc
import contextlib
import mmap
import os
import shutil
import stat
import threading
import uuid
from collections import OrderedDict
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

from hsstore.errors import FormatError, NotADatasetError

# URL schemes obstore serves; anything else with "://" is refused rather than taken for a path.
TEMP_PREFIX = ".tmp-"
# Where `Storage.now` writes its probe objects (at the dataset root, outside the format's files).
CLOCK_PREFIX = ".hsstore-clock"


@dataclass(frozen=True)
class ObjectInfo:
    """One stored object: its key, size and last-modified time (seconds, the storage's clock)."""

    key: str
    size: int
    modified: float


class Storage(abc.ABC):
    """Byte-level access to one dataset root."""

    root: str
    # Granularity of `ObjectInfo.modified` and `now()`: liveness checks add it as slack.
    clock_resolution_s: float = 0.0
    # Whether a process forked after this storage was used can still use storages of its kind
    # (worker processes are spawned instead when not).
    fork_safe: bool = True
    # How many bytes of adjacent compressed chunks a reader fetches with one request. 0: one
    # read per chunk, decoded while it is still in cache (the fastest on local disk); an object
    # store wants long ranges, since every request pays a round trip.
    coalesce_bytes: int = 0
    # Whether `will_read` does anything (callers skip working out the ranges where it does not).
    reads_ahead: bool = False

    @abc.abstractmethod
    def read_bytes(self, key: str) -> bytes: ...

    @abc.abstractmethod
    def read_into(self, key: str, offset: int, out: memoryview) -> int:
        """Read ``len(out)`` bytes at ``offset`` into ``out``; returns the bytes read."""

    def read_scatter(self, key: str, offset: int, buffers: list[memoryview]) -> int:
        """Read consecutive bytes at ``offset`` into several buffers in turn (one request)."""
        total = 0
        for buf in buffers:
            got = self.read_into(key, offset + total, buf)
            total += got
            if got < len(buf):
                break
        return total

    def read_ranges_into(self, key: str, requests: list[tuple[int, memoryview]]) -> list[int]:
        """Fill several buffers, each from its own offset of one object; returns the bytes read
        into each. A backend may send the requests concurrently; locally they are preads in
        turn, as a single `read_into` each."""
        return [self.read_into(key, offset, buf) for offset, buf in requests]

    def map(self, key: str) -> memoryview | None:
        """The whole object as a read-only view of its stored bytes, or None where the backend
        cannot give one without copying. For objects that never change once written (committed
        shard files) only: the caller checks the view's length against what it expects."""
        return None

    def unmap(self, key: str, offset: int, nbytes: int) -> None:
        """Done reading this range of a `map` view for now (nothing where nothing is mapped)."""
        return None

    def will_read(
        self, key: str, ranges: list[tuple[int, int]], *, unless_resident: bool = True
    ) -> None:
        """These (offset, nbytes) ranges of the object are about to be read: a backend that
        `reads_ahead` starts fetching them now, all at once (with ``unless_resident``, only
        those not already in local memory); the others do nothing."""
        return None

    def resident(self, key: str, offset: int, nbytes: int) -> bool:
        """Whether the range's bytes are in local memory already, judged on its first and last
        byte (a backend that `reads_ahead`); False where there is no local copy to ask about."""
        return False

    @abc.abstractmethod
    def size(self, key: str) -> int: ...

    @abc.abstractmethod
    def exists(self, key: str) -> bool: ...

    @abc.abstractmethod
    def write_file(self, key: str, pieces: Iterable[bytes | memoryview]) -> int:
        """Write a new object from pieces; returns its size. Not yet durable (see `sync`)."""

    @abc.abstractmethod
    def sync(self, keys: Iterable[str]) -> None:
        """Make the named objects (and their directories) durable."""

    @abc.abstractmethod
    def put_if_absent(self, key: str, data: bytes) -> bool:
        """Atomically create ``key`` with ``data``. True when created, or when ``key`` already
        holds exactly ``data`` (the request was resent after its reply was lost, and the
        server refused the second copy); False when another object holds the name."""

    @abc.abstractmethod
    def put(self, key: str, data: bytes) -> None:
        """Atomically create or replace a small object (readers see the old or the new bytes)."""

    @abc.abstractmethod
    def stat(self, key: str) -> ObjectInfo:
        """Size and modification time; FileNotFoundError if absent."""

    @abc.abstractmethod
    def walk(self, prefix: str) -> Iterator[ObjectInfo]:
        """Every object under the folder ``prefix``, at any depth."""

    def now(self) -> float:
        """The current time on the storage's clock (compare it with `ObjectInfo.modified`):
        the modification time of a tiny object written for the purpose. On a shared filesystem
        that is the clock of whoever stamps mtimes (the file server, or the writing kernel), the
        same one that stamped every lease and segment file, never this process's `time.time()`,
        which may run minutes apart on another machine."""
        key = f"{CLOCK_PREFIX}/{uuid.uuid4().hex}"
        self.put(key, b"")
        try:
            return self.stat(key).modified
        finally:
            self.delete(key)

    @abc.abstractmethod
    def check_root(self) -> None:
        """Raise NotADatasetError (a FileNotFoundError) when the root cannot hold a dataset."""

    @abc.abstractmethod
    def close(self) -> None:
        """Release cached handles (the storage stays usable)."""

    @abc.abstractmethod
    def list(self, prefix: str) -> list[str]:
        """Names directly under ``prefix`` (files and folders), sorted."""

    @abc.abstractmethod
    def delete_tree(self, prefix: str) -> None: ...

    @abc.abstractmethod
    def delete(self, key: str) -> None: ...

    def path_of(self, key: str) -> str:
        """A human-readable location for error messages."""
        return f"{self.root.rstrip('/')}/{key}"


# One readahead hint at most (`LocalStorage.will_read`): the kernel reads at most the larger of
# the device's readahead window and its largest request per hint (1.25-4 MiB on the devices
# seen here; `force_page_cache_ra`).
_HINT_PIECE_BYTES = 1 << 20


def _cached(fd: int, offset: int) -> bool:
    """Whether the byte at ``offset`` of the file is in the page cache: a 1-byte read that
    fails with EAGAIN rather than wait for the disk (a miss may start the read of that page,
    which the caller's hint covers anyway). True where the probe is not supported, so the
    caller does nothing it would not have done without it."""
    try:
        os.preadv(fd, [bytearray(1)], offset, os.RWF_NOWAIT)
    except BlockingIOError:
        return False
    except OSError:
        return True
    return True


class LocalStorage(Storage):
    """A dataset in a local directory."""

    # Read hints need posix_fadvise and non-blocking reads (Linux).
    reads_ahead = hasattr(os, "posix_fadvise") and hasattr(os, "RWF_NOWAIT")

    def __init__(self, root: str | os.PathLike[str], *, max_open_files: int = 128):
        self.root = str(Path(root).expanduser())
        # key -> [fd, readers using it]. A descriptor evicted while a thread still reads
        # through it is closed by the last user (closing it under a reader could hand its
        # number to another file mid-read).
        self._fds: OrderedDict[str, list[int]] = OrderedDict()
        self._evicted: dict[int, int] = {}
        self._fd_lock = threading.Lock()
        self._max_open = max_open_files
        self._pid = os.getpid()
        # key -> read-only memory map, least recently used first. An evicted map is unmapped
        # when the last view of it is released, so a reader holding one is never cut off.
        self._maps: OrderedDict[str, mmap.mmap] = OrderedDict()

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

    def read_into(self, key: str, offset: int, out: memoryview) -> int:
        total = 0
        fd = self._open_fd(key)
        try:
            while total < len(out):
                n = os.preadv(fd, [out[total:]], offset + total)
                if n == 0:
                    break
                total += n
        finally:
            self._release_fd(key, fd)
        return total

    def map(self, key: str) -> memoryview:
        """A shared read-only memory map of the file, kept open (up to ``max_open_files``).

        Reading through it saves the copy a `read_into` makes from the page cache: crc and
        decode run on the cached pages themselves. The file must not shrink while mapped (a
        read of a page past its end would stop the process); committed files never change.
        """
        with self._fd_lock:
            mapped = self._maps.get(key)
            if mapped is not None:
                self._maps.move_to_end(key)
                return memoryview(mapped)
        fd = self._open_fd(key)
        try:
            size = os.fstat(fd).st_size
            if not size:  # mmap refuses empty files
                return memoryview(b"")
            mapped = mmap.mmap(fd, size, prot=mmap.PROT_READ)
        finally:
            self._release_fd(key, fd)
        with self._fd_lock:
            mapped = self._maps.setdefault(key, mapped)
            while len(self._maps) > self._max_open:
                self._maps.popitem(last=False)
        return memoryview(mapped)

    def will_read(
        self, key: str, ranges: list[tuple[int, int]], *, unless_resident: bool = True
    ) -> None:
        """Start reading the ranges from disk now (`posix_fadvise(WILLNEED)`, which returns once
        the reads are queued), so the reads that follow (faults on the map, or `preadv`s) wait
        only for reads already under way.

        Without it a fault on an uncached page of the map reads the device's whole readahead
        window around it, and waits for it: with an 8 MiB ``read_ahead_kb`` a cold random read
        of a 0.7 MB sample moved up to 8 MiB and ran 3-5x slower than with the hint (a data set
        larger than the page cache is read that way). Pages read this way carry no readahead marks,
        so the faults that follow start no further reads. The kernel caps one hint at the
        device's largest request or readahead window, hence the pieces.

        With ``unless_resident`` a range already in the page cache is left alone: the hint
        would look up every one of its pages again, so its first and last byte are probed first
        with reads that fail instead of waiting for the disk (`resident`)."""
        if not ranges or not self.reads_ahead:
            return
        fd = self._open_fd(key)
        try:
            for offset, nbytes in ranges:
                if unless_resident and _cached(fd, offset) and _cached(fd, offset + nbytes - 1):
                    continue
                for at in range(offset, offset + nbytes, _HINT_PIECE_BYTES):
                    piece = min(_HINT_PIECE_BYTES, offset + nbytes - at)
                    os.posix_fadvise(fd, at, piece, os.POSIX_FADV_WILLNEED)
        finally:
            self._release_fd(key, fd)

    def resident(self, key: str, offset: int, nbytes: int) -> bool:
        if not self.reads_ahead:
            return False
        fd = self._open_fd(key)
        try:
            return _cached(fd, offset) and _cached(fd, offset + nbytes - 1)
        finally:
            self._release_fd(key, fd)

    def unmap(self, key: str, offset: int, nbytes: int) -> None:
        """Drop this process's mapping of the range's pages: they stay in the page cache (the
        next read maps them again for a few minor faults) but stop counting in the process's
        resident memory, which would otherwise grow to the size of every shard read."""
        with self._fd_lock:
            mapped = self._maps.get(key)
        if mapped is None:
            return
        start = offset - offset % mmap.PAGESIZE
        end = min(offset + nbytes, len(mapped))
        if end > start:
            mapped.madvise(mmap.MADV_DONTNEED, start, end - start)

    def read_scatter(self, key: str, offset: int, buffers: list[memoryview]) -> int:
        want = sum(len(b) for b in buffers)
        fd = self._open_fd(key)
        try:
            n = os.preadv(fd, buffers, offset)
        finally:
            self._release_fd(key, fd)
        if n == want or n == 0:
            return n
        # A short read (signal, page-cache pressure): finish buffer by buffer.
        done, rest = 0, []
        for b in buffers:
            if done + len(b) <= n:
                done += len(b)
            else:
                rest.append(b[max(0, n - done) :])
                done += len(b)
        return n + super().read_scatter(key, offset + n, rest)

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
            what = "not a directory" if os.path.exists(self.root) else "no such dataset directory"
            raise NotADatasetError(what, path=self.root)

    def stat(self, key: str) -> ObjectInfo:
        st = os.stat(self._abs(key))
        return ObjectInfo(key, st.st_size, st.st_mtime)

    def put(self, key: str, data: bytes) -> None:
        path = self._abs(key)
        folder = os.path.dirname(path)
        for attempt in range(_TEMP_ATTEMPTS):
            os.makedirs(folder, exist_ok=True)
            tmp = os.path.join(folder, f"{TEMP_PREFIX}{uuid.uuid4().hex}")
            try:
                with open(tmp, "xb") as f:
                    f.write(data)
                os.replace(tmp, path)
                return
            except FileNotFoundError:
                # The temp file (or its folder) was removed meanwhile, by a gc run told to take
                # young temp files (``--grace 0``): write it again.
                if attempt == _TEMP_ATTEMPTS - 1:
                    raise

    def write_file(self, key: str, pieces: Iterable[bytes | memoryview]) -> int:
        path = self._abs(key)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        size = 0
        with _naming(path), open(path, "xb") as f:
            for piece in pieces:
                f.write(piece)
                size += len(piece)
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
        folder = os.path.dirname(path)
        for attempt in range(_TEMP_ATTEMPTS):
            os.makedirs(folder, exist_ok=True)
            tmp = os.path.join(folder, f"{TEMP_PREFIX}{uuid.uuid4().hex}")
            try:
                with _naming(path), open(tmp, "xb") as f:
                    f.write(data)
                    f.flush()
                    os.fsync(f.fileno())
                os.link(tmp, path)
            except FileExistsError:
                return holds(self, key, data)
            except FileNotFoundError:
                # The temp file was removed before its link (a gc told to take young temp
                # files, ``--grace 0``): nothing was created, so write it again.
                if attempt == _TEMP_ATTEMPTS - 1:
                    raise
                continue
            finally:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(tmp)
            _fsync_dir(folder)
            return True
        raise AssertionError("unreachable")

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
            self._maps = OrderedDict()  # unmapped as the last views of each are released

    def __getstate__(self) -> dict:
        # Pickled into worker processes: descriptors and locks do not travel.
        return {"root": self.root, "max_open": self._max_open}

    def __setstate__(self, state: dict) -> None:
        self.__init__(state["root"], max_open_files=state["max_open"])  # type: ignore[misc]


# How often a local write starts again when its temp file was removed under it.
_TEMP_ATTEMPTS = 5


def holds(storage: Storage, key: str, data: bytes) -> bool:
    """Whether ``key`` holds exactly ``data``: a create refused because the name exists was
    then our own (a resent request whose first reply was lost), or another writer's."""
    try:
        return storage.read_bytes(key) == data
    except FileNotFoundError:
        return False


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
