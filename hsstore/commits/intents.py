"""Intents: commits waiting in ``manifests/intents/`` for a writer to publish them in a group.

An intent is the delta its writer would have published, sealed as a version file is, under a
name carrying when it was left and its commit token; its ``version`` is one past the base its
writer checked its sample ids against. Intents are not data: a version publishes one by
listing its token in ``group``, and until then nothing it names is committed. Reading one
trusts nothing (checksum, schema, the digest's length); an intent that fails is passed over,
and its writer, which holds its own copy, publishes it itself.
"""

from __future__ import annotations

import contextlib
import time

from hsstore.errors import FormatError, HsstoreError, StorageError
from hsstore.spec import paths
from hsstore.spec.manifest import Delta, load_document
from hsstore.storage.store import Storage


def write(storage: Storage, intent: Delta) -> str:
    """Leave ``intent`` for the next group, best effort, and return its key: a put that
    failed may still have landed (a lost reply), so its writer waits as if it had, and leads
    at once when it finds it missing.

    A plain atomic put, not a durable create: its token is its writer's alone, and an intent
    lost to a crash costs nothing, since its writer holds a copy (and a writer that crashed
    too has nothing to publish). The segments it names are durable before it is written."""
    assert intent.commit is not None
    key = paths.intent_key(intent.commit, time.time_ns() // 1_000_000)
    with contextlib.suppress(StorageError, OSError):
        storage.put(key, intent.to_bytes())
    return key


def waiting(storage: Storage) -> dict[str, str]:
    """The intents there now (one listing): their keys by token, earliest left first (by the
    name's time, then token)."""
    try:
        names = storage.list(paths.INTENTS)
    except FileNotFoundError:
        return {}
    found = sorted((parts, name) for name in names if (parts := paths.intent_parts(name)))
    return {token: f"{paths.INTENTS}/{name}" for (_, token), name in found}


def read(storage: Storage, key: str, *, dataset_id: str) -> Delta | None:
    """The intent at ``key`` (a key `waiting` gave), or None when it is gone, unreadable,
    damaged, not this dataset's or not the commit its name says."""
    try:
        doc = load_document(storage.read_bytes(key), where=storage.path_of(key))
    except (FileNotFoundError, HsstoreError, OSError):
        return None
    token = paths.intent_token(key.rsplit("/", 1)[-1])
    if not isinstance(doc, Delta) or doc.commit != token or doc.dataset_id != dataset_id:
        return None
    if doc.condemn or doc.remove_segments or doc.add_repairs or doc.group or doc.prev:
        return None  # an intent only adds
    if doc.sample_digest is None:
        return None
    return doc


def drop(storage: Storage, key: str) -> None:
    """Best effort: an intent left behind is recognised as published (or refused) by the next
    writer that reads it, and gc removes it."""
    with contextlib.suppress(HsstoreError, OSError, FormatError):
        storage.delete(key)
