"""A dataset in an object store (S3 and S3-compatible servers, GCS, Azure) through obstore.

obstore (the Rust ``object_store`` crate) gives ranged and multi-range gets that release the
GIL, so the loader's reading threads keep many requests in flight; multipart upload, which
makes a big shard visible only once it is complete; retries with exponential backoff on 5xx,
dropped connections and timeouts; and conditional create (``put(..., mode="create")``: S3's and
Azure's ``If-None-Match: *``, GCS's ``x-goog-if-generation-match: 0``), which publishes a
manifest version atomically. Endpoint and credentials come only from the standard environment
variables obstore reads (``AWS_*``, ``GOOGLE_*``, ``AZURE_*``: docs/STORAGE.md lists them);
no secret is ever put in a message. What differs between the services is in `SERVICES`.

Errors the server returns become one-line `StorageError`s naming the object; a missing object
stays `FileNotFoundError`, which the format code already handles.
"""

from __future__ import annotations

import contextlib
import os
import re
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import TypeVar

import obstore
from obstore.exceptions import (
    AlreadyExistsError,
    BaseError,
    PermissionDeniedError,
    PreconditionError,
    UnauthenticatedError,
)
from obstore.store import ObjectStore, from_url

from hsstore import settings
from hsstore.errors import StorageError
from hsstore.storage.store import ObjectInfo, Storage, holds
from hsstore.storage.store_cache import LocalCache

T = TypeVar("T")

# Objects this big go up in parts (never visible until the last part is in).
MULTIPART_BYTES = 16 << 20
PART_BYTES = 8 << 20
# How often a create that got no answer at all (a broken connection) is sent again.
CREATE_ATTEMPTS = 4
UNREACHABLE = "cannot reach the storage endpoint"
# A ranged read: ranges at most `GAP_BYTES` apart go as one run, one GET, and runs longer than
# `SPLIT_BYTES` as several concurrent GETs; at most `BATCH_BYTES` of ranges fetched in one call.
# A GET costs the server (and the client) per request as well as per byte: a sample's run of
# chunks, a few MiB, is one request, as a whole-object reader's would be; the loader's threads
# keep many samples' requests in flight.
SPLIT_BYTES = 16 << 20
GAP_BYTES = 4096
BATCH_BYTES = 32 << 20


def _retry_config() -> dict[str, object]:
    config = settings.current()
    return {
        "max_retries": config.storage_retries,
        "backoff": {
            "init_backoff": timedelta(milliseconds=100),
            "max_backoff": timedelta(seconds=5),
            "base": 2,
        },
        "retry_timeout": timedelta(seconds=config.retry_timeout_s),
    }


@dataclass(frozen=True)
class Service:
    """What differs between the object stores a URL scheme names."""

    name: str
    allow_http_var: str  # the variable that allows an http:// endpoint (an emulator's)
    missing_bucket_codes: tuple[str, ...]  # the error codes of a missing bucket/container
    bucket_word: str


SERVICES = {
    "s3": Service("S3", "AWS_ALLOW_HTTP", ("NoSuchBucket",), "bucket"),
    "gs": Service("GCS", "GOOGLE_ALLOW_HTTP", ("NoSuchBucket",), "bucket"),
    "az": Service("Azure Blob", "AZURE_ALLOW_HTTP", ("ContainerNotFound",), "container"),
}
_SCHEMES = {"s3": "s3", "s3a": "s3", "gs": "gs", "az": "az", "azure": "az", "abfs": "az",
            "abfss": "az"}  # fmt: skip


def service_of(url: str) -> Service:
    return SERVICES[_SCHEMES.get(url.split("://", 1)[0].lower(), "s3")]


def _client_options(service: Service) -> dict[str, object]:
    options: dict[str, object] = {"connect_timeout": "5s", "timeout": "60s"}
    # Explicit client options replace the ones obstore would take from the environment.
    if os.environ.get(service.allow_http_var, "").lower() in ("1", "true", "yes"):
        options["allow_http"] = True
    return options


class ObjectStorage(Storage):
    """Keys under one ``scheme://bucket/prefix``."""

    clock_resolution_s = 1.0  # Last-Modified is an HTTP date: whole seconds
    # obstore runs requests on a tokio runtime whose threads do not survive fork(): a forked
    # child's requests hang (obstore and tokio document fork as unsupported).
    worker_start_method = "spawn"

    def __init__(
        self,
        url: str,
        *,
        cache_dir: str | None = None,
        cache_bytes: int | None = None,
        batch_bytes: int = BATCH_BYTES,
    ):
        """``cache_dir``, ``cache_bytes``: a local copy of the segment files read (docs/STORAGE.md,
        "Local cache"). ``batch_bytes``: how many bytes of ranges one `read_ranges` batch
        fetches with all its requests in flight (more: fewer round trips, more memory)."""
        self.root = url.rstrip("/")
        self.batch_bytes = batch_bytes
        self._cache_dir = cache_dir
        self._cache_bytes = cache_bytes
        self.service = service_of(self.root)
        try:
            self._store: ObjectStore = from_url(
                self.root,
                client_options=_client_options(self.service),
                retry_config=_retry_config(),
            )
        except BaseError as exc:
            raise StorageError(f"cannot use this URL: {_first_line(exc)}", path=self.root) from exc
        except ValueError as exc:
            raise StorageError(f"cannot use this URL: {_first_line(exc)}", path=self.root) from exc
        self._cache = (
            LocalCache(cache_dir, self.root, cache_bytes) if cache_dir is not None else None
        )
        self._pid = os.getpid()

    # -- errors ----------------------------------------------------------------------------------
    def _call(self, key: str, fn: Callable[[], T]) -> T:
        missing_bucket = f"the {self.service.bucket_word} does not exist"
        try:
            return fn()
        except FileNotFoundError as exc:
            if _server_code(exc) in self.service.missing_bucket_codes:
                raise StorageError(missing_bucket, path=self.root) from None
            raise FileNotFoundError(2, "no such object", self.path_of(key)) from None
        except BaseError as exc:
            code, status = _server_code(exc), _status(exc)
            if code in self.service.missing_bucket_codes:
                raise StorageError(missing_bucket, path=self.root) from None
            if isinstance(exc, (PermissionDeniedError, UnauthenticatedError)) or status in (
                401,
                403,
            ):
                raise StorageError(
                    f"access denied ({code or status}; check the credentials in the environment)",
                    path=self.path_of(key),
                ) from None
            if status is None:
                raise StorageError(
                    f"{UNREACHABLE} ({_reason(exc)})", path=self.path_of(key)
                ) from None
            raise StorageError(
                f"storage request failed (HTTP {status}{', ' + code if code else ''})",
                path=self.path_of(key),
            ) from None

    # -- reading ---------------------------------------------------------------------------------
    def read_bytes(self, key: str) -> bytes:
        return self._call(key, lambda: bytes(obstore.get(self._store, key).bytes()))

    def read_ranges(
        self,
        key: str,
        ranges: Sequence[tuple[int, int]],
        into: Sequence[memoryview] | None = None,
    ) -> Iterator[memoryview]:
        """From the local copy where there is a cache (the file fetched whole first, in one
        streamed GET). Otherwise in batches of up to `batch_bytes` of ranges (at least one
        range each), one storage call per batch: ranges lying within `GAP_BYTES` of each other
        go as one run, runs longer than `SPLIT_BYTES` as several GETs, all of them sent
        concurrently (every request pays a round trip). The next batch is fetched once the
        caller has taken this one's ranges."""
        if self._cache is not None and self._cache.covers(key):
            return self._cache.local(key, self._fetch_whole).read_ranges(key, ranges, into)
        return self._fetch_ranges(key, ranges, into)

    def read_many_into(self, reads: Sequence[tuple[str, int, int, int]], into: memoryview) -> int:
        """From the local copies where there is a cache, all in one call of the local disk's
        (each file fetched whole first); otherwise the default, a `read_ranges` per run of one
        object's ranges."""
        keys = dict.fromkeys(key for key, _, _, _ in reads)
        if self._cache is None or not all(map(self._cache.covers, keys)):
            return super().read_many_into(reads, into)
        local = None
        try:
            for key in keys:
                local = self._cache.local(key, self._fetch_whole)
        except Exception:  # the default reads up to the range whose file failed
            return super().read_many_into(reads, into)
        return 0 if local is None else local.read_many_into(reads, into)

    def _fetch_ranges(
        self, key: str, ranges: Sequence[tuple[int, int]], into: Sequence[memoryview] | None
    ) -> Iterator[memoryview]:
        k = 0
        while k < len(ranges):
            first, total = k, ranges[k][1]
            k += 1
            while k < len(ranges) and total + ranges[k][1] <= self.batch_bytes:
                total += ranges[k][1]
                k += 1
            batch_into = None if into is None else into[first:k]
            yield from self._fetch_batch(key, ranges[first:k], batch_into)

    def _fetch_batch(
        self,
        key: str,
        batch: Sequence[tuple[int, int]],
        into: Sequence[memoryview] | None,
    ) -> list[memoryview]:
        """The bytes of each range of one batch, fetched together: one GET per piece, a piece
        being whole ranges that lie within `GAP_BYTES` of each other, up to `SPLIT_BYTES`
        (a longer range is a run of pieces of its own). A range inside one piece is a view of
        the piece's bytes, or one copy into its buffer in ``into``: the bytes are never copied
        twice. A range cut short by the end of the object comes back short."""
        pieces: list[list[int]] = []  # [start, end] of each GET
        first_piece: list[int] = []  # the piece each range starts in
        for offset, nbytes in batch:
            if not nbytes:
                first_piece.append(-1)
                continue
            last = pieces[-1] if pieces else None
            near = last is not None and 0 <= offset - last[1] <= GAP_BYTES
            if near and offset + nbytes - last[0] <= SPLIT_BYTES:
                last[1] = max(last[1], offset + nbytes)
                first_piece.append(len(pieces) - 1)
                continue
            first_piece.append(len(pieces))
            for start in range(offset, offset + nbytes, SPLIT_BYTES):
                pieces.append([start, min(start + SPLIT_BYTES, offset + nbytes)])
        got = self._call(
            key,
            lambda: obstore.get_ranges(
                self._store,
                key,
                starts=[start for start, _ in pieces],
                ends=[end for _, end in pieces],
                coalesce=0,
            ),
        )
        data = [memoryview(d) for d in got]
        out = []
        for k, (offset, nbytes) in enumerate(batch):
            p = first_piece[k]
            if p < 0:
                out.append(memoryview(b"") if into is None else into[k][:0])
                continue
            at = offset - pieces[p][0]
            if offset + nbytes <= pieces[p][1]:  # within one piece
                view = data[p][at : at + nbytes]
                if into is not None:
                    into[k][: len(view)] = view
                    view = into[k][: len(view)]
                out.append(view)
                continue
            # A range longer than a piece: its pieces, back to back, as far as they came.
            dest = into[k] if into is not None else memoryview(bytearray(nbytes))
            filled = 0
            while filled < nbytes and p < len(pieces):
                part = data[p][at : at + nbytes - filled]
                dest[filled : filled + len(part)] = part
                filled += len(part)
                if len(data[p]) < pieces[p][1] - pieces[p][0]:
                    break  # short: the object ends here
                p, at = p + 1, 0
            out.append(dest[:filled])
        return out

    def _fetch_whole(self, key: str) -> Iterator[memoryview]:
        result = self._call(key, lambda: obstore.get(self._store, key))
        for chunk in result:
            yield memoryview(chunk)

    def size(self, key: str) -> int:
        return self.stat(key).size

    def stat(self, key: str) -> ObjectInfo:
        meta = self._call(key, lambda: obstore.head(self._store, key))
        return ObjectInfo(key, int(meta["size"]), meta["last_modified"].timestamp())

    def exists(self, key: str) -> bool:
        try:
            self.stat(key)
        except FileNotFoundError:
            return False
        return True

    def list(self, prefix: str) -> list[str]:
        folder = prefix.rstrip("/") + "/" if prefix else None
        listing = self._call(
            prefix, lambda: obstore.list_with_delimiter(self._store, prefix=folder)
        )
        names = {p.rstrip("/").rsplit("/", 1)[-1] for p in listing["common_prefixes"]}
        names |= {o["path"].rsplit("/", 1)[-1] for o in listing["objects"]}
        return sorted(names)

    def walk(self, prefix: str) -> Iterator[ObjectInfo]:
        folder = prefix.rstrip("/") + "/" if prefix else None
        stream = self._call(prefix, lambda: obstore.list(self._store, prefix=folder).collect())
        for meta in stream:
            yield ObjectInfo(meta["path"], int(meta["size"]), meta["last_modified"].timestamp())

    # -- writing ---------------------------------------------------------------------------------
    def write_file(self, key: str, pieces: Iterable[bytes | memoryview]) -> int:
        parts = [bytes(p) if isinstance(p, memoryview) else p for p in pieces]
        size = sum(len(p) for p in parts)
        if size >= MULTIPART_BYTES:
            # Multipart: the object appears only when the upload completes.
            self._call(
                key,
                lambda: obstore.put(
                    self._store, key, iter(parts), use_multipart=True, chunk_size=PART_BYTES
                ),
            )
        else:
            body = parts[0] if len(parts) == 1 else b"".join(parts)
            # Segment files have writer-unique names: create mode turns a (never expected)
            # name clash into an error instead of an overwrite. A clash with our own bytes is
            # a resent request whose first reply was lost: the file is in place.
            if not self.put_if_absent(key, body):
                raise StorageError("another object already has this name", path=self.path_of(key))
        return size

    def sync(self, keys: Iterable[str]) -> None:
        """A completed put is durable on an object store."""

    def put_if_absent(self, key: str, data: bytes) -> bool:
        def create() -> bool:
            try:
                obstore.put(self._store, key, data, mode="create")
            except (AlreadyExistsError, PreconditionError):
                return False  # 412: the name exists (another writer's, or our own resent)
            return True

        # A create is idempotent here (our own bytes count as created), so one whose
        # connection broke after it was sent, which obstore does not resend, is sent again.
        for attempt in range(CREATE_ATTEMPTS):
            try:
                return self._call(key, create) or holds(self, key, data)
            except StorageError as exc:
                if attempt == CREATE_ATTEMPTS - 1 or not exc.message.startswith(UNREACHABLE):
                    raise
                time.sleep(0.1 * 2**attempt)
        raise AssertionError("unreachable")

    def put(self, key: str, data: bytes) -> None:
        self._call(key, lambda: obstore.put(self._store, key, data, mode="overwrite"))

    def delete(self, key: str) -> None:
        with contextlib.suppress(FileNotFoundError):
            self._call(key, lambda: obstore.delete(self._store, key))

    def delete_tree(self, prefix: str) -> None:
        keys = [info.key for info in self.walk(prefix)]
        for start in range(0, len(keys), 1000):
            batch = keys[start : start + 1000]
            try:
                self._call(prefix, lambda b=batch: obstore.delete(self._store, b))
            except FileNotFoundError:
                # Azure's and GCS's bulk deletes fail on a key already gone (another gc, a
                # writer cleaning up); S3's skip it. Then one key at a time, missing ones skipped.
                for key in batch:
                    self.delete(key)

    def check_root(self) -> None:
        """Nothing to check before the first request (a missing dataset shows as no manifest)."""

    def close(self) -> None:
        if self._cache is not None:
            self._cache.close()

    # -- pickling (worker processes build their own client) ----------------------------------------
    def __getstate__(self) -> dict[str, object]:
        return {"root": self.root, "cache_dir": self._cache_dir, "cache_bytes": self._cache_bytes}

    def __setstate__(self, state: dict[str, object]) -> None:
        self.__init__(  # type: ignore[misc]
            state["root"], cache_dir=state["cache_dir"], cache_bytes=state["cache_bytes"]
        )


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return text[0][:300] if text else type(exc).__name__


def _status(exc: BaseException) -> int | None:
    match = re.search(r"status code: (\d{3})", str(exc))
    return int(match.group(1)) if match else None


def _reason(exc: BaseException) -> str:
    """The transport error at the end of obstore's first line (connection refused, timeout)."""
    first = _first_line(exc)
    return first.rsplit(" - ", 1)[-1].strip() or type(exc).__name__


def _server_code(exc: BaseException) -> str | None:
    """The service's error code (SignatureDoesNotMatch, AuthenticationFailed, NoSuchBucket,
    ContainerNotFound, ...) without the body: S3, GCS's XML API and Azure all send
    ``<Code>``."""
    text = str(exc)
    start = text.find("<Code>")
    if start < 0:
        return None
    end = text.find("</Code>", start)
    return text[start + 6 : end] if end > start else None
