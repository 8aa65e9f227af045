"""A delta's sample digest: the XXH3-64 of each sample id it adds, so a writer checks its own
ids against a version by reading that one file instead of every segment's index.

The digest is base64 (standard alphabet, padded) of one little-endian uint64 per added
sample, in the order of ``add_segments`` and, within a segment, of its index rows. A hash
match is only a candidate: whoever refuses a commit over it confirms the id in the segment's
index first (docs/FORMAT.md, "Commit protocol").
"""

from __future__ import annotations

import base64
import binascii
from collections.abc import Iterable, Sequence

import numpy as np
import xxhash

from hsstore.errors import FormatError


def id_hashes(sample_ids: Iterable[str]) -> np.ndarray:
    """The XXH3-64 of each id's UTF-8 bytes, in order (uint64)."""
    return np.fromiter(
        (xxhash.xxh3_64_intdigest(sid.encode()) for sid in sample_ids), dtype=np.uint64
    )


def encode(hashes: np.ndarray) -> str:
    return base64.b64encode(np.asarray(hashes, dtype="<u8").tobytes()).decode("ascii")


def decode(digest: str, *, expected: int, where: str) -> np.ndarray:
    """The hashes a digest holds; FormatError unless it is base64 of exactly ``expected``."""
    try:
        raw = base64.b64decode(digest.encode("ascii"), validate=True)
    except (binascii.Error, UnicodeEncodeError, ValueError) as exc:
        raise FormatError(f"sample_digest is not base64 ({exc})", path=where) from None
    if len(raw) != 8 * expected:
        raise FormatError(
            f"sample_digest holds {len(raw) // 8} hashes for {expected} added samples", path=where
        )
    return np.frombuffer(raw, dtype="<u8").astype(np.uint64)


def split(hashes: np.ndarray, counts: Sequence[int]) -> list[np.ndarray]:
    """The hashes of each segment, given each one's sample count (the digest's order)."""
    return np.split(hashes, np.cumsum(counts)[:-1]) if len(counts) else []
