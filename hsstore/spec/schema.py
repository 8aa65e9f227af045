"""Validating manifest documents against the manifest JSON Schema (package data).

The schema is the one statement of what a manifest may hold, and the only source of the rules
below. jsonschema checks a document's fixed part. The segment entries, one per commit and so
as many as the dataset's history is long, would make jsonschema's per-keyword interpretation
the slowest step of opening a dataset; they are checked instead against the schema's own
``$defs/segment``, read once into one `_Rule` per schema node, which `_problem` applies with
one call per node of the value rather than one per keyword. It implements a fixed set of keywords and refuses a schema that
uses any other, and a fuzz test holds its verdicts equal to jsonschema's.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable
from functools import lru_cache
from typing import Any

from hsstore import schemas
from hsstore.errors import FormatError, SchemaError

# Keywords the segment fast path implements; any other in $defs/segment is refused at load,
# so the schema cannot gain a rule the fast path would silently skip.
_FAST_KEYWORDS = {"type", "required", "properties", "additionalProperties", "minimum", "maximum",
                  "pattern", "maxProperties", "description"}  # fmt: skip


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


# A check returns None, or where (a JSON path below the checked value) and what is wrong.
Check = Callable[[Any], "tuple[str, str] | None"]

# The Python types of each JSON type (with the strict integers of ``_validator``: 1.0 is no
# integer, and a bool is no number).
_PY_TYPES: dict[str, tuple[type, ...]] = {
    "object": (dict,),
    "array": (list,),
    "string": (str,),
    "integer": (int,),
    "number": (int, float),
    "boolean": (bool,),
    "null": (type(None),),
}
_NUMBERS = frozenset((int, float))
_OBJECT_KEYWORDS = ("required", "properties", "additionalProperties", "maxProperties")


class _Rule:
    """One schema node, read once: what `_problem` checks of a value, with no call per keyword.
    ``extra`` is the rule for properties the node does not name: True (any), False (none) or a
    `_Rule`."""

    __slots__ = ("allowed", "wanted", "bounded", "lo", "hi", "regex", "members", "required",
                 "required_set", "props", "extra", "most")  # fmt: skip

    def __init__(self, node: dict[str, Any]):
        unknown = _keywords(node) - _FAST_KEYWORDS
        if unknown:
            raise SchemaError(f"schema rule uses {sorted(unknown)}, which the fast path lacks")
        names = node.get("type")
        names = [] if names is None else names if isinstance(names, list) else [names]
        self.allowed = frozenset(t for n in names for t in _PY_TYPES[n]) or None
        self.wanted = " or ".join(repr(n) for n in names)
        self.bounded = "minimum" in node or "maximum" in node
        self.lo, self.hi = node.get("minimum", -math.inf), node.get("maximum", math.inf)
        self.regex = re.compile(node["pattern"]) if "pattern" in node else None
        self.members = any(k in node for k in _OBJECT_KEYWORDS)
        self.required = tuple(node.get("required", ()))
        self.required_set = frozenset(self.required)
        self.props = {k: _Rule(v) for k, v in node.get("properties", {}).items()}
        extra = node.get("additionalProperties", True)
        self.extra = _Rule(extra) if isinstance(extra, dict) else bool(extra)
        self.most = node.get("maxProperties", math.inf)


def compile_rule(node: dict[str, Any]) -> Check:
    """The check of one schema node, read from it keyword by keyword.

    It implements the keywords in ``_FAST_KEYWORDS`` as JSON Schema 2020-12 defines them (with
    the strict integers of ``_validator``); a node using any other keyword is refused here, so
    the schema cannot gain a rule the check would silently skip.
    """
    rule = _Rule(node)
    return lambda value: _problem(rule, value)


def _problem(rule: _Rule, x: Any) -> tuple[str, str] | None:
    """Where below ``x`` and what breaks ``rule``; None when nothing does."""
    kind = type(x)
    if rule.allowed is not None and kind not in rule.allowed:
        return "", f"{_short(x)} is not of type {rule.wanted}"
    if rule.bounded and kind in _NUMBERS and not rule.lo <= x <= rule.hi:
        return "", f"{_short(x)} is not in [{rule.lo}, {rule.hi}]"
    if rule.regex is not None and kind is str and rule.regex.search(x) is None:
        return "", f"{_short(x)} does not match {rule.regex.pattern!r}"
    if not rule.members or kind is not dict:
        return None
    if not rule.required_set <= x.keys():
        missing = next(key for key in rule.required if key not in x)
        return "", f"{missing!r} is a required property"
    if len(x) > rule.most:
        return "", f"has more than {rule.most} properties"
    props, extra = rule.props, rule.extra
    for key, value in x.items():
        child = props.get(key, extra)
        if child is True:
            continue
        if child is False:
            return "", f"additional property {_short(key)} is not allowed"
        problem = _problem(child, value)
        if problem is not None:
            return f"{key}/{problem[0]}".rstrip("/"), problem[1]
    return None


def _keywords(node: Any) -> set[str]:
    """The keywords of ``node`` itself (its subschemas are compiled, and checked, on their own)."""
    return set(node) if isinstance(node, dict) else set()


@lru_cache(maxsize=1)
def _segment_rule() -> _Rule:
    return _Rule(schema()["$defs"]["segment"])


def _check_segment(seg: Any) -> str | None:
    """What is wrong with one segment entry under ``$defs/segment`` (None if nothing)."""
    problem = _problem(_segment_rule(), seg)
    if problem is None:
        return None
    where, what = problem
    return f"{where}: {what}" if where else what


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


# A bound on what a manifest may claim: how deeply its free-form parts (provenance, tokenizer)
# nest, so a hostile or damaged one cannot make a reader recurse without limit.
MAX_NESTING = 64


def check_nesting(obj: Any, *, where: str) -> None:
    """Refuse documents nested deeper than MAX_NESTING (iteratively: no recursion to exhaust)."""
    stack = [(obj, 0)]
    while stack:
        node, depth = stack.pop()
        if depth > MAX_NESTING:
            raise FormatError(f"manifest is nested deeper than {MAX_NESTING} levels", path=where)
        if isinstance(node, dict):
            stack.extend((v, depth + 1) for v in node.values())
        elif isinstance(node, list):
            stack.extend((v, depth + 1) for v in node)
