"""A bounded local copy of the immutable files of a remote dataset (like MosaicML streaming's
local cache): the first read of a segment file downloads it whole, later reads (the next epoch)
are local preadv reads. Only segment files are cached: once written they never change, so a
cached copy can never be stale. Manifests are always read from the store.

Files are least-recently-used evicted when the folder grows past its byte budget; a file is
put in place by rename, so a killed process leaves at most a temporary file, which the next
start removes. Every read through the cache is still checked against the sample checksum and
chunk crc32c by the reader, so a damaged cached file is caught like a damaged remote one.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import threading
import uuid
from collections import OrderedDict
from collections.abc import Callable, Iterator

from hsstore.format import paths
from hsstore.format.store import TEMP_PREFIX, LocalStorage

DEFAULT_CACHE_BYTES = 64 << 30


class LocalCache:
    """Cached copies of one remote root's segment files under ``cache_dir``."""

    def __init__(self, cache_dir: str, remote_root: str, max_bytes: int | None = None):
        digest = hashlib.sha256(remote_root.encode()).hexdigest()[:16]
        self.folder = os.path.join(os.path.expanduser(cache_dir), digest)
        os.makedirs(self.folder, exist_ok=True)
        env_bytes = os.environ.get("HSSTORE_CACHE_BYTES")
        self.max_bytes = max_bytes or (int(env_bytes) if env_bytes else DEFAULT_CACHE_BYTES)
        self.storage = LocalStorage(self.folder)
        self._lock = threading.Lock()
        self._key_locks: dict[str, threading.Lock] = {}
        self._sizes: OrderedDict[str, int] = OrderedDict()
        for info in self.storage.walk(paths.SEGMENTS):
            name = info.key.rsplit("/", 1)[-1]
            if name.startswith(TEMP_PREFIX):
                self.storage.delete(info.key)
            else:
                self._sizes[info.key] = info.size

    @staticmethod
    def covers(key: str) -> bool:
        return key.startswith(paths.SEGMENTS + "/")

    def local(self, key: str, fetch: Callable[[str], Iterator[memoryview]]) -> LocalStorage:
        """The local storage holding ``key`` (downloaded first when missing)."""
        with self._lock:
            if key in self._sizes:
                self._sizes.move_to_end(key)
                return self.storage
            key_lock = self._key_locks.setdefault(key, threading.Lock())
        with key_lock:  # one download per file, other threads wait for it
            with self._lock:
                if key in self._sizes:
                    return self.storage
            size = self._download(key, fetch)
            with self._lock:
                self._sizes[key] = size
                self._key_locks.pop(key, None)
                self._evict(keep=key)
        return self.storage

    def _download(self, key: str, fetch: Callable[[str], Iterator[memoryview]]) -> int:
        final = os.path.join(self.folder, key)
        os.makedirs(os.path.dirname(final), exist_ok=True)
        tmp = os.path.join(os.path.dirname(final), f"{TEMP_PREFIX}{uuid.uuid4().hex}")
        size = 0
        try:
            with open(tmp, "xb") as f:
                for piece in fetch(key):
                    f.write(piece)
                    size += len(piece)
            os.replace(tmp, final)
        except BaseException:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp)
            raise
        return size

    def _evict(self, keep: str) -> None:
        total = sum(self._sizes.values())
        while total > self.max_bytes and len(self._sizes) > 1:
            key, size = next(iter(self._sizes.items()))
            if key == keep:
                self._sizes.move_to_end(key)
                continue
            del self._sizes[key]
            # A reader holding the file open keeps reading the unlinked inode safely.
            self.storage.delete(key)
            total -= size

    def close(self) -> None:
        self.storage.close()
