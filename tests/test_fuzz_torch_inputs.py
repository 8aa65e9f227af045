"""Fuzzing the torch.save inputs convert and inspect read (v1 ``.pt``, SpecForge ``.ckpt[.gz]``).

Whatever the bytes or the structure, reading a file ends in one of two ways: a BadInputError
that names the file, or exactly the numbers that were saved. Never another exception, never a
hang (each example has a deadline), never different numbers.
"""

from __future__ import annotations

import gzip
import io
import json
import struct
import tempfile
import zipfile
from pathlib import Path

import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hsstore.errors import BadInputError
from hsstore.interop.formats.specforge import SpecForgeReader
from hsstore.interop.formats.speculators_v1 import SpeculatorsV1Reader
from tools.convert_fixtures import v1_data_config, v1_sample

LAYER_IDS = [1, 3]
NUM_HIDDEN_LAYERS = 4
FUZZ = settings(
    max_examples=80,
    deadline=10_000,  # ms; a hang fails the example instead of stalling CI
    database=None,
    derandomize=True,  # the same examples on every run, so CI is reproducible
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)

shapes = st.tuples(
    st.integers(1, 12),  # tokens
    st.integers(1, 16),  # hidden size
    st.sampled_from([torch.bfloat16, torch.float16, torch.float32]),
    st.integers(0, 1000),  # seed
)

# One damage applied to the saved bytes: positions are taken modulo the file length, or, for
# "member", modulo the stored bytes of one zip member (most of a small file is zip headers and
# alignment padding, so damage aimed at random would rarely touch tensor data or the pickle).
byte_damage = st.one_of(
    st.tuples(st.just("none")),
    st.tuples(st.just("member"), st.integers(0, 2**31), st.integers(0, 2**31), st.integers(0, 7)),
    st.tuples(st.just("flip"), st.integers(0, 2**31), st.integers(0, 7)),
    st.tuples(st.just("truncate"), st.integers(0, 2**31)),
    st.tuples(st.just("overwrite"), st.integers(0, 2**31), st.binary(min_size=1, max_size=16)),
    st.tuples(st.just("insert"), st.integers(0, 2**31), st.binary(min_size=1, max_size=16)),
)


def member_spans(raw: bytes) -> list[tuple[int, int]]:
    """(start, size) of each zip member's stored bytes in a torch.save archive."""
    spans = []
    with zipfile.ZipFile(io.BytesIO(raw)) as zf:
        for info in zf.infolist():
            name_len, extra_len = struct.unpack_from("<HH", raw, info.header_offset + 26)
            spans.append((info.header_offset + 30 + name_len + extra_len, info.compress_size))
    return [(start, size) for start, size in spans if size > 0]


def damage(raw: bytes, how: tuple) -> bytes:
    kind, *args = how
    if kind == "none" or not raw:
        return raw
    if kind == "member":
        spans = member_spans(raw)
        start, size = spans[args[0] % len(spans)]
        out = bytearray(raw)
        out[start + args[1] % size] ^= 1 << args[2]
        return bytes(out)
    at = args[0] % len(raw)
    if kind == "flip":
        out = bytearray(raw)
        out[at] ^= 1 << args[1]
        return bytes(out)
    if kind == "truncate":
        return raw[:at]
    if kind == "overwrite":
        return raw[:at] + args[1] + raw[at + len(args[1]) :]
    return raw[:at] + args[1] + raw[at:]


def saved(obj: object) -> bytes:
    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    if a.dtype.is_floating_point:
        ints = {2: torch.int16, 4: torch.int32}[a.element_size()]
        return torch.equal(a.contiguous().view(ints), b.contiguous().view(ints))
    return torch.equal(a, b)


def read_v1(raw: bytes, hidden_size: int):
    """Write ``raw`` as data_0.pt of a v1 folder and read it: (item, error) and the file path."""
    with tempfile.TemporaryDirectory() as d:
        src = Path(d)
        (src / "data_0.pt").write_bytes(raw)
        cfg = v1_data_config(LAYER_IDS, hidden_size, 1)
        (src / "data_config.json").write_text(json.dumps(cfg))
        try:
            return SpeculatorsV1Reader(src).read(0), None, src
        except BadInputError as exc:
            return None, exc, src


def check_v1_outcome(raw: bytes, sample: dict, hidden_size: int) -> None:
    item, err, src = read_v1(raw, hidden_size)
    if err is not None:
        assert str(src) in str(err) and "\n" not in str(err)
        return
    assert same_bits(item.input_ids, sample["input_ids"])
    assert same_bits(item.loss_mask, sample["loss_mask"])
    for k, layer in enumerate(sample["hidden_states"]):
        assert same_bits(item.hidden[:, k], layer)


@FUZZ
@given(shapes, byte_damage)
def test_damaged_v1_files_fail_cleanly_or_read_exactly(shape, how):
    t, h, dtype, seed = shape
    sample = v1_sample(t, len(LAYER_IDS), h, dtype, seed)
    check_v1_outcome(damage(saved(sample), how), sample, h)


def _restructure(sample: dict, how: str) -> object:
    """The same sample with its structure changed the ways producers and attackers change it."""
    s = dict(sample)
    layers = list(sample["hidden_states"])
    if how == "tuple-of-layers":
        s["hidden_states"] = tuple(layers)
    elif how == "zero-width":
        s["hidden_states"] = [x[:, :0] for x in layers]
    elif how == "zero-tokens":
        s = {k: (v[:0] if k != "hidden_states" else [x[:0] for x in v]) for k, v in s.items()}
    elif how == "nested-lists":
        deep: list = layers
        for _ in range(500):  # torch.save itself recurses, so not much deeper
            deep = [deep]
        s["hidden_states"] = deep
    elif how == "int-states":
        s["hidden_states"] = [x.to(torch.int32) for x in layers]
    elif how == "ids-2d":
        s["input_ids"] = s["input_ids"][None]
    elif how == "huge-id":
        s["input_ids"] = s["input_ids"].clone()
        s["input_ids"][0] = 2**40
    elif how == "layers-as-dict":
        s["hidden_states"] = dict(enumerate(layers))
    elif how == "extra-layer":
        s["hidden_states"] = [*layers, layers[0]]
    elif how == "strided-view":
        s["hidden_states"] = [torch.stack([x, x], dim=1)[:, 0] for x in layers]
    elif how == "not-a-dict":
        return list(sample.values())
    return s


@FUZZ
@given(
    shapes,
    st.sampled_from(
        [
            "tuple-of-layers",
            "zero-width",
            "zero-tokens",
            "nested-lists",
            "int-states",
            "ids-2d",
            "huge-id",
            "layers-as-dict",
            "extra-layer",
            "strided-view",
            "not-a-dict",
        ]
    ),
)
def test_restructured_v1_files_fail_cleanly_or_read_exactly(shape, how):
    t, h, dtype, seed = shape
    sample = v1_sample(t, len(LAYER_IDS), h, dtype, seed)
    check_v1_outcome(saved(_restructure(sample, how)), sample, h)


def specforge_record(t: int, h: int, dtype: torch.dtype, seed: int) -> dict:
    sample = v1_sample(t, len(LAYER_IDS) + 1, h, dtype, seed)
    layers = sample["hidden_states"]
    aux = torch.cat(layers[:-1], dim=1)
    return {
        "input_ids": sample["input_ids"][None],
        "loss_mask": sample["loss_mask"][None],
        "hidden_state": layers[-1][None].clone(),
        "aux_hidden_state": aux[None].clone(),
        "layers": layers,
    }


@FUZZ
@given(shapes, byte_damage, st.booleans(), st.booleans())
def test_damaged_specforge_files_fail_cleanly_or_read_exactly(shape, how, gz, damage_inside):
    t, h, dtype, seed = shape
    rec = specforge_record(t, h, dtype, seed)
    raw = saved({k: v for k, v in rec.items() if k != "layers"})
    if gz:
        # Damage either the torch archive before compressing or the gzip stream itself.
        inside = damage_inside or how[0] == "member"
        raw = gzip.compress(damage(raw, how) if inside else raw, compresslevel=1)
        raw = raw if inside else damage(raw, how)
    else:
        raw = damage(raw, how)
    with tempfile.TemporaryDirectory() as d:
        src = Path(d)
        path = src / ("data_0.ckpt.gz" if gz else "data_0.ckpt")
        path.write_bytes(raw)
        try:
            reader = SpecForgeReader(src, layer_ids=LAYER_IDS, num_hidden_layers=NUM_HIDDEN_LAYERS)
            item = reader.read(0)
        except BadInputError as exc:
            assert str(src) in str(exc) and "\n" not in str(exc)
            return
    assert same_bits(item.input_ids, rec["input_ids"][0])
    assert same_bits(item.loss_mask, rec["loss_mask"][0])
    for k, layer in enumerate(rec["layers"]):
        assert same_bits(item.hidden[:, k], layer)
