"""Validating manifest documents against the manifest JSON Schema (package data).

The schema is the one statement of what a manifest may hold, and the only source of the rules
below. A document is checked whole, full manifest and delta alike, by rules read from the
schema once: one `_Rule` per schema node (each ``$defs`` entry compiled once and shared by
every ``$ref`` to it), which `_problem` applies with one call per node of the value rather than
one per keyword. A reader loads several documents per commit, and a full manifest lists one
segment entry per commit, so a per-keyword interpreter would be the slowest step of both.

The rules implement a fixed set of JSON Schema 2020-12 keywords (``_KEYWORDS``), with strict
integers (a bool is no number, 1.0 is no integer); a schema using any other keyword, or a
``$ref`` to anything but ``#/$defs/...``, is refused when it is compiled, so the schema cannot
gain a rule that would be silently skipped. A fuzz test holds the verdicts equal to those of
jsonschema's validator.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable
from functools import lru_cache
from typing import Any, Union

from hsstore import schemas
from hsstore.errors import FormatError, SchemaError

_ANNOTATIONS = {"description", "title", "$comment"}
# The keywords the rules implement; any other in a compiled node is refused.
_KEYWORDS = _ANNOTATIONS | {
    "type", "required", "properties", "additionalProperties", "maxProperties",
    "minimum", "maximum", "pattern", "const", "enum",
    "items", "minItems", "maxItems", "uniqueItems",
    "$ref", "allOf", "if", "then", "else", "not",
}  # fmt: skip
# Allowed at the root only: the dialect (which must be 2020-12), the base URI of the
# ``#/$defs/...`` references, and the definitions they name.
_ROOT_KEYWORDS = {"$schema", "$id", "$defs"}
_DIALECT = "https://json-schema.org/draft/2020-12/schema"
_REF = re.compile(r"^#/\$defs/([A-Za-z0-9_.-]+)$")


@lru_cache(maxsize=1)
def schema() -> dict[str, Any]:
    return schemas.load(schemas.MANIFEST)


@lru_cache(maxsize=1)
def _compiler() -> _Compiler:
    """The manifest schema's compiler: the document's rule and `_segment_rule` share its defs."""
    return _Compiler(schema())


@lru_cache(maxsize=1)
def _document_rule() -> _Rule:
    return _compiler().root()


def validate(obj: Any, *, where: str) -> None:
    """Raise SchemaError naming the first violation (JSON path and what is wrong)."""
    problem = _document_problem(obj)
    if problem is not None:
        loc, what = problem
        raise SchemaError(f"schema violation at {loc or '(top level)'}: {what}", path=where)


def _document_problem(obj: Any) -> tuple[str, str] | None:
    """Where (a JSON path, "" for the top level) and what breaks the manifest schema."""
    return _outcome(_document_rule(), obj)


# A check returns None, or where (a JSON path below the checked value) and what is wrong.
Check = Callable[[Any], "tuple[str, str] | None"]

# The Python types of each JSON type (with strict integers: 1.0 is no integer, and a bool is
# no number).
_PY_TYPES: dict[str, tuple[type, ...]] = {
    "object": (dict,),
    "array": (list,),
    "string": (str,),
    "integer": (int,),
    "number": (int, float),
    "boolean": (bool,),
    "null": (type(None),),
}
_JSON_KINDS = frozenset(t for kinds in _PY_TYPES.values() for t in kinds)
_NUMBERS = frozenset((int, float))
_OBJECT_KEYWORDS = ("required", "properties", "additionalProperties", "maxProperties")
_ARRAY_KEYWORDS = ("items", "minItems", "maxItems", "uniqueItems")
_SCALAR_KEYWORDS = ("minimum", "maximum", "pattern", "const", "enum")
_APPLICATORS = ("$ref", "allOf", "if", "not")

# A compiled subschema: True (anything), False (nothing) or a `_Rule`.
Sub = Union[bool, "_Rule"]


class _Rule:
    """One schema node, read once: what `_problem` checks of a value, with no call per keyword.
    Each subschema it applies (``extra``: the rule for properties the node does not name,
    ``each``: the rule for every item of an array) is a `Sub`."""

    __slots__ = ("allowed", "wanted", "scalar", "bounded", "lo", "hi", "regex", "listed",
                 "const", "const_text", "enum", "enum_text", "members", "required",
                 "required_set", "props", "extra", "most", "elements", "each", "fewest",
                 "longest", "unique", "applies", "all", "cond", "then", "otherwise",
                 "negated")  # fmt: skip

    def read(self, node: dict[str, Any], compiler: _Compiler) -> None:
        names = node.get("type")
        names = [] if names is None else names if isinstance(names, list) else [names]
        unknown_types = [n for n in names if n not in _PY_TYPES]
        if unknown_types:
            raise SchemaError(f"schema rule names unknown types {unknown_types}")
        self.allowed = frozenset(t for n in names for t in _PY_TYPES[n]) or None
        self.wanted = " or ".join(repr(n) for n in names)
        self.scalar = any(k in node for k in _SCALAR_KEYWORDS)
        self.bounded = "minimum" in node or "maximum" in node
        self.lo, self.hi = node.get("minimum", -math.inf), node.get("maximum", math.inf)
        self.regex = re.compile(node["pattern"]) if "pattern" in node else None
        self.listed = "const" in node or "enum" in node
        self.const = (_json_key(node["const"]),) if "const" in node else None
        self.const_text = _short(node.get("const"))
        self.enum = frozenset(_json_key(v) for v in node["enum"]) if "enum" in node else None
        self.enum_text = repr(node.get("enum"))
        self.members = any(k in node for k in _OBJECT_KEYWORDS)
        self.required = tuple(node.get("required", ()))
        self.required_set = frozenset(self.required)
        self.props = {k: compiler.sub(v) for k, v in node.get("properties", {}).items()}
        self.extra = compiler.sub(node.get("additionalProperties", True))
        self.most = node.get("maxProperties", math.inf)
        self.elements = any(k in node for k in _ARRAY_KEYWORDS)
        self.each = compiler.sub(node.get("items", True))
        self.fewest, self.longest = node.get("minItems", 0), node.get("maxItems", math.inf)
        self.unique = bool(node.get("uniqueItems", False))
        self.applies = any(k in node for k in _APPLICATORS)
        refs = [compiler.ref(node["$ref"])] if "$ref" in node else []
        self.all = tuple(refs + [compiler.sub(v) for v in node.get("allOf", ())])
        self.cond = compiler.sub(node["if"]) if "if" in node else None
        self.then = _Branch(compiler.sub(node.get("then", True)), node.get("then"))
        self.otherwise = _Branch(compiler.sub(node.get("else", True)), node.get("else"))
        self.negated = compiler.sub(node["not"]) if "not" in node else None


class _Branch:
    """The ``then`` or ``else`` of a node: its rule, and the description its failures quote."""

    __slots__ = ("rule", "note")

    def __init__(self, rule: Sub, node: Any):
        self.rule = rule
        note = node.get("description") if isinstance(node, dict) else None
        self.note = f" ({note})" if note else ""


class _Compiler:
    """Reads one schema document into rules; each ``$defs`` entry is compiled once."""

    def __init__(self, document: dict[str, Any]):
        self.document = document
        self.defs: dict[str, Sub] = {}

    def root(self) -> _Rule:
        dialect = self.document.get("$schema", _DIALECT)
        if dialect != _DIALECT:
            raise SchemaError(f"schema dialect {dialect!r} is not {_DIALECT!r}")
        rule = _Rule()
        self._read(rule, self.document, _KEYWORDS | _ROOT_KEYWORDS)
        return rule

    def sub(self, node: Any) -> Sub:
        if isinstance(node, bool):
            return node
        if not isinstance(node, dict):
            raise SchemaError(f"schema rule {_short(node)} is neither an object nor a boolean")
        if set(node) <= _ANNOTATIONS:
            return True  # no rule: anything passes
        if "$ref" in node and set(node) <= _ANNOTATIONS | {"$ref"}:
            return self.ref(node["$ref"])  # the shared rule itself, not a node around it
        rule = _Rule()
        self._read(rule, node, _KEYWORDS)
        return rule

    def ref(self, ref: Any) -> Sub:
        match = _REF.match(ref) if isinstance(ref, str) else None
        defs = self.document.get("$defs", {})
        if match is None or match.group(1) not in defs:
            raise SchemaError(f"schema reference {ref!r} is not one of this schema's $defs")
        name = match.group(1)
        if name not in self.defs:
            node = defs[name]
            if isinstance(node, bool):
                self.defs[name] = node
            else:
                # Registered before it is read, so a definition that refers to itself shares it.
                self.defs[name] = rule = _Rule()
                self._read(rule, node, _KEYWORDS)
        return self.defs[name]

    def _read(self, rule: _Rule, node: Any, allowed: set[str]) -> None:
        if not isinstance(node, dict):
            raise SchemaError(f"schema rule {_short(node)} is neither an object nor a boolean")
        unknown = set(node) - allowed
        if unknown:
            raise SchemaError(f"schema rule uses {sorted(unknown)}, which the fast path lacks")
        rule.read(node, self)


def compile_rule(node: dict[str, Any]) -> Check:
    """The check of one schema document, read from it keyword by keyword.

    It implements the keywords in ``_KEYWORDS`` as JSON Schema 2020-12 defines them (with
    strict integers), ``$ref`` to the document's own ``$defs``; a node using any other keyword
    is refused here, so the schema cannot gain a rule the check would silently skip.
    """
    rule = _Compiler(node).root()
    return lambda value: _outcome(rule, value)


def _outcome(rule: Sub, x: Any) -> tuple[str, str] | None:
    if rule is True:
        return None
    if rule is False:
        return "", f"{_short(x)} is not allowed here"
    return _problem(rule, x)


def _problem(rule: _Rule, x: Any) -> tuple[str, str] | None:
    """Where below ``x`` and what breaks ``rule``; None when nothing does."""
    kind = type(x)
    if kind not in _JSON_KINDS:
        kind = _json_kind(x)
    if rule.allowed is not None and kind not in rule.allowed:
        return "", f"{_short(x)} is not of type {rule.wanted}"
    if rule.scalar:
        if rule.bounded and kind in _NUMBERS and not rule.lo <= x <= rule.hi:
            return "", f"{_short(x)} is not in [{rule.lo}, {rule.hi}]"
        if rule.regex is not None and kind is str and rule.regex.search(x) is None:
            return "", f"{_short(x)} does not match {rule.regex.pattern!r}"
        if rule.listed:
            problem = _listed_problem(rule, x, x if kind is str else _json_key(x))
            if problem is not None:
                return "", problem
    if rule.members and kind is dict:
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
                if key in props:
                    return key, f"{_short(value)} is not allowed here"
                return "", f"additional property {_short(key)} is not allowed"
            problem = _problem(child, value)
            if problem is not None:
                return _below(key, problem)
    elif rule.elements and kind is list:
        problem = _array_problem(rule, x)
        if problem is not None:
            return problem
    if rule.applies:
        return _applied_problem(rule, x)
    return None


def _listed_problem(rule: _Rule, x: Any, key: Any) -> str | None:
    """What breaks ``const`` or ``enum`` for ``x``, whose `_json_key` is ``key``."""
    if rule.const is not None and key != rule.const[0]:
        return f"{_short(x)} is not {rule.const_text}"
    if rule.enum is not None and key not in rule.enum:
        return f"{_short(x)} is not one of {rule.enum_text}"
    return None


def _array_problem(rule: _Rule, x: list) -> tuple[str, str] | None:
    if len(x) < rule.fewest:
        return "", f"has {len(x)} items, fewer than the {rule.fewest} required"
    if len(x) > rule.longest:
        return "", f"has {len(x)} items, more than the {rule.longest} allowed"
    if rule.unique and len({_json_key(item) for item in x}) < len(x):
        return "", f"{_short(x)} has repeated items"
    each = rule.each
    if each is True:
        return None
    for k, item in enumerate(x):
        problem = _outcome(each, item)
        if problem is not None:
            return _below(k, problem)
    return None


def _applied_problem(rule: _Rule, x: Any) -> tuple[str, str] | None:
    for sub in rule.all:
        problem = _outcome(sub, x)
        if problem is not None:
            return problem
    if rule.cond is not None:
        branch = rule.then if _outcome(rule.cond, x) is None else rule.otherwise
        problem = _outcome(branch.rule, x)
        if problem is not None:
            return problem[0], problem[1] + branch.note
    if rule.negated is not None and _outcome(rule.negated, x) is None:
        if rule.negated is True:
            return "", f"{_short(x)} is not allowed here"
        return "", f"{_short(x)} matches a rule it must not match"
    return None


def _below(key: str | int, problem: tuple[str, str]) -> tuple[str, str]:
    where, what = problem
    return (f"{key}/{where}" if where else str(key)), what


def _json_kind(x: Any) -> type:
    """The JSON type of a value of a subclass of a JSON type. An int subclass (an IntEnum) is
    a number but not a (strict) integer, so it is checked as a float is."""
    for base in (dict, list, str, float):
        if isinstance(x, base):
            return base
    return float if isinstance(x, int) else type(x)


_TRUE, _FALSE = object(), object()


def _json_key(x: Any) -> Any:
    """A hashable key equal for values JSON Schema holds equal (1 and 1.0) and unequal for
    those it holds apart (True and 1, a list and an object)."""
    if x is True:
        return _TRUE
    if x is False:
        return _FALSE
    if isinstance(x, (list, tuple)):
        return tuple(_json_key(item) for item in x)
    if isinstance(x, dict):
        return frozenset((key, _json_key(value)) for key, value in x.items())
    return x


def _segment_rule() -> Sub:
    return _compiler().ref("#/$defs/segment")


def _check_segment(seg: Any) -> str | None:
    """What is wrong with one segment entry under ``$defs/segment`` (None if nothing)."""
    problem = _outcome(_segment_rule(), seg)
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
