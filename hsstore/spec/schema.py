"""Validating manifest documents against the manifest JSON Schema (package data).

The schema is the one statement of what a manifest may hold, and the only source of the rules
below. jsonschema checks a document's fixed part. The segment entries, one per commit and so
as many as the dataset's history is long, would make jsonschema's per-keyword interpretation
the slowest step of opening a dataset; they are checked instead by Python compiled from the
schema's own ``$defs/segment`` (`compile_predicate`), with `compile_rule` naming the problem
of an entry it refuses. Both implement a fixed set of keywords and refuse a schema that uses
any other, and a fuzz test holds their verdicts equal to jsonschema's.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable
from functools import lru_cache
from typing import Any

from hsstore import schemas
from hsstore.errors import SchemaError

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

# Each JSON type as a Python test of ``{v}`` (with the strict integers of ``_validator``: 1.0
# is no integer); `compile_predicate` inlines the source, `compile_rule` calls the functions.
_TYPE_TESTS = {
    "object": "type({v}) is dict",
    "array": "type({v}) is list",
    "string": "type({v}) is str",
    "integer": "type({v}) is int",
    "number": "type({v}) in (int, float)",
    "boolean": "type({v}) is bool",
    "null": "{v} is None",
}
_TYPES: dict[str, Callable[[Any], bool]] = {
    name: eval(f"lambda v: {test.format(v='v')}") for name, test in _TYPE_TESTS.items()
}


def compile_rule(node: dict[str, Any]) -> Check:
    """A straight-line check of one schema node, derived from it keyword by keyword.

    It implements the keywords in ``_FAST_KEYWORDS`` as JSON Schema 2020-12 defines them (with
    the strict integers of ``_validator``); a node using any other keyword is refused here, so
    the schema cannot gain a rule the fast path would silently skip.
    """
    unknown = _keywords(node) - _FAST_KEYWORDS
    if unknown:
        raise SchemaError(f"schema rule uses {sorted(unknown)}, which the fast path lacks")
    checks: list[Check] = []
    if "type" in node:
        names = node["type"] if isinstance(node["type"], list) else [node["type"]]
        tests = [_TYPES[n] for n in names]
        wanted = " or ".join(repr(n) for n in names)
        checks.append(
            lambda x: (
                None if any(t(x) for t in tests) else ("", f"{_short(x)} is not of type {wanted}")
            )
        )
    if "minimum" in node or "maximum" in node:
        lo, hi = node.get("minimum", -math.inf), node.get("maximum", math.inf)
        checks.append(
            lambda x: (
                ("", f"{_short(x)} is not in [{lo}, {hi}]")
                if type(x) in (int, float) and not lo <= x <= hi
                else None
            )
        )
    if "pattern" in node:
        regex = re.compile(node["pattern"])
        checks.append(
            lambda x: (
                ("", f"{_short(x)} does not match {regex.pattern!r}")
                if type(x) is str and not regex.search(x)
                else None
            )
        )
    if any(k in node for k in ("required", "properties", "additionalProperties", "maxProperties")):
        checks.append(_object_check(node))
    if len(checks) == 1:
        return checks[0]

    def check(x: Any) -> tuple[str, str] | None:
        for c in checks:
            problem = c(x)
            if problem is not None:
                return problem
        return None

    return check


def _object_check(node: dict[str, Any]) -> Check:
    required = tuple(node.get("required", ()))
    props = {k: compile_rule(v) for k, v in node.get("properties", {}).items()}
    extra = node.get("additionalProperties", True)
    extra_check = compile_rule(extra) if isinstance(extra, dict) else None
    most = node.get("maxProperties", math.inf)

    def check(x: Any) -> tuple[str, str] | None:
        if type(x) is not dict:
            return None
        for key in required:
            if key not in x:
                return "", f"{key!r} is a required property"
        if len(x) > most:
            return "", f"has more than {most} properties"
        for key, value in x.items():
            rule = props.get(key, extra_check)
            if rule is None:
                if extra is False and key not in props:
                    return "", f"additional property {_short(key)} is not allowed"
                continue
            problem = rule(value)
            if problem is not None:
                return f"{key}/{problem[0]}".rstrip("/"), problem[1]
        return None

    return check


def _keywords(node: Any) -> set[str]:
    """The keywords of ``node`` itself (its subschemas are compiled, and checked, on their own)."""
    return set(node) if isinstance(node, dict) else set()


def compile_predicate(node: dict[str, Any]) -> Callable[[Any], bool]:
    """The yes/no form of `compile_rule` for the same node, generated as straight-line Python
    from the schema (one function, no call per keyword): it runs on every segment entry of a
    manifest, `compile_rule` only to name the problem of an entry this refused."""
    consts: dict[str, Any] = {}
    lines = ["def valid(v0):"]
    _emit(node, 0, 1, lines, consts)
    lines.append("    return True")
    namespace: dict[str, Any] = dict(consts)
    exec("\n".join(lines), namespace)  # the source is built above from the schema's keywords
    return namespace["valid"]


def _emit(node: dict[str, Any], depth: int, indent: int, lines: list[str], consts: dict) -> None:
    """Lines, ``indent`` levels in, that return False when ``v{depth}`` breaks ``node``."""
    if _keywords(node) - _FAST_KEYWORDS:
        compile_rule(node)  # raises, naming the keyword
    v, pad = f"v{depth}", "    " * indent
    start = len(lines)
    names = node.get("type", [])
    names = names if isinstance(names, list) else [names]
    if names:
        kinds = " or ".join(_TYPE_TESTS[n].format(v=v) for n in names)
        lines.append(f"{pad}if not ({kinds}): return False")
    bounds = []
    if "minimum" in node:
        bounds.append(f"{node['minimum']!r} <= {v}")
    if "maximum" in node:
        bounds.append(f"{v} <= {node['maximum']!r}")
    if bounds:
        test = f"type({v}) in (int, float) and not ({' and '.join(bounds)})"
        lines.append(f"{pad}if {test}: return False")
    if "pattern" in node:
        name = f"c{len(consts)}"
        consts[name] = re.compile(node["pattern"])
        lines.append(f"{pad}if type({v}) is str and {name}.search({v}) is None: return False")
    if any(k in node for k in ("required", "properties", "additionalProperties", "maxProperties")):
        _emit_object(node, depth, indent, lines, consts)
    if len(lines) == start:
        lines.append(f"{pad}pass")


def _emit_object(node: dict[str, Any], depth: int, indent: int, lines: list[str], consts: dict):
    v, pad = f"v{depth}", "    " * indent
    lines.append(f"{pad}if type({v}) is dict:")
    inner = pad + "    "
    lines.append(f"{inner}pass")
    if node.get("required"):
        name = f"c{len(consts)}"
        consts[name] = frozenset(node["required"])
        lines.append(f"{inner}if not {name} <= {v}.keys(): return False")
    if "maxProperties" in node:
        lines.append(f"{inner}if len({v}) > {node['maxProperties']!r}: return False")
    props = node.get("properties", {})
    extra = node.get("additionalProperties", True)
    if not props and extra is True:
        return
    key, child = f"k{depth}", f"v{depth + 1}"
    lines.append(f"{inner}for {key}, {child} in {v}.items():")
    body = inner + "    "
    for n, (prop, rule) in enumerate(props.items()):
        lines.append(f"{body}{'if' if n == 0 else 'elif'} {key} == {prop!r}:")
        _emit(rule, depth + 1, indent + 3, lines, consts)
    if props and extra is not True:
        lines.append(f"{body}else:")
    level = indent + (3 if props else 2)
    if extra is False:
        lines.append("    " * level + "return False")
    elif isinstance(extra, dict):
        _emit(extra, depth + 1, level, lines, consts)


@lru_cache(maxsize=1)
def _segment_rules() -> tuple[Callable[[Any], bool], Check]:
    rule = schema()["$defs"]["segment"]
    return compile_predicate(rule), compile_rule(rule)


def _check_segment(seg: Any) -> str | None:
    """What is wrong with one segment entry under ``$defs/segment`` (None if nothing)."""
    valid, explain = _segment_rules()
    if valid(seg):
        return None
    problem = explain(seg)
    if problem is None:  # the two forms of one rule disagree: a bug here, not in the data
        raise AssertionError(f"segment check forms disagree on {_short(seg)}")
    where, what = problem
    return f"{where}: {what}" if where else what


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."
