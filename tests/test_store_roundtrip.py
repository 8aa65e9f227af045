"""Write then read is bit-identical, for every dtype, codec, length and shape."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import zarr
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import hsstore
from hsstore import LayerSpec
from hsstore.dataset import storage_view
from tools.synthetic import llm_like_states, random_sample

DTYPES = [torch.bfloat16, torch.float16, torch.float32]


def _bits(t: torch.Tensor) -> bytes:
    return t.contiguous().view(torch.uint8).numpy().tobytes()


def _layers(n: int) -> list[LayerSpec]:
    return [LayerSpec(depth=k + 1) for k in range(n)]


@pytest.mark.parametrize("codec", ["blosc-zstd", "none"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_roundtrip_lengths_1_to_8192(tmp_path, codec, dtype):
    ds = hsstore.create(
        tmp_path / "ds", layers=_layers(3), hidden_size=48, dtype=dtype, codec=codec
    )
    lengths = [1, 2, 3, 17, 1000, 8192]
    written = []
    with ds.writer() as w:
        for i, t in enumerate(lengths):
            ids, mask, hid = random_sample(t, 3, 48, seed=i, dtype=dtype)
            w.add(f"s{i}", ids, mask, hid)
            written.append((ids, mask, hid))
    ds = hsstore.open(tmp_path / "ds")
    assert len(ds) == len(lengths) and ds.num_tokens == sum(lengths)
    for i, (ids, mask, hid) in enumerate(written):
        s = ds[i]
        assert s.sample_id == f"s{i}"
        assert s.hidden.dtype == dtype and s.hidden.shape == hid.shape
        assert _bits(s.hidden) == _bits(hid)
        assert torch.equal(s.input_ids, ids) and s.input_ids.dtype == torch.int64
        assert torch.equal(s.loss_mask, mask)


@settings(
    max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    layers=st.integers(1, 5),
    hidden=st.integers(1, 70),
    lengths=st.lists(st.integers(1, 300), min_size=1, max_size=6),
    dtype=st.sampled_from(DTYPES),
    codec=st.sampled_from(["blosc-zstd", "none"]),
    split_layers=st.booleans(),
    chunk_bytes=st.sampled_from([256, 4096, 1 << 20]),
)
def test_roundtrip_property(
    tmp_path_factory, layers, hidden, lengths, dtype, codec, split_layers, chunk_bytes
):
    path = tmp_path_factory.mktemp("prop") / "ds"
    lpc = 1 if split_layers else None
    ds = hsstore.create(path, layers=_layers(layers), hidden_size=hidden, dtype=dtype, codec=codec,
                        layers_per_chunk=lpc, chunk_bytes=chunk_bytes, shard_bytes=chunk_bytes * 4)  # fmt: skip
    data = [llm_like_states(t, layers, hidden, dtype=dtype, seed=i) for i, t in enumerate(lengths)]
    with ds.writer() as w:
        for i, h in enumerate(data):
            w.add(f"id-{i}", torch.arange(h.shape[0]), torch.ones(h.shape[0], dtype=torch.long), h)
    ds = hsstore.open(path)
    for i, h in enumerate(data):
        assert _bits(ds[i].hidden) == _bits(h)
        pick = [layers - 1, 0] if layers > 1 else [0]
        assert _bits(ds.read(i, layers=pick).hidden) == _bits(h[:, pick])


def test_read_into_reuses_caller_buffer(tmp_path):
    ds = hsstore.create(tmp_path / "ds", layers=_layers(2), hidden_size=32, dtype=torch.bfloat16)
    ids, mask, hid = random_sample(50, 2, 32)
    with ds.writer() as w:
        w.add("a", ids, mask, hid)
    ds = hsstore.open(tmp_path / "ds")
    out = torch.empty(50, 2, 32, dtype=torch.bfloat16)
    ptr = out.data_ptr()
    got = ds.read_hidden_into(0, out)
    assert got.data_ptr() == ptr and _bits(got) == _bits(hid)
    with pytest.raises(hsstore.BadInputError, match="shape"):
        ds.read_hidden_into(0, torch.empty(49, 2, 32, dtype=torch.bfloat16))


def test_read_tokens_many_is_the_per_sample_heads_back_to_back(tmp_path):
    ds = hsstore.create(tmp_path / "ds", layers=_layers(1), hidden_size=8, dtype="bfloat16")
    lengths = [5, 1, 9, 4, 7, 3]
    k = 0
    for part in (lengths[:2], lengths[2:5], lengths[5:]):  # three segments
        with ds.writer() as w:
            for t in part:
                ids, mask, hid = random_sample(t, 1, 8, seed=k)
                w.add(f"s{k}", ids, mask, hid)
                k += 1
    ds = hsstore.open(tmp_path / "ds")
    assert len(ds) == len(lengths) and len(ds.manifest.segments) == 3
    positions = [4, 0, 5, 2, -1, 1]
    takes = [7, 2, 0, 9, 3, 1]
    ids, mask = ds.read_tokens_many(positions, takes)
    heads = [ds.read_tokens(i) for i in positions]
    assert ids.dtype == mask.dtype == torch.int64
    assert torch.equal(ids, torch.cat([h[0][:k] for h, k in zip(heads, takes)]))
    assert torch.equal(mask, torch.cat([h[1][:k] for h, k in zip(heads, takes)]))
    ids, mask = ds.read_tokens_many([3, 2], [2, 9])  # one segment
    assert torch.equal(ids, torch.cat([ds.read_tokens(3)[0][:2], ds.read_tokens(2)[0]]))
    assert torch.equal(mask, torch.cat([ds.read_tokens(3)[1][:2], ds.read_tokens(2)[1]]))
    with pytest.raises(IndexError, match="sample 6 out of range"):
        ds.read_tokens_many([0, 6], [1, 1])
    with pytest.raises(ValueError, match="cannot take 5 tokens of sample 's1'"):
        ds.read_tokens_many([1], [5])


def test_get_by_id_contains_and_iteration(tmp_path):
    ds = hsstore.create(tmp_path / "ds", layers=_layers(1), hidden_size=8, dtype="float16")
    with ds.writer() as w:
        for i in range(5):
            ids, mask, hid = random_sample(3 + i, 1, 8, seed=i, dtype=torch.float16)
            w.add(f"k{i}", ids, mask, hid)
    ds = hsstore.open(tmp_path / "ds")
    assert "k3" in ds and "nope" not in ds
    assert ds.get("k3").num_tokens == 6
    assert [s.sample_id for s in ds] == [f"k{i}" for i in range(5)]
    with pytest.raises(KeyError):
        ds.get("nope")
    with pytest.raises(IndexError):
        ds[5]


def test_zarr_python_opens_segments(tmp_path):
    """The data stays standard Zarr v3: zarr-python reads the same bits hsstore wrote."""
    ds = hsstore.create(tmp_path / "ds", layers=_layers(2), hidden_size=40, dtype=torch.bfloat16,
                        layers_per_chunk=1, chunk_bytes=2048, shard_bytes=16384)  # fmt: skip
    samples = [random_sample(t, 2, 40, seed=t) for t in (7, 300, 41)]
    with ds.writer() as w:
        for i, (ids, mask, hid) in enumerate(samples):
            w.add(f"s{i}", ids, mask, hid)
    ds = hsstore.open(tmp_path / "ds")
    seg = ds.manifest.segments[0].id
    group = zarr.open_group(str(tmp_path / "ds" / "segments" / seg), mode="r")
    states = np.asarray(group["states"][:])
    assert states.dtype == np.uint16 and states.shape == (348, 2, 40)
    expected = np.concatenate([storage_view(h) for _, _, h in samples])
    assert np.array_equal(states, expected)
    assert np.array_equal(group["input_ids"][:], np.concatenate([i.numpy() for i, _, _ in samples]))
    assert group["states"].attrs["hsstore"]["logical_dtype"] == "bfloat16"


def test_layer_stats_recorded_at_write(tmp_path):
    ds = hsstore.create(tmp_path / "ds", layers=_layers(3), hidden_size=64, dtype=torch.float32)
    hid = llm_like_states(400, 3, 64, dtype=torch.float32)
    hid[10, 1] = 0.0
    hid[20, 2, 5] = float("nan")
    with ds.writer() as w:
        w.add("x", torch.zeros(400, dtype=torch.long), torch.ones(400, dtype=torch.long), hid)
    ds = hsstore.open(tmp_path / "ds")
    stats = ds.layer_stats()
    assert [s.rows for s in stats] == [400, 400, 400]
    assert [s.zero_rows for s in stats] == [0, 1, 0]
    assert [s.nonfinite_rows for s in stats] == [0, 0, 1]
    finite = hid[:, 0]
    assert (
        abs(stats[0].rms - float(finite.pow(2).mean().sqrt())) / float(finite.pow(2).mean().sqrt())
        < 0.2
    )
    row = ds.index.to_pylist()[0]
    assert row["zero_rows"] == 1 and row["nonfinite_rows"] == 1
