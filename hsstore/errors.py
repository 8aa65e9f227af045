"""One error hierarchy for the whole library.

Every error hsstore raises about data, files or datasets derives from :class:`HsstoreError` and
carries the path (and, where one is involved, the sample id) it is about, so the CLI can print
one precise line and pick an exit code without parsing messages. Where a builtin says the same
thing, the error is also that builtin (a missing dataset is a ``FileNotFoundError``, a layer id
no convention can express a ``ValueError``), so callers may catch either. Wrong arguments to a
function (a negative batch size, an unknown option) stay plain ``ValueError``/``TypeError``.
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


class NotADatasetError(HsstoreError, FileNotFoundError):
    """The path does not exist, or holds no hsstore dataset (no committed manifest)."""


def no_such_path(path: object) -> NotADatasetError:
    """The error for a path that does not exist, in the one wording every command uses (a
    dataset, a prompt set, a model folder, a foreign directory alike)."""
    return NotADatasetError("no such file or directory", path=str(path))


class FormatError(HsstoreError):
    """A file does not follow the hsstore format (bad manifest, bad zarr metadata, ...)."""


class SchemaError(FormatError):
    """A manifest does not validate against its JSON Schema."""


class UnsupportedVersionError(FormatError):
    """A manifest was written by a newer, unknown format version."""


class IntegrityError(HsstoreError):
    """Stored bytes do not match their checksum, or a committed file is missing or truncated."""


class ConflictError(HsstoreError):
    """What is asked conflicts with what is already there: a dataset exists where one is to be
    made, or a commit lost a race it cannot resolve (the same sample id committed twice)."""


class IncompatibleDatasetError(ConflictError):
    """An existing dataset stores other states (layers, hidden size, dtype, model depth) than
    the samples that were to go into it."""


class DuplicateSampleError(ConflictError):
    """A sample id that is already in the dataset (or in this writer) was added again."""


class SegmentRemovedError(ConflictError):
    """Segments of a commit were removed before it could publish them (gc judged their writer
    dead: a pause or heartbeat stall longer than the lease ttl). ``sample_ids`` names exactly
    the samples concerned; ``published`` is the version the commit landed as, or None when
    nothing was published."""

    def __init__(
        self,
        message: str,
        *,
        path: str | None = None,
        sample_ids: tuple[str, ...] = (),
        published: int | None = None,
    ):
        self.sample_ids = tuple(sample_ids)
        self.published = published
        super().__init__(message, path=path, sample_id=sample_ids[0] if sample_ids else None)


class CommitUnknownError(HsstoreError):
    """The storage never answered whether a commit's version was created, within the time
    allowed to find out. Nothing was deleted and the writer keeps the commit: calling
    ``commit()`` again learns the outcome (and publishes it if it had not landed)."""


class BadInputError(HsstoreError):
    """Input handed to hsstore (a tensor, a foreign file) is malformed."""


class ConventionError(BadInputError, ValueError):
    """A list of layer ids cannot be expressed in (or translated from) a layer convention."""


class LoaderStateError(HsstoreError):
    """A saved loader state does not fit this loader: it was saved for another dataset version,
    world size or plan settings, or by a newer hsstore."""


class StorageError(HsstoreError):
    """The storage behind a dataset refused or failed a request (credentials, bucket, network)."""


class MissingExtraError(HsstoreError, ImportError):
    """A feature needs packages of an optional extra that are not installed; the message names
    the ``pip install`` line that brings them."""
