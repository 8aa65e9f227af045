"""A bounded local copy of the immutable files of a remote dataset (like MosaicML streaming's
local cache): the first read of a segment file downloads it whole, later reads (the next epoch)
are local preadv reads. Only segment files are cached: once written they never change, so a
cached copy can never be stale. Manifests are always read from the store.

Files are least-recently-used evicted when the folder grows past its byte budget; a file is
put in place by rename, so a killed process leaves at most a temporary file, which the next
start removes. Each cached file has a sidecar holding the XXH3-64 of its bytes, taken while it
was downloaded; a process checks a file it did not download itself against that digest before
its first read, and fetches it again when it differs (a damaged or half-replaced copy from an
earlier run is never served). Damage after that check is caught by the reader's chunk crc32c
and sample checksum like damage to a remote object, as an error, never as wrong bytes.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import threading
import uuid
from collections import OrderedDict
from collections.abc import Callable, Iterator

import xxhash

from hsstore import settings
from hsstore.spec import paths
from hsstore.storage.local_store import LocalStorage
from hsstore.storage.store import TEMP_PREFIX

DIGEST_SUFFIX = ".xxh3"


class LocalCache:
    """Cached copies of one remote root's segment files under ``cache_dir``."""

    def __init__(self, cache_dir: str, remote_root: str, max_bytes: int | None = None):
        digest = hashlib.sha256(remote_root.encode()).hexdigest()[:16]
        self.folder = os.path.join(os.path.expanduser(cache_dir), digest)
        os.makedirs(self.folder, exist_ok=True)
        self.max_bytes = max_bytes or settings.current().cache_bytes
        self.storage = LocalStorage(self.folder)
        self._lock = threading.Lock()
        self._key_locks: dict[str, threading.Lock] = {}
        self._sizes: OrderedDict[str, int] = OrderedDict()
        # Files this process has downloaded or checked against their digest.
        self._checked: set[str] = set()
        for info in self.storage.walk(paths.SEGMENTS):
            name = info.key.rsplit("/", 1)[-1]
            if name.startswith(TEMP_PREFIX):
                self.storage.delete(info.key)
            elif not name.endswith(DIGEST_SUFFIX):
                self._sizes[info.key] = info.size

    @staticmethod
    def covers(key: str) -> bool:
        return key.startswith(paths.SEGMENTS + "/")

    def local(self, key: str, fetch: Callable[[str], Iterator[memoryview]]) -> LocalStorage:
        """The local storage holding ``key`` (downloaded first when missing or damaged)."""
        with self._lock:
            if key in self._checked:
                self._sizes.move_to_end(key)
                return self.storage
            key_lock = self._key_locks.setdefault(key, threading.Lock())
        with key_lock:  # one download (or check) per file, other threads wait for it
            with self._lock:
                if key in self._checked:
                    return self.storage
                cached = key in self._sizes
            if not (cached and self._intact(key)):
                size = self._download(key, fetch)
                with self._lock:
                    self._sizes[key] = size
            with self._lock:
                self._sizes.move_to_end(key)
                self._checked.add(key)
                self._key_locks.pop(key, None)
                self._evict(keep=key)
        return self.storage

    def _intact(self, key: str) -> bool:
        """Whether the cached file still hashes to the digest recorded when it was fetched."""
        final = os.path.join(self.folder, key)
        try:
            with open(final + DIGEST_SUFFIX) as f:
                recorded = f.read().strip()
            hasher = xxhash.xxh3_64()
            with open(final, "rb") as f:
                while piece := f.read(1 << 20):
                    hasher.update(piece)
        except OSError:
            return False
        return hasher.hexdigest() == recorded

    def _download(self, key: str, fetch: Callable[[str], Iterator[memoryview]]) -> int:
        final = os.path.join(self.folder, key)
        os.makedirs(os.path.dirname(final), exist_ok=True)
        tmp = os.path.join(os.path.dirname(final), f"{TEMP_PREFIX}{uuid.uuid4().hex}")
        size = 0
        hasher = xxhash.xxh3_64()
        try:
            # The digest goes first: a crash between the two renames leaves a digest that does
            # not match the old file (or no file), so the next start fetches it again.
            with open(tmp, "xb") as f:
                for piece in fetch(key):
                    f.write(piece)
                    hasher.update(piece)
                    size += len(piece)
            self.storage.put(key + DIGEST_SUFFIX, hasher.hexdigest().encode())
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
            self._checked.discard(key)
            # A reader holding the file open keeps reading the unlinked inode safely.
            self.storage.delete(key)
            self.storage.delete(key + DIGEST_SUFFIX)
            total -= size

    def close(self) -> None:
        self.storage.close()
