"""A batch's sample checksums in one call (`span_checksums`, the loader's checker): the digests
are xxhash's, spans are checked against their buffers, and a damaged sample is still named."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import xxhash

import hsstore
import hsstore.dataset.sample_checks
from hsstore import LayerSpec
from hsstore.dataset import batch_reads
from hsstore.errors import IntegrityError
from hsstore.spec import sample_index
from hsstore.spec.sample_index import span_checksums
from tools.synthetic import llm_like_states

compiled = pytest.mark.skipif(
    not sample_index.fast_hashing(),
    reason="the compiled digests are not in use (not built, or HSSTORE_NO_FAST_DECODE=1)",
)


@compiled
def test_the_digests_are_xxhash_s_for_any_spans():
    rng = np.random.default_rng(0)
    buffers = [rng.integers(0, 256, n, dtype=np.uint8) for n in (5000, 1, 300)]
    buffers.append(bytes(range(200)))  # any buffer, not only arrays
    for per in (1, 2, 4):
        spans = np.zeros((40, per, 3), np.int64)
        spans[:, :, 0] = rng.integers(0, len(buffers), (40, per))
        for k in range(40):
            for p in range(per):
                size = len(buffers[spans[k, p, 0]])
                at = int(rng.integers(0, size + 1))
                spans[k, p, 1:] = at, int(rng.integers(0, size - at + 1))  # empty spans too
        want = [
            xxhash.xxh3_64(b"".join(bytes(buffers[b])[a : a + n] for b, a, n in row)).intdigest()
            for row in spans.tolist()
        ]
        assert span_checksums(buffers, spans).tolist() == want


@pytest.mark.parametrize(
    "span",
    [(0, 90, 11), (0, -1, 2), (0, 3, -1), (1, 0, 1), (-1, 0, 1), (0, 101, 0)],
    ids=[
        "past the end",
        "negative offset",
        "negative length",
        "no such buffer",
        "negative buffer",
        "offset past the end",
    ],  # fmt: skip
)
@compiled
def test_a_span_outside_its_buffer_is_refused(span):
    with pytest.raises(ValueError, match="outside its buffer"):
        span_checksums([bytes(100)], np.array([[[0, 0, 100], span]], np.int64))


def _dataset(tmp_path, tier=None):
    ds = hsstore.create(tmp_path / "ds", layers=[LayerSpec(1), LayerSpec(2)], hidden_size=64,
                        dtype="bf16", model={"num_hidden_layers": 2}, tier=tier)  # fmt: skip
    g = torch.Generator().manual_seed(3)
    with ds.writer(segment_bytes=40_000) as w:  # several segments: columns of each in a batch
        for k in range(12):
            t = int(torch.randint(3, 60, (1,), generator=g))
            ids = torch.randint(0, 999, (t,), generator=g)
            w.add(f"s{k}", ids, torch.ones(t).long(), llm_like_states(t, 2, 64, seed=k))
    return hsstore.open(tmp_path / "ds")


def _batch(ds):
    """Every sample read into one batch, its checksums left to `check_decoded`."""
    rows = sum(ds.num_tokens_of(i) for i in range(len(ds)))
    out = torch.empty(rows, 2, 64, dtype=ds.manifest.torch_dtype)
    placed, at = [], 0
    for i in reversed(range(len(ds))):  # not in storage order
        placed.append((i, at))
        at += ds.num_tokens_of(i)
    unchecked: list[tuple[int, int]] = []
    assert batch_reads.read_hidden_many_into(ds, out, placed, unchecked=unchecked) == len(ds)
    return out, unchecked


@compiled
@pytest.mark.parametrize("tier", [None, "fp8-token"])
def test_a_clean_batch_is_checked_in_one_call(tmp_path, tier, monkeypatch):
    ds = _dataset(tmp_path, tier)
    assert len(ds.manifest.segments) > 1
    out, unchecked = _batch(ds)

    def per_sample(*_args):
        raise AssertionError("a sample hashed on its own")

    monkeypatch.setattr(hsstore.dataset.sample_checks.xxhash, "xxh3_64", per_sample)
    batch_reads.check_decoded(ds, out, unchecked)


@pytest.mark.parametrize("one_call", [True, False])
@pytest.mark.parametrize("tier", [None, "fp8-token"])
def test_a_damaged_sample_of_a_batch_is_named(tmp_path, tier, one_call, monkeypatch):
    ds = _dataset(tmp_path, tier)
    if not one_call:  # the portable path: sample by sample through xxhash
        monkeypatch.setenv("HSSTORE_NO_FAST_DECODE", "1")
    out, unchecked = _batch(ds)
    rows = out.view(out.shape[0], -1).view(torch.uint8)
    for i, first in unchecked[7], unchecked[3]:  # two damaged: the first checked is named
        rows[first + ds.num_tokens_of(i) - 1, -1] ^= 0x10
    with pytest.raises(IntegrityError, match="sample checksum mismatch") as caught:
        batch_reads.check_decoded(ds, out, unchecked)
    assert caught.value.sample_id == ds.sample_ids[unchecked[3][0]]
