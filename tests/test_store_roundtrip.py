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
from hsstore.dataset import batch_reads
from hsstore.spec.dtypes import storage_view
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


@pytest.mark.parametrize("codec", ["none", "blosc-zstd"])
def test_read_hidden_many_into_places_each_sample_at_its_row(tmp_path, codec):
    ds = hsstore.create(tmp_path / "ds", layers=_layers(3), hidden_size=16, dtype="bfloat16",
                        codec=codec)  # fmt: skip
    lengths = [5, 1, 9, 4]
    states = []
    for part in (lengths[:3], lengths[3:]):  # two segments
        with ds.writer() as w:
            for t in part:
                ids, mask, hid = random_sample(t, 3, 16, seed=len(states))
                w.add(f"s{len(states)}", ids, mask, hid)
                states.append(hid)
    ds = hsstore.open(tmp_path / "ds")
    out = torch.full((30, 3, 16), 7.0, dtype=torch.bfloat16)
    placed = [(3, 0), (0, 20), (-3, 25), (2, 10)]  # -3: sample 1, from the end
    assert batch_reads.read_hidden_many_into(ds, out, iter(placed)) == 4
    for i, row in placed:
        assert _bits(out[row : row + lengths[i]]) == _bits(states[i])
    untouched = torch.ones(30, dtype=torch.bool)
    for i, row in placed:
        untouched[row : row + lengths[i]] = False
    assert bool((out[untouched] == 7.0).all())  # nothing outside the placed rows
    picked = torch.empty(9, 2, 16, dtype=torch.bfloat16)
    assert batch_reads.read_hidden_many_into(ds, picked, [(2, 0)], layers=[2, 0]) == 1
    assert _bits(picked) == _bits(states[2][:, [2, 0]])
    with pytest.raises(hsstore.BadInputError, match="overruns"):
        batch_reads.read_hidden_many_into(ds, out, [(2, 22)])  # 9 tokens from row 22 of 30
    with pytest.raises(IndexError, match="sample 4 out of range"):
        batch_reads.read_hidden_many_into(ds, out, [(4, 0)])
    with pytest.raises(hsstore.BadInputError, match=r"out must be \[rows, 3, 16\]"):
        batch_reads.read_hidden_many_into(ds, out[:, :2], [(0, 0)])
    with pytest.raises(hsstore.BadInputError, match="contiguous CPU bfloat16"):
        batch_reads.read_hidden_many_into(ds, out.float(), [(0, 0)])


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


@pytest.mark.parametrize("codec", ["split-zstd", "blosc-zstd", "none"])
def test_zarr_python_opens_segments(tmp_path, codec):
    """The data stays standard Zarr v3: zarr-python reads the same bits hsstore wrote, at the
    rows the index gives (compressed datasets start each sample on a chunk boundary, padding
    with zeros)."""
    ds = hsstore.create(tmp_path / "ds", layers=_layers(2), hidden_size=40, dtype=torch.bfloat16,
                        layers_per_chunk=1, chunk_bytes=2048, shard_bytes=16384,
                        codec=codec)  # fmt: skip
    samples = [random_sample(t, 2, 40, seed=t) for t in (7, 300, 41)]
    with ds.writer() as w:
        for i, (ids, mask, hid) in enumerate(samples):
            w.add(f"s{i}", ids, mask, hid)
    ds = hsstore.open(tmp_path / "ds")
    info = ds.manifest.segments[0]
    group = zarr.open_group(str(tmp_path / "ds" / "segments" / info.id), mode="r")
    states = np.asarray(group["states"][:])
    rpc = ds.manifest.layout.rows_per_chunk  # 12 rows: 2048 bytes of one layer
    starts = [0, rpc, rpc + -(-300 // rpc) * rpc] if codec != "none" else [0, 7, 307]
    assert ds.index.column("row_offset").to_pylist() == starts
    assert states.dtype == np.uint16 and states.shape == (starts[-1] + 41, 2, 40)
    assert info.num_rows == states.shape[0] and info.num_tokens == 348
    ids = group["input_ids"][:]
    covered = np.zeros(states.shape[0], bool)
    for start, (sample_ids, _, hid) in zip(starts, samples, strict=True):
        n = hid.shape[0]
        assert np.array_equal(states[start : start + n], storage_view(hid))
        assert np.array_equal(ids[start : start + n], sample_ids.numpy())
        covered[start : start + n] = True
    assert not states[~covered].any() and not ids[~covered].any()  # the padding is zeros
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


def test_compressed_samples_never_share_a_chunk(tmp_path):
    """Sample-aligned layout: each sample owns whole chunks (a random read decodes nothing of
    its neighbours); the padding between samples is invisible to reads, stats and counts."""
    ds = hsstore.create(tmp_path / "ds", layers=_layers(2), hidden_size=48, dtype=torch.bfloat16)
    layout = ds.manifest.layout
    assert ds.manifest.codec.name == "split-zstd" and layout.sample_aligned
    rpc = layout.rows_per_chunk
    lengths = [1, rpc - 1, rpc, rpc + 1, 3 * rpc + 5, 2, 7 * rpc]
    samples = [random_sample(t, 2, 48, seed=k) for k, t in enumerate(lengths)]
    with ds.writer() as w:
        for k, (ids, mask, hid) in enumerate(samples):
            w.add(f"s{k}", ids, mask, hid)
    ds = hsstore.open(tmp_path / "ds")
    owner: dict[int, int] = {}
    for k, (start, n) in enumerate(
        zip(ds.index.column("row_offset").to_pylist(), ds.index.column("num_tokens").to_pylist())
    ):
        assert start % rpc == 0
        for chunk in range(start // rpc, (start + n - 1) // rpc + 1):
            assert owner.setdefault(chunk, k) == k, (
                f"chunk {chunk} holds samples {owner[chunk]}, {k}"
            )
    for k in np.random.default_rng(0).permutation(len(samples)):
        assert torch.equal(ds[int(k)].hidden.view(torch.int16), samples[k][2].view(torch.int16))
    assert ds.num_tokens == sum(lengths) < ds.manifest.segments[0].num_rows
    stats = ds.layer_stats()
    assert [s.rows for s in stats] == [sum(lengths)] * 2 and [s.zero_rows for s in stats] == [0, 0]
    assert hsstore.verify(tmp_path / "ds").ok


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.float8_e4m3fn])
def test_zarr_python_decodes_split_frames_of_every_dtype(tmp_path, dtype):
    """split-zstd frames (one stream per byte of the item; fp8 has one) are plain blosc: the
    zarr-python decode of every sample's rows equals what was written."""
    ds = hsstore.create(tmp_path / "ds", layers=_layers(2), hidden_size=40, dtype=dtype)
    written = []
    with ds.writer() as w:
        for k, t in enumerate((3, 70, 33)):
            ids, mask, hid = random_sample(t, 2, 40, seed=k, dtype=torch.float32)
            if dtype == torch.float8_e4m3fn:
                scales = torch.rand(t) + 0.5
                hid = (hid / 64).clamp(-448, 448).to(dtype)
                w.add(f"s{k}", ids, mask, hid, scales=scales)
            else:
                hid = hid.to(dtype)
                w.add(f"s{k}", ids, mask, hid)
            written.append(storage_view(hid))
    ds = hsstore.open(tmp_path / "ds")
    seg = ds.manifest.segments[0].id
    states = np.asarray(
        zarr.open_group(str(tmp_path / "ds" / "segments" / seg), mode="r")["states"][:]
    )
    for start, hid in zip(ds.index.column("row_offset").to_pylist(), written, strict=True):
        assert np.array_equal(states[start : start + len(hid)], hid)
