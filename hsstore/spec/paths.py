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
# A byte-identical copy of INDEX, written beside it (not named in the manifest entry, so
# readers that do not know it ignore it): checked against INDEX's size and crc32c, it is read
# when INDEX is missing or damaged.
INDEX_COPY = "index-copy.parquet"
WRITING_LOCK = ".writing"
# Written into a segment after the version that added it was published: evidence that a
# committed version existed, should its manifest file be lost (not part of the data).
COMMITTED_MARK = ".committed"
# The per-token columns beside the states; SCALES only in datasets of a scaled dtype (fp8).
TOKEN_COLUMNS = ("input_ids", "loss_mask")
SCALES = "scales"

# Every file of a committed segment except its shards (whose names `shard_relpath` makes).
SEGMENT_SMALL_FILES = frozenset(
    {"zarr.json", f"{STATES}/zarr.json", INDEX, STATS}
    | {f"{col}/zarr.json" for col in (*TOKEN_COLUMNS, SCALES)}
    | {f"{col}/c/0" for col in (*TOKEN_COLUMNS, SCALES)}
)
# The highest version a commit has announced; it only moves forward, so a deleted newest
# manifest is detected instead of silently rolling the dataset back.
LATEST_HINT = f"{MANIFESTS}/_latest"

# Group commit: a writer that lost a race leaves its commit here for whichever writer creates
# the next version to publish with its own (hsstore.commits.group). Not data: a reader ignores
# the folder, and what an intent names is committed only once a version lists it.
INTENTS = f"{MANIFESTS}/intents"
# An intent's name starts with when its writer left it (milliseconds since the epoch, by the
# writer's clock), so a listing sorts the waiting writers by arrival; a name without it sorts
# first.
_INTENT_RE = re.compile(r"^(?:(\d{13,16})-)?([0-9a-f]{32}\.[0-9]{1,16})\.json$")

_MANIFEST_RE = re.compile(r"^v(\d{8,})\.json$")
_CHECKPOINT_RE = re.compile(r"^c(\d{8,})\.json$")
_SHARD_RE = re.compile(rf"^{STATES}/c/(0|[1-9]\d{{0,8}})/0/0$")


def manifest_key(version: int) -> str:
    return f"{MANIFESTS}/v{version:08d}.json"


def manifest_version(name: str) -> int | None:
    """The version number a manifest file name carries, or None for anything else."""
    m = _MANIFEST_RE.match(name)
    return int(m.group(1)) if m else None


def intent_key(token: str, arrival_ms: int) -> str:
    return f"{INTENTS}/{arrival_ms:013d}-{token}.json"


def intent_token(name: str) -> str | None:
    """The commit token an intent file name carries, or None for anything else."""
    parts = intent_parts(name)
    return parts[1] if parts else None


def intent_parts(name: str) -> tuple[int, str] | None:
    """When an intent's writer left it (ms since the epoch; 0 when its name does not say) and
    its commit token, or None for a name that is no intent's."""
    m = _INTENT_RE.match(name)
    return (int(m.group(1) or 0), m.group(2)) if m else None


def checkpoint_key(version: int) -> str:
    """The full state at ``version``, folded from the deltas before it (written every K)."""
    return f"{MANIFESTS}/c{version:08d}.json"


def checkpoint_version(name: str) -> int | None:
    m = _CHECKPOINT_RE.match(name)
    return int(m.group(1)) if m else None


def shard_of(relpath: str) -> int | None:
    """The shard number of a segment-relative shard path, or None for any other name."""
    m = _SHARD_RE.match(relpath)
    return int(m.group(1)) if m else None


_SEGMENT_ID_RE = re.compile(r"^[0-9a-f]{32}$")


def is_segment_id(name: str) -> bool:
    """Whether a name under segments/ can be a segment (32 lowercase hex digits)."""
    return _SEGMENT_ID_RE.match(name) is not None


def segment_dir(segment_id: str) -> str:
    return f"{SEGMENTS}/{segment_id}"


def segment_file(segment_id: str, relpath: str) -> str:
    return f"{SEGMENTS}/{segment_id}/{relpath}"


def shard_relpath(shard: int) -> str:
    """Zarr v3 default chunk key of shard ``shard`` of the [rows, layers, hidden] array."""
    return f"{STATES}/c/{shard}/0/0"


def column_relpath(name: str) -> str:
    return f"{name}/c/0"
