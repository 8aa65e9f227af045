"""The storage layer: every byte hsstore reads or writes goes through a `Storage`.

Keys are '/'-separated paths relative to the dataset root. The operations are the ones an
object store also offers (whole-object put, ranged get, list, delete, put-if-absent), so the
format code never knows where a dataset lives; ranged reads are one verb (`read_ranges`), so
how bytes are fetched (mapped, hinted, coalesced, cached) is each backend's own decision.
`hsstore.storage.local_store.LocalStorage` maps the operations to POSIX files;
`hsstore.storage.object_store.ObjectStorage` to S3, GCS and Azure through obstore.
`open_storage` turns a location (URL or path) into one of them.
"""

from __future__ import annotations

import abc
import itertools
import operator
import uuid
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass

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
    # How worker processes that use this storage are started: None for the platform's default
    # (fork where there is one), "spawn" where a forked child could not use the storage.
    worker_start_method: str | None = None

    @abc.abstractmethod
    def read_bytes(self, key: str) -> bytes: ...

    @abc.abstractmethod
    def read_ranges(
        self,
        key: str,
        ranges: Sequence[tuple[int, int]],
        into: Sequence[memoryview] | None = None,
    ) -> Iterator[memoryview]:
        """The bytes of each (offset, nbytes) range of the object, in the order asked, each as
        soon as it is there: the one verb every ranged read goes through (zarr-python's
        ``Store.get_ranges``). How the bytes get here is the backend's business: a local disk
        reads them into a reused buffer, having the kernel read cold ranges ahead of their
        use, an object store coalesces neighbouring ranges and sends the requests
        concurrently, a cached object store serves its local copy.

        A range that runs past the end of the object comes back short (the caller reports
        the truncation). Without ``into`` a view is valid until the next one is asked for or
        the iterator ends (a backend may reuse its memory; copy what must outlive that);
        with ``into`` (one buffer per range, of its length) the bytes land in the caller's
        buffers, and the part of each buffer filled is what comes back. Drop or exhaust the
        iterator when done: the backend then releases what the read held."""

    def read_many_into(self, reads: Sequence[tuple[str, int, int, int]], into: memoryview) -> int:
        """Read each ``(key, offset, nbytes, at)`` of ``reads`` whole into
        ``into[at : at + nbytes]``, in order: many small ranges of several objects in one call
        (a loader's batch of small samples). Returns how many were read whole before the first
        that was not, for whatever reason (an error, the end of the object): the caller reads
        that one again by the rule that names its problem (`hsstore.storage.damage`).

        By default each run of ranges of one object is one `read_ranges`; a backend that
        reads many ranges cheaper at once overrides it."""
        done = 0
        for key, run in itertools.groupby(reads, key=operator.itemgetter(0)):
            run = list(run)
            ranges = [(offset, nbytes) for _, offset, nbytes, _ in run]
            buffers = [into[at : at + nbytes] for _, _, nbytes, at in run]
            try:
                got = list(self.read_ranges(key, ranges, buffers))
            except Exception:  # the caller's read of the same range reports it
                return done
            for (_, nbytes), view in zip(ranges, got):
                if len(view) != nbytes:
                    return done
                done += 1
        return done

    def will_read(self, key: str, ranges: Sequence[tuple[int, int]]) -> None:
        """A hint: these (offset, nbytes) ranges of the object are read soon. A backend may
        start fetching them now; it never changes what a read returns, and a failed hint fails
        nothing (the read that follows reports what is wrong)."""
        return None

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


def holds(storage: Storage, key: str, data: bytes) -> bool:
    """Whether ``key`` holds exactly ``data``: a create refused because the name exists was
    then our own (a resent request whose first reply was lost), or another writer's."""
    try:
        return storage.read_bytes(key) == data
    except FileNotFoundError:
        return False
