"""One error hierarchy for the whole library.

Every error carries the path (and, where one is involved, the sample id) it is about, so the
CLI can print one precise line and pick an exit code without parsing messages.
"""

from __future__ import annotations


class HsstoreError(Exception):
    """Base class of every error hsstore raises on purpose."""

    def __init__(self, message: str, *, path: str | None = None, sample_id: str | None = None):
        self.message = message
        self.path = path
        self.sample_id = sample_id
        super().__init__(self.__str__())

    def __str__(self) -> str:
        where = []
        if self.path is not None:
            where.append(str(self.path))
        if self.sample_id is not None:
            where.append(f"sample {self.sample_id!r}")
        return f"{': '.join(where)}: {self.message}" if where else self.message


class NotADatasetError(HsstoreError):
    """The path does not hold an hsstore dataset."""


class FormatError(HsstoreError):
    """A file does not follow the hsstore format (bad manifest, bad zarr metadata, ...)."""


class SchemaError(FormatError):
    """A manifest does not validate against its JSON Schema."""


class UnsupportedVersionError(FormatError):
    """A manifest was written by a newer, unknown format version."""


class IntegrityError(HsstoreError):
    """Stored bytes do not match their checksum, or a committed file is missing or truncated."""


class ConflictError(HsstoreError):
    """A commit lost a race it cannot resolve (for example, the same sample id committed twice)."""


class DuplicateSampleError(ConflictError):
    """A sample id that is already in the dataset (or in this writer) was added again."""


class BadInputError(HsstoreError):
    """Input handed to hsstore (a tensor, a foreign file) is malformed."""


class StorageError(HsstoreError):
    """The storage behind a dataset refused or failed a request (credentials, bucket, network)."""
