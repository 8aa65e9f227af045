"""Dataset locations: the one place a path or URL becomes a `Storage`.

Kept apart from `hsstore.storage.store` (the interface and the local backend) so the backends
can import the interface without a cycle.
"""

from __future__ import annotations

import os
from pathlib import Path

from hsstore import settings
from hsstore.errors import BadInputError
from hsstore.spec import paths
from hsstore.storage.local_store import LocalStorage
from hsstore.storage.object_store import ObjectStorage
from hsstore.storage.store import Storage
from hsstore.storage.urls import OBJECT_SCHEMES, check_url, local_path_of_file_url, redacted


def is_url(location: str | os.PathLike[str]) -> bool:
    return isinstance(location, str) and "://" in location


def open_storage(
    location: str | os.PathLike[str] | Storage, *, cache_dir: str | None = None
) -> Storage:
    """The storage a dataset location names: ``s3://bucket/prefix``, ``gs://``, ``az://``,
    ``file://path`` or a plain path.

    Object stores take endpoint and credentials only from the standard environment variables
    (``AWS_ENDPOINT_URL``, ``AWS_ACCESS_KEY_ID``, ... and the ``GOOGLE_*``/``AZURE_*`` ones).
    cache_dir (default: ``$HSSTORE_CACHE_DIR``) keeps a bounded local copy of the immutable
    segment files read from an object store, so later epochs read local disk.
    """
    if isinstance(location, Storage):
        return location
    if not is_url(location):
        return LocalStorage(location)
    text = str(location)
    scheme = check_url(text)  # before anything could echo or send it
    if scheme == "file":
        return LocalStorage(local_path_of_file_url(text))
    if scheme in OBJECT_SCHEMES:
        return ObjectStorage(text, cache_dir=cache_dir or settings.current().cache_dir)
    raise BadInputError(
        f"unsupported storage URL scheme {scheme!r} (use s3://, gs://, az://, file:// or a path)",
        path=redacted(text),
    )


def nesting_problem(storage: Storage) -> str | None:
    """Why a new dataset must not be created at ``storage``'s location: it lies inside another
    dataset (gc of that one would delete it), or holds one below it (the reverse). Reads one
    listing per enclosing folder and walks the location once (a new location is empty)."""
    for outer in _enclosing(storage):
        if _holds_versions(outer):
            return f"the location is inside the dataset at {outer.root}; choose a path outside it"
    for info in storage.walk(""):
        parts = info.key.split("/")
        if len(parts) > 2 and parts[-2] == paths.MANIFESTS and paths.manifest_version(parts[-1]):
            inner = storage.path_of("/".join(parts[:-2]))
            return f"the location holds the dataset at {inner}; choose a path that holds none"
    return None


def datasets_below(location: str | os.PathLike[str]) -> list[str]:
    """The folders right below a local directory that hold a dataset's versions: where the
    dataset is when the folder around it is named instead (`hsstore demo OUT` makes
    OUT/dataset)."""
    if is_url(location) or not os.path.isdir(location):
        return []
    found = [p for p in Path(location).iterdir() if p.is_dir() and not p.is_symlink()]
    return sorted(str(p) for p in found if _holds_versions(LocalStorage(p)))


def _holds_versions(storage: Storage) -> bool:
    return any(paths.manifest_version(n) is not None for n in storage.list(paths.MANIFESTS))


def _enclosing(storage: Storage) -> list[Storage]:
    """The storages of every folder that encloses this location, nearest first."""
    if isinstance(storage, LocalStorage):
        return [LocalStorage(p) for p in Path(storage.root).resolve().parents]
    if isinstance(storage, ObjectStorage):
        scheme, _, rest = storage.root.partition("://")
        bucket, *parts = rest.split("/")
        return [
            ObjectStorage("/".join([f"{scheme}://{bucket}", *parts[:k]]))
            for k in range(len(parts) - 1, -1, -1)
        ]
    return []
