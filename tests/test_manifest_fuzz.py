"""Fuzzing manifests: whatever a version file says, hsstore gives a clean error or the right
numbers, never a hang, an unexpected exception or wrong data.

Three kinds of mutation, each one edit of a real dataset's manifest: a format 1 manifest (no
checksum) edited in place, a format 2 file edited in place (its checksum must catch it), and a
format 2 file edited and re-sealed with a valid checksum (a forged manifest).
"""

from __future__ import annotations

import copy
import json
import shutil
import signal
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import hsstore
from hsstore import HsstoreError, LayerSpec
from hsstore.spec.sealing import seal_document
from tools.synthetic import random_sample

H = 16
LENGTHS = [9, 30, 4]
SECONDS_PER_EXAMPLE = 20


def _build(path: Path) -> dict[str, torch.Tensor]:
    ds = hsstore.create(path, layers=[LayerSpec(1), LayerSpec(2), LayerSpec(3)], hidden_size=H,
                        dtype=torch.bfloat16, model={"num_hidden_layers": 3}, chunk_bytes=1024,
                        shard_bytes=4096)  # fmt: skip
    truth = {}
    for c in range(2):
        with ds.writer(encode_threads=1) as w:
            for i, t in enumerate(LENGTHS):
                _, _, hid = sample = random_sample(t, 3, H, seed=7 * c + i)
                w.add(f"c{c}-{i}", *sample)
                truth[f"c{c}-{i}"] = hid
    return truth


@pytest.fixture(scope="module")
def dataset(tmp_path_factory) -> tuple[Path, dict[str, torch.Tensor]]:
    path = tmp_path_factory.mktemp("fuzz") / "ds"
    return path, _build(path)


def _paths(node: Any, prefix: tuple = ()) -> Iterator[tuple]:
    yield prefix
    if isinstance(node, dict):
        for k, v in node.items():
            yield from _paths(v, (*prefix, k))
    elif isinstance(node, list):
        for k, v in enumerate(node):
            yield from _paths(v, (*prefix, k))


def _get(node: Any, path: tuple) -> Any:
    for p in path:
        node = node[p]
    return node


json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.text(max_size=12)
    | st.floats(allow_nan=False, allow_infinity=False) | st.sampled_from([0, 1, -1, 2**40, 64.0]),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner, max_size=3),
    max_leaves=8,
)  # fmt: skip


# What every decode depends on: a third of the edits hit these exact fields, a third anything
# under the fields a decode reads, the rest anywhere in the document.
_CRITICAL = {("layout", "rows_per_chunk"), ("layout", "chunks_per_shard"),
             ("layout", "layers_per_chunk"), ("hidden_size",), ("dtype",), ("storage_dtype",),
             ("codec", "name"), ("model", "hidden_size")}  # fmt: skip
_DECODE_FIELDS = {"layout", "hidden_size", "dtype", "storage_dtype", "layers", "codec", "model",
                  "num_tokens", "num_samples", "num_shards"}  # fmt: skip


@st.composite
def mutations(draw, doc: dict) -> dict:
    """``doc`` with one edit: a value replaced, nudged by one, removed, or a list item doubled."""
    doc = copy.deepcopy(doc)
    paths = [p for p in _paths(doc) if p]
    critical = [p for p in paths if p in _CRITICAL or (len(p) == 3 and p[2] == "num_tokens")]
    decoding = [
        p for p in paths if p[0] in _DECODE_FIELDS or (len(p) > 2 and p[2] in _DECODE_FIELDS)
    ]
    pools = [pool for pool in (critical, decoding, paths) if pool]
    path = draw(st.sampled_from(pools).flatmap(st.sampled_from))
    parent, key = _get(doc, path[:-1]), path[-1]
    old = parent[key]
    op = draw(st.sampled_from(["nudge", "nudge", "replace", "remove", "double"]))
    if op == "nudge" and type(old) is int:
        parent[key] = old + draw(st.sampled_from([-1, 1, 2**31, 2**40]))
    elif op == "remove":
        del parent[key]
    elif op == "double" and isinstance(parent, list):
        parent.insert(key, copy.deepcopy(old))
    else:
        parent[key] = draw(json_values)
    return doc


def _check_reads(path: Path, truth: dict[str, torch.Tensor]) -> None:
    """Open and read everything; any failure must be an HsstoreError, any data the truth."""
    try:
        ds = hsstore.open(path, verify_reads=False)
        for i, sid in enumerate(ds.sample_ids):
            sub = ds.read(i, layers=[0, 2]).hidden
            assert sid in truth and torch.equal(sub, truth[sid][:, [0, 2]]), sid
            assert torch.equal(ds.read(i).hidden, truth[sid]), sid
    except HsstoreError:
        pass
    report = hsstore.verify(path, workers=1)  # never raises on data problems
    assert isinstance(report.ok, bool)


class _Hang(Exception):
    pass


def _run_bounded(fn, *args) -> None:
    def on_alarm(signum, frame):
        raise _Hang(f"no answer within {SECONDS_PER_EXAMPLE} s")

    previous = signal.signal(signal.SIGALRM, on_alarm)
    signal.alarm(SECONDS_PER_EXAMPLE)
    try:
        fn(*args)
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)


def _workspace(dataset, tmp_path_factory, kind: str) -> tuple[Path, Path, dict, bytes]:
    src, truth = dataset
    work = tmp_path_factory.mktemp(kind) / "ds"
    shutil.copytree(src, work)
    if kind == "format1":
        obj = hsstore.open(work).manifest.to_json()
        obj.update(format_version=1, version=1)
        del obj["kind"]
        for f in (work / "manifests").iterdir():
            f.unlink()
        target = work / "manifests" / "v00000001.json"
        target.write_text(json.dumps(obj))
    else:
        target = work / "manifests" / ("v00000001.json" if kind == "full" else "v00000003.json")
    return work, target, json.loads(target.read_text()), target.read_bytes()


FUZZ = settings(max_examples=80, deadline=None, derandomize=True,
                suppress_health_check=[HealthCheck.function_scoped_fixture,
                                       HealthCheck.too_slow])  # fmt: skip


@pytest.mark.parametrize(
    "kind, reseal",
    [("format1", False), ("full", False), ("full", True), ("delta", False), ("delta", True)],
    ids=["format1-edited", "full-edited", "full-resealed", "delta-edited", "delta-resealed"],
)  # format 1 has no checksum to reseal
def test_fuzzed_manifest_gives_clean_error_or_right_numbers(
    dataset, tmp_path_factory, kind, reseal
):
    work, target, doc, original = _workspace(dataset, tmp_path_factory, kind)
    truth = dataset[1]

    def check(mutated: dict) -> None:
        try:
            if reseal:
                target.write_bytes(seal_document(mutated))
            else:
                target.write_text(json.dumps(mutated))
            _run_bounded(_check_reads, work, truth)
            if kind != "format1" and not reseal and mutated != doc:
                _refused_or_rebuilt(work)  # an edit of a sealed file never goes unnoticed
        finally:
            target.write_bytes(original)

    for nudged in _critical_nudges(doc):  # always covered, whatever the random draw
        check(nudged)
    FUZZ(given(mutated=mutations(doc))(check))()


def _refused_or_rebuilt(work: Path) -> None:
    """Open refuses the edited file, or serves a state rebuilt without it (the file set aside,
    as `hsstore repair` would) and says so: never the edited file's facts, silently."""
    try:
        ds = hsstore.open(work)
    except HsstoreError:
        return
    assert ds.rebuilt is not None and ds.rebuilt.unusable, "an edited file read as intact"


def _critical_nudges(doc: dict) -> Iterator[dict]:
    """Every critical integer field of ``doc`` moved by one either way."""
    for path in _paths(doc):
        if path in _CRITICAL and type(_get(doc, path)) is int:
            for step in (-1, 1):
                mutated = copy.deepcopy(doc)
                _get(mutated, path[:-1])[path[-1]] += step
                yield mutated


def _strict(rules: dict) -> Any:
    """jsonschema's 2020-12 validator of ``rules``, with hsstore's strict integers (the oracle)."""
    import jsonschema

    base = jsonschema.Draft202012Validator
    strict_ints = base.TYPE_CHECKER.redefine("integer", lambda _, x: type(x) is int)
    return jsonschema.validators.extend(base, type_checker=strict_ints)(rules)


def _assert_agrees(problem: tuple[str, str] | None, oracle: Any, doc: Any) -> None:
    """The fast verdict is jsonschema's, and the path it names is one jsonschema names too."""
    errors = list(oracle.iter_errors(doc))
    assert (problem is None) == (not errors), (problem, [e.message for e in errors[:3]], doc)
    if problem is not None:
        paths = {"/".join(str(p) for p in e.absolute_path) for e in errors}
        # jsonschema places the error of a false subschema at the value holding the member
        # (JSON Schema places it at the member, as the fast path does).
        parents = {
            "/".join(str(p) for p in e.absolute_path)
            for e in errors
            if e.message.startswith("False schema does not allow")
        }
        held = problem[0] in paths or problem[0].rpartition("/")[0] in parents
        assert held, (problem, paths)


def _segment_entry() -> dict:
    files = {"index.parquet": {"size": 2505, "crc32c": 4000305987}, "states/c/0/0/0": {"size": 9}}
    return {"id": "a" * 32, "num_samples": 2, "num_tokens": 40, "num_shards": 1,
            "committed_at": "2026-01-01T00:00:00.000+00:00", "files": files}  # fmt: skip


@settings(max_examples=400, deadline=None, derandomize=True)
@given(mutated=mutations(_segment_entry()))
def test_fast_segment_check_agrees_with_the_schema(mutated):
    """The segment check is the schema's $defs/segment, rule for rule."""
    from hsstore.spec import schema

    root = schema.schema()
    strict = _strict({**root["$defs"]["segment"], "$defs": root["$defs"]})
    assert schema._check_segment(_segment_entry()) is None
    assert (schema._check_segment(mutated) is None) == strict.is_valid(mutated), mutated


# Every keyword the compiled rules implement, in more combinations than the manifest schema
# uses today, so that a schema change using them is covered: a recursive definition, boolean
# subschemas, and const/enum values that JSON Schema's equality tells apart from look-alikes.
_OTHER_RULES = {
    "type": "object",
    "required": ["a"],
    "maxProperties": 4,
    "properties": {
        "a": {"type": ["number", "null"], "minimum": -1.5, "maximum": 7},
        "b": {"type": "boolean"},
        "c": {"type": "array", "items": {"$ref": "#/$defs/nest"}, "minItems": 1, "maxItems": 2,
              "uniqueItems": True},
        "d": {"pattern": "^x+$"},
        "e": {"enum": [1, "x", None, True, [0], {"k": 0}]},
        "f": {"const": 0},
        "g": False,
        "h": {"not": {"type": "string"}},
        "i": {"not": {}},
    },
    "additionalProperties": {"type": "string", "maxProperties": 1},
    "if": {"required": ["b"], "properties": {"b": {"const": True}}},
    "then": {"required": ["c"]},
    "else": {"properties": {"a": {"type": "integer"}}},
    "allOf": [{"properties": {"e": {"$ref": "#/$defs/nest"}}}],
    "$defs": {"nest": {"type": ["integer", "array", "object", "boolean"], "maximum": 3,
                       "items": {"$ref": "#/$defs/nest"}}},
}  # fmt: skip
_LOOKALIKES = [0, 0.0, 1, 1.0, True, False, None, "x", "1", [0], [0.0], [False], [1, 1.0],
               [1, True], {"k": 0}, {"k": 0.0}, {"k": False}, {"k": [True]}, {}, []]  # fmt: skip


@settings(max_examples=400, deadline=None, derandomize=True)
@given(
    doc=st.dictionaries(
        st.sampled_from("abcdefghiz"), json_values | st.sampled_from(_LOOKALIKES), max_size=5
    )
)
def test_compiled_rules_agree_with_jsonschema_on_every_keyword_they_implement(doc):
    from hsstore.spec.schema import compile_rule

    _assert_agrees(compile_rule(_OTHER_RULES)(doc), _strict(_OTHER_RULES), doc)


@pytest.mark.parametrize("wanted", _LOOKALIKES, ids=repr)
def test_const_enum_and_unique_items_follow_json_equality(wanted):
    """1 and 1.0 are equal, True and 1 are not, nor a list and an object: as JSON Schema says."""
    from hsstore.spec.schema import compile_rule

    rules = {"properties": {"const": {"const": wanted}, "enum": {"enum": [wanted, "y"]},
                            "unique": {"uniqueItems": True}}}  # fmt: skip
    check, oracle = compile_rule(rules), _strict(rules)
    for value in _LOOKALIKES:
        for doc in ({"const": value}, {"enum": value}, {"unique": [wanted, value]}):
            _assert_agrees(check(doc), oracle, doc)


@pytest.mark.parametrize(
    "rules, keyword",
    [
        ({"type": "object", "properties": {"at": {"type": "string", "format": "date-time"}}},
         "format"),
        ({"$ref": "#/$defs/x", "$defs": {"x": {"dependentRequired": {}}}}, "dependentRequired"),
        ({"if": {"type": "array"}, "then": {"prefixItems": []}}, "prefixItems"),
        ({"items": {"$ref": "other.json"}}, "other.json"),
        ({"$ref": "#/$defs/missing", "$defs": {}}, "missing"),
        ({"properties": {"a": {"$defs": {}}}}, "defs"),
        ({"$schema": "http://json-schema.org/draft-07/schema#"}, "draft-07"),
    ],
    ids=["format", "in-a-definition", "in-then", "foreign-ref", "missing-ref", "nested-defs",
         "dialect"],
)  # fmt: skip
def test_a_rule_the_compiled_rules_lack_is_refused(rules, keyword):
    from hsstore.errors import SchemaError
    from hsstore.spec.schema import compile_rule

    with pytest.raises(SchemaError, match=keyword):
        compile_rule(rules)


def test_the_manifest_schema_compiles_each_definition_once():
    from hsstore.spec import schema

    root = schema._document_rule()
    delta, full = root.then.rule, root.otherwise.rule
    assert delta is not full
    assert delta.props["add_segments"].each is full.props["segments"].each


@st.composite
def retyped(draw, doc: dict) -> dict:
    """``doc`` with one scalar given a look-alike: 2 as 2.0, True or "2"; True as 1."""
    doc = copy.deepcopy(doc)
    paths = [p for p in _paths(doc) if p and isinstance(_get(doc, p), (int, float, str))]
    path = draw(st.sampled_from(paths))
    parent, key = _get(doc, path[:-1]), path[-1]
    old = parent[key]
    if isinstance(old, bool):
        parent[key] = int(old)
    elif isinstance(old, (int, float)):
        parent[key] = draw(st.sampled_from([float(old), old != 0, str(old)]))
    else:
        parent[key] = draw(st.sampled_from([old + "x", old[:-1], True, 1, None]))
    return doc


def _documents(dataset) -> dict[str, dict]:
    """A real full manifest (with its segments) and a real delta of the fuzzed dataset."""
    path = dataset[0]
    delta = json.loads((path / "manifests" / "v00000003.json").read_text())
    assert delta["kind"] == "delta" and delta["add_segments"]
    return {"full": hsstore.open(path).manifest.to_json(), "delta": delta}


def _edits(kind: str, doc: dict) -> Iterator[dict]:
    """Edits each breaking one rule: const, enum, items, minItems, maxItems, uniqueItems, not,
    the kind dispatch, and integers given as floats or bools."""
    token = f"{'b' * 32}.1"
    common = {"format": "hsstorex", "kind": True, "format_version": 2.0, "version": True}
    if kind == "delta":
        specific = {"kind": "full", "group": [token, token], "condemn": ["x"],
                    "add_runs": [{"event": "paused"}], "add_skipped": [{}]}  # fmt: skip
    else:
        specific = {"kind": "delta", "dtype": "bfloat17", "layers": [], "codec": {"name": "zstd"},
                    "columns": {"input_ids": "int33", "loss_mask": "uint8"}}  # fmt: skip
    for key, value in [*common.items(), *specific.items()]:
        yield {**copy.deepcopy(doc), key: value}
    if kind == "delta":
        yield {k: v for k, v in doc.items() if k != "kind"}  # then read as a full manifest
    segments = "add_segments" if kind == "delta" else "segments"
    for field, value in [("num_samples", 1.0), ("num_tokens", True), ("id", "A" * 32)]:
        edited = copy.deepcopy(doc)
        edited[segments][0][field] = value
        yield edited
    if kind == "delta":
        yield {**doc, "format_version": 4, "group": [token]}
        yield {**doc, "format_version": 3, "sample_digest": doc["sample_digest"]}
    else:
        yield {**doc, "layers": doc["layers"] * 1366}  # 4098 layers: more than maxItems
        yield {**doc, "layers": [{**doc["layers"][0], "depth": 1.0}]}


@pytest.mark.parametrize("kind", ["delta", "full"])
def test_whole_documents_get_jsonschemas_verdicts(dataset, kind):
    """Fuzzed real documents, delta and full: the fast verdict and path are jsonschema's."""
    from hsstore.spec import schema

    oracle = _strict(schema.schema())
    doc = _documents(dataset)[kind]
    assert schema._document_problem(doc) is None and oracle.is_valid(doc)
    for edited in _edits(kind, doc):
        problem = schema._document_problem(edited)
        assert problem is not None, edited
        _assert_agrees(problem, oracle, edited)

    @settings(max_examples=300, deadline=None, derandomize=True,
              suppress_health_check=[HealthCheck.too_slow])  # fmt: skip
    @given(mutated=st.one_of(mutations(doc), retyped(doc)))
    def check(mutated):
        _assert_agrees(schema._document_problem(mutated), oracle, mutated)

    check()
