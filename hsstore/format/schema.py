"""Validating manifest documents against the manifest JSON Schema (package data).

The schema is the one statement of what a manifest may hold. jsonschema checks a document's
fixed part; the segment entries, whose number grows with history, are checked by a
straight-line form of the schema's own ``$defs/segment`` (its bounds and patterns read from
the schema file; a test holds the two equal): jsonschema took ~9 s over a 10,000-segment
checkpoint, the whole load now takes under a second.
"""

from __future__ import annotations

import math
import re
from functools import lru_cache
from typing import Any

from hsstore import schemas
from hsstore.errors import SchemaError

# Keywords the segment fast path implements; any other in $defs/segment is refused at load,
# so the schema cannot gain a rule the fast path would silently skip.
_FAST_KEYWORDS = {"type", "required", "additionalProperties", "minimum", "maximum", "pattern",
                  "maxProperties", "description"}  # fmt: skip


@lru_cache(maxsize=1)
def schema() -> dict[str, Any]:
    return schemas.load(schemas.MANIFEST)


@lru_cache(maxsize=1)
def _validator() -> Any:
    import jsonschema

    base = jsonschema.Draft202012Validator
    strict_ints = base.TYPE_CHECKER.redefine("integer", lambda _, x: type(x) is int)
    return jsonschema.validators.extend(base, type_checker=strict_ints)(schema())


def validate(obj: Any, *, where: str) -> None:
    """Raise SchemaError naming the first violation (JSON path and message)."""
    segments_key = (
        "add_segments" if isinstance(obj, dict) and obj.get("kind") == "delta" else "segments"
    )
    segments = obj.get(segments_key) if isinstance(obj, dict) else None
    if isinstance(segments, list) and segments:
        _validate_whole({**obj, segments_key: []}, where=where)
        for k, seg in enumerate(segments):
            problem = _check_segment(seg)
            if problem is not None:
                raise SchemaError(f"schema violation at {segments_key}/{k}: {problem}", path=where)
    else:
        _validate_whole(obj, where=where)


def _validate_whole(obj: Any, *, where: str) -> None:
    errors = sorted(_validator().iter_errors(obj), key=lambda e: list(e.absolute_path))
    if errors:
        err = errors[0]
        loc = "/".join(str(p) for p in err.absolute_path) or "(top level)"
        more = f" (+{len(errors) - 1} more)" if len(errors) > 1 else ""
        raise SchemaError(f"schema violation at {loc}: {err.message}{more}", path=where)


class _SegmentRules:
    """``$defs/segment`` of the schema, as plain values for `_check_segment`."""

    def __init__(self, rule: dict[str, Any]):
        unknown = _keywords(rule) - _FAST_KEYWORDS
        if unknown:
            raise SchemaError(f"$defs/segment uses {sorted(unknown)}, which the fast path lacks")
        props = rule["properties"]
        self.keys = frozenset(props)
        self.required = frozenset(rule["required"])
        self.id_pattern = re.compile(props["id"]["pattern"])
        self.counts = {
            k: (v.get("minimum", -math.inf), v.get("maximum", math.inf))
            for k, v in props.items()
            if v.get("type") == "integer"
        }
        files = props["files"]
        self.max_files = files.get("maxProperties", math.inf)
        entry = files["additionalProperties"]["properties"]
        self.file_keys = frozenset(entry)
        self.file_required = frozenset(files["additionalProperties"]["required"])
        self.size = (entry["size"]["minimum"], entry["size"]["maximum"])
        self.crc = (entry["crc32c"]["minimum"], entry["crc32c"]["maximum"])


def _keywords(node: Any) -> set[str]:
    if not isinstance(node, dict):
        return set()
    found = set(node) - {"properties"}
    for child in node.get("properties", {}).values():
        found |= _keywords(child)
    return found | _keywords(node.get("additionalProperties"))


@lru_cache(maxsize=1)
def _segment_rules() -> _SegmentRules:
    return _SegmentRules(schema()["$defs"]["segment"])


def _check_segment(seg: Any) -> str | None:
    """What is wrong with one segment entry under ``$defs/segment`` (None if nothing):
    the same rules as jsonschema, straight-line, since there is one entry per commit."""
    r = _segment_rules()
    if type(seg) is not dict:
        return f"{_short(seg)} is not of type 'object'"
    if not r.required <= seg.keys():
        return f"{sorted(r.required - seg.keys())[0]!r} is a required property"
    if not seg.keys() <= r.keys:
        return f"additional property {sorted(seg.keys() - r.keys)[0]!r} is not allowed"
    if type(seg["id"]) is not str or not r.id_pattern.search(seg["id"]):
        return f"id {_short(seg['id'])} does not match {r.id_pattern.pattern!r}"
    if type(seg["committed_at"]) is not str:
        return "committed_at is not of type 'string'"
    for key, (lo, hi) in r.counts.items():
        if key not in seg:  # optional (num_rows); the required ones were checked above
            continue
        value = seg[key]
        if type(value) is not int or not lo <= value <= hi:
            return f"{key} {_short(value)} is not an integer in [{lo}, {hi}]"
    files = seg["files"]
    if type(files) is not dict or len(files) > r.max_files:
        return f"files is not an object of at most {r.max_files} entries"
    for name, entry in files.items():
        if type(entry) is not dict or not r.file_required <= entry.keys() <= r.file_keys:
            return f"files/{name} must be an object with {sorted(r.file_keys)} only"
        size, crc = entry["size"], entry.get("crc32c")
        if type(size) is not int or not r.size[0] <= size <= r.size[1]:
            return f"files/{name}/size {_short(size)} is not an integer in {list(r.size)}"
        if crc is not None and (type(crc) is not int or not r.crc[0] <= crc <= r.crc[1]):
            return f"files/{name}/crc32c {_short(crc)} is not an integer in {list(r.crc)}"
    return None


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."
