"""Dataset locations: the one place a path or URL becomes a `Storage`.

Kept apart from `hsstore.format.store` (the interface and the local backend) so the backends
can import the interface without a cycle.
"""

from __future__ import annotations

import os

from hsstore.errors import BadInputError
from hsstore.format.object_store import ObjectStorage
from hsstore.format.store import LocalStorage, Storage

OBJECT_SCHEMES = ("s3", "s3a", "gs", "az", "azure", "abfs", "abfss")


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
    scheme = text.split("://", 1)[0].lower()
    if scheme == "file":
        return LocalStorage(text[len("file://") :])
    if scheme in OBJECT_SCHEMES:
        return ObjectStorage(text, cache_dir=cache_dir or os.environ.get("HSSTORE_CACHE_DIR"))
    raise BadInputError(
        f"unsupported storage URL scheme {scheme!r} (use s3://, gs://, az://, file:// or a path)",
        path=text,
    )
