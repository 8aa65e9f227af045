"""Dataset locations: the one place a path or URL becomes a `Storage`.

Kept apart from `hsstore.format.store` (the interface and the local backend) so the backends
can import the interface without a cycle.
"""

from __future__ import annotations

import os

from hsstore.errors import BadInputError
from hsstore.format.object_store import ObjectStorage
from hsstore.format.store import LocalStorage, Storage
from hsstore.format.urls import OBJECT_SCHEMES, check_url, local_path_of_file_url, redacted


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
        return ObjectStorage(text, cache_dir=cache_dir or os.environ.get("HSSTORE_CACHE_DIR"))
    raise BadInputError(
        f"unsupported storage URL scheme {scheme!r} (use s3://, gs://, az://, file:// or a path)",
        path=redacted(text),
    )
