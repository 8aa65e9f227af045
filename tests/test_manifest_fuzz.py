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


def _segment_entry() -> dict:
    files = {"index.parquet": {"size": 2505, "crc32c": 4000305987}, "states/c/0/0/0": {"size": 9}}
    return {"id": "a" * 32, "num_samples": 2, "num_tokens": 40, "num_shards": 1,
            "committed_at": "2026-01-01T00:00:00.000+00:00", "files": files}  # fmt: skip


@settings(max_examples=400, deadline=None, derandomize=True)
@given(mutated=mutations(_segment_entry()))
def test_fast_segment_check_agrees_with_the_schema(mutated):
    """The segment check is the schema's $defs/segment, rule for rule."""
    import jsonschema

    from hsstore.spec import schema

    root = schema.schema()
    rules = {**root["$defs"]["segment"], "$defs": root["$defs"]}
    strict = jsonschema.validators.extend(
        jsonschema.Draft202012Validator,
        type_checker=jsonschema.Draft202012Validator.TYPE_CHECKER.redefine(
            "integer", lambda _, x: type(x) is int
        ),
    )(rules)
    assert schema._check_segment(_segment_entry()) is None
    assert (schema._check_segment(mutated) is None) == strict.is_valid(mutated), mutated


# Rules the segment entry does not use today, so that a schema change using them is covered.
_OTHER_RULES = {
    "type": "object",
    "required": ["a"],
    "maxProperties": 3,
    "properties": {
        "a": {"type": ["number", "null"], "minimum": -1.5, "maximum": 7},
        "b": {"type": "boolean"},
        "c": {"type": "array"},
        "d": {"pattern": "^x+$"},
    },
    "additionalProperties": {"type": "string", "maxProperties": 1},
}


@settings(max_examples=300, deadline=None, derandomize=True)
@given(doc=st.dictionaries(st.sampled_from(["a", "b", "c", "d", "e"]), json_values, max_size=4))
def test_compiled_rules_agree_with_jsonschema_on_every_keyword_they_implement(doc):
    import jsonschema

    from hsstore.spec.schema import compile_rule

    strict = jsonschema.validators.extend(
        jsonschema.Draft202012Validator,
        type_checker=jsonschema.Draft202012Validator.TYPE_CHECKER.redefine(
            "integer", lambda _, x: type(x) is int
        ),
    )(_OTHER_RULES)
    assert (compile_rule(_OTHER_RULES)(doc) is None) == strict.is_valid(doc), doc


def test_a_keyword_the_compiled_rules_lack_is_refused():
    from hsstore.errors import SchemaError
    from hsstore.spec.schema import compile_rule

    rule = {"type": "object", "properties": {"at": {"type": "string", "format": "date-time"}}}
    with pytest.raises(SchemaError, match="format"):
        compile_rule(rule)
