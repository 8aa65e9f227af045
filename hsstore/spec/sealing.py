"""The bytes of a version file: canonical JSON sealed with an XXH3-64 checksum of itself.

See docs/FORMAT.md ("Checksums: what each one covers").
"""

from __future__ import annotations

import json
import re
from typing import Any

import xxhash

from hsstore.spec.schema import validate

# What every version file says it is. Every format from 1 on is read (the schema's minimum);
# format 1 wrote only full manifests without a checksum (see FORMAT.md).
FORMAT_NAME = "hsstore"
FORMAT_VERSION = 5

_CHECKSUM_TAIL = re.compile(rb'^,"checksum":"([0-9a-f]{16})"\}$')
_TAIL_LEN = len(',"checksum":"') + 16 + len('"}')


def seal_document(obj: dict[str, Any]) -> bytes:
    """The bytes of a version file: the canonical JSON of ``obj`` without ``checksum`` (sorted
    keys, no whitespace, ASCII), with ``"checksum"`` = XXH3-64 (hex) of those bytes inserted
    as its last member. Checking it needs no re-serialization."""
    body = {k: v for k, v in obj.items() if k != "checksum"}
    canonical = json.dumps(body, sort_keys=True, separators=(",", ":"), ensure_ascii=True).encode()
    digest = xxhash.xxh3_64_hexdigest(canonical)
    return canonical[:-1] + b',"checksum":"' + digest.encode() + b'"}\n'


def checksum_matches(data: bytes, stored: str) -> bool:
    text = data.rstrip(b"\n")
    tail = _CHECKSUM_TAIL.match(text[-_TAIL_LEN:])
    if tail is None or tail.group(1).decode() != stored:
        return False  # not in sealed form: edited (or re-formatted) by hand
    return xxhash.xxh3_64_hexdigest(text[:-_TAIL_LEN] + b"}") == stored


def sealed_checksum(data: bytes) -> str | None:
    """The checksum a sealed file carries in its tail (None when the bytes are not sealed)."""
    tail = _CHECKSUM_TAIL.match(data.rstrip(b"\n")[-_TAIL_LEN:])
    return tail.group(1).decode() if tail else None


def seal_checked(obj: dict[str, Any], *, where: str) -> bytes:
    """`seal_document` of a version file's JSON object, once the schema accepts it."""
    obj.pop("checksum", None)
    validate(obj, where=where)
    return seal_document(obj)
