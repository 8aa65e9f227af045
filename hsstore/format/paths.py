"""Every file name of the format, in one place (see docs/FORMAT.md)."""

from __future__ import annotations

import re

ROOT_ZARR_JSON = "zarr.json"
MANIFESTS = "manifests"
SEGMENTS = "segments"
SEGMENTS_ZARR_JSON = f"{SEGMENTS}/zarr.json"

STATES = "states"
INDEX = "index.parquet"
STATS = "stats.json"
WRITING_LOCK = ".writing"

_MANIFEST_RE = re.compile(r"^v(\d{8,})\.json$")


def manifest_key(version: int) -> str:
    return f"{MANIFESTS}/v{version:08d}.json"


def manifest_version(name: str) -> int | None:
    """The version number a manifest file name carries, or None for anything else."""
    m = _MANIFEST_RE.match(name)
    return int(m.group(1)) if m else None


def segment_dir(segment_id: str) -> str:
    return f"{SEGMENTS}/{segment_id}"


def segment_file(segment_id: str, relpath: str) -> str:
    return f"{SEGMENTS}/{segment_id}/{relpath}"


def shard_relpath(shard: int) -> str:
    """Zarr v3 default chunk key of shard ``shard`` of the [rows, layers, hidden] array."""
    return f"{STATES}/c/{shard}/0/0"


def column_relpath(name: str) -> str:
    return f"{name}/c/0"
