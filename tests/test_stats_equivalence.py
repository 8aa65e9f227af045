"""The write-time statistics pass: its buffer-reusing code gives the same stats.json, bit for bit,
as the plain reference formulation kept here, on inputs full of NaN, Inf, zeros and -0.0; and the
writer's compiled passes write the same bytes as its portable path."""

from __future__ import annotations

import io
import json
import math
import warnings

import numpy as np
import pyarrow.parquet as pq
import pytest
import torch

import hsstore
from hsstore import LayerSpec
from hsstore.segment.stats import (
    _BITS,
    HIST_BINS,
    HIST_MAX_EXP,
    HIST_MIN_EXP,
    LayerStats,
    StatsAccumulator,
    magnitude_dtype,
    row_absmax,
    widen,
)
from hsstore.spec import paths
from hsstore.spec.sample_index import RowHasher, finish_checksum, sample_checksum
from tools.synthetic import llm_like_states


class ReferenceStats:
    """The straightforward formulation: fresh tensors per sample, one bincount per layer."""

    def __init__(self, num_layers: int, dtype_name: str, sample_every: int = 8):
        self.layers = [LayerStats() for _ in range(num_layers)]
        self.sample_every = sample_every
        self.dtype_name = dtype_name
        self.phase = 0

    @np.errstate(invalid="ignore", over="ignore")  # NaN/Inf rows, dropped below
    def update(self, stored: np.ndarray) -> tuple[int, int]:
        idtype, abs_mask, nonfinite_at, mantissa, bias = _BITS[self.dtype_name]
        bits = stored.view(idtype)
        t, _n_layers, hidden = bits.shape
        rowmax = np.bitwise_and(bits, abs_mask).max(axis=-1)
        nonfinite = rowmax >= nonfinite_at
        zero = rowmax == 0
        good = ~nonfinite & ~zero
        exps = (rowmax >> mantissa).astype(np.int64) - bias
        bins = np.clip(exps, HIST_MIN_EXP, HIST_MAX_EXP) - HIST_MIN_EXP
        start = (-self.phase) % self.sample_every
        self.phase = (self.phase + t) % self.sample_every
        ok = ~nonfinite[start :: self.sample_every]
        picked = stored[start :: self.sample_every]
        if self.dtype_name == "bfloat16":  # through torch's own widening: an independent path
            values = torch.from_numpy(picked.view(np.int16)).view(torch.bfloat16).float().numpy()
        else:
            values = picked.astype(np.float32)
        okf = ok.astype(np.float64)
        counts = (ok.sum(0) * hidden).tolist()
        sums = (np.nan_to_num(values.sum(axis=-1).astype(np.float64)) * okf).sum(0).tolist()
        sumsqs = (np.nan_to_num((values * values).sum(axis=-1).astype(np.float64)) * okf).sum(0)
        sumsqs = sumsqs.tolist()
        mins = np.where(ok, values.min(axis=-1), np.inf).min(axis=0).tolist() if ok.size else []
        maxs = np.where(ok, values.max(axis=-1), -np.inf).max(axis=0).tolist() if ok.size else []
        for layer, st in enumerate(self.layers):
            st.rows += t
            st.zero_rows += int(zero[:, layer].sum())
            st.nonfinite_rows += int(nonfinite[:, layer].sum())
            hist = np.bincount(bins[good[:, layer], layer], minlength=HIST_BINS)
            st.rowmax_hist = [a + int(b) for a, b in zip(st.rowmax_hist, hist)]
            if counts[layer]:
                st.sampled_values += int(counts[layer])
                st.sum += sums[layer]
                st.sumsq += sumsqs[layer]
                st.min = min(st.min, mins[layer])
                st.max = max(st.max, maxs[layer])
        return int(zero.any(axis=1).sum()), int(nonfinite.any(axis=1).sum())

    def to_json(self) -> dict:
        return {"sample_every": self.sample_every, "layers": [s.to_json() for s in self.layers]}


def hostile_sample(g: torch.Generator, t: int, dtype: torch.dtype) -> torch.Tensor:
    """LLM-like states: whole zero, -0.0, negative-only and positive-only rows, scattered +-NaN,
    +-Inf and -0.0, huge and tiny values."""
    x = llm_like_states(
        t, 3, 96, dtype=torch.float32, seed=int(torch.randint(0, 1 << 30, (1,), generator=g))
    )
    x *= torch.exp2(torch.randint(-30, 30, (t, 3, 1), generator=g).float())
    pick = torch.rand(t, 3, generator=g)
    x[pick > 0.9] = -x[pick > 0.9].abs()  # rows of negative values only
    x[pick > 0.97] = x[pick > 0.97].abs()  # and of positive values only
    x[pick < 0.08] = 0.0
    x[(pick >= 0.08) & (pick < 0.12)] = -0.0
    cells = torch.rand(t, 3, 96, generator=g)
    x[cells < 0.002] = float("nan")
    x[(cells >= 0.002) & (cells < 0.003)] = float("inf")
    x[(cells >= 0.003) & (cells < 0.004)] = -float("inf")
    x[(cells >= 0.004) & (cells < 0.01)] = -0.0
    x[(cells >= 0.01) & (cells < 0.011)] = -float("nan")  # sign bit set
    return x.to(dtype)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_stats_equal_the_reference_bit_for_bit(dtype):
    name = str(dtype).removeprefix("torch.")
    g = torch.Generator().manual_seed(15)
    ours, ref = StatsAccumulator(3, name), ReferenceStats(3, name)
    lengths = [1, 7, 0, 300, 5, 64, 1000, 3, 9]
    saw_nonfinite = saw_zero = 0
    for t in lengths:
        stored = hostile_sample(g, t, dtype).numpy() if dtype != torch.bfloat16 else (
            hostile_sample(g, t, dtype).view(torch.int16).numpy()
        )  # fmt: skip
        with warnings.catch_warnings():  # NaN and Inf are counted, not warned about
            warnings.simplefilter("error")
            flags = ours.update(stored)
        want_zero, want_nonfinite = ref.update(stored)
        assert (flags.zero_rows, flags.nonfinite_rows) == (want_zero, want_nonfinite), t
        saw_zero += want_zero
        saw_nonfinite += want_nonfinite
    assert saw_zero and saw_nonfinite  # the inputs really exercise both paths
    assert json.dumps(ours.to_json()) == json.dumps(ref.to_json())
    layers = ours.to_json()["layers"]
    assert all(math.isfinite(s["sum"]) and s["sampled_values"] > 0 for s in layers)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_block_stats_equal_per_sample_stats(dtype):
    """The writer counts a whole shard at once (padding rows between samples left out): the
    same counts, histogram, extremes and sampled rows as sample by sample; sums differ only in
    the order of float64 additions."""
    name = str(dtype).removeprefix("torch.")
    g = torch.Generator().manual_seed(7)
    per_sample, ref = StatsAccumulator(3, name), ReferenceStats(3, name)
    lengths = [1, 7, 300, 5, 64, 1000, 3, 9]
    samples = []
    for t in lengths:
        x = hostile_sample(g, t, dtype)
        samples.append((x.view(torch.int16) if dtype == torch.bfloat16 else x).numpy())
    flags = [per_sample.update(s) for s in samples]
    for s in samples:
        ref.update(s)
    # Two "shards": samples with zero padding rows between them, split mid-sample.
    pad = np.zeros((5, 3, 96), samples[0].dtype)
    rows = np.concatenate([part for s in samples for part in (s, pad)])
    real = np.concatenate([np.repeat([True, False], [len(s), len(pad)]) for s in samples])
    block = StatsAccumulator(3, name)
    cut = 700
    pieces = [
        block.update_block(rows[:cut], real[:cut]),
        block.update_block(rows[cut:], real[cut:]),
    ]
    zero = np.concatenate([z for z, _ in pieces])[real]
    nonfinite = np.concatenate([n for _, n in pieces])[real]
    at = 0
    for t, f in zip(lengths, flags, strict=True):
        assert (int(zero[at : at + t].sum()), int(nonfinite[at : at + t].sum())) == (
            f.zero_rows,
            f.nonfinite_rows,
        )
        at += t
    for got, want in zip(block.to_json()["layers"], ref.to_json()["layers"], strict=True):
        for key in ("rows", "zero_rows", "nonfinite_rows", "sampled_values", "min", "max",
                    "rowmax_hist"):  # fmt: skip
            assert got[key] == want[key], key
        assert got["sum"] == pytest.approx(want["sum"], rel=1e-12)
        assert got["sumsq"] == pytest.approx(want["sumsq"], rel=1e-12)


@pytest.mark.skipif(
    not RowHasher.available(),
    reason="the compiled pass is not in use (not built, or HSSTORE_NO_FAST_DECODE=1)",
)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_rows_copied_in_one_pass_are_copied_hashed_and_measured_exactly(dtype):
    """The writer's compiled pass: the copy, the checksum, each row's magnitude bits and the
    sampled rows' floats are those of a plain copy, xxhash, `row_absmax` and `widen`, over
    pieces of samples of any length."""
    name = str(dtype).removeprefix("torch.")
    g = torch.Generator().manual_seed(3)
    hasher = RowHasher()
    for t in (1, 7, 300, 64):
        x = hostile_sample(g, t, dtype)
        stored = (x.view(torch.int16) if dtype == torch.bfloat16 else x).numpy()
        dst = np.full_like(stored, 7)
        rowmax = np.full(stored.shape[:2], -1, magnitude_dtype(name))
        hasher.reset()
        cut = t // 3
        hasher.copy_rows(stored[:cut], dst[:cut], rowmax[:cut])
        widens = dtype != torch.float16  # the pass widens bf16 and float32 rows
        every, first = 3, 1
        floats = np.full((len(range(first, t - cut, every)), 3, 96), 7.0, np.float32)
        hasher.copy_rows(stored[cut:], dst[cut:], rowmax[cut:],
                         *((floats, first, every) if widens else ()))  # fmt: skip
        ids, mask = np.arange(t, dtype="<i4"), np.ones(t, "<u1")
        assert np.array_equal(dst.view(np.uint8), stored.view(np.uint8))
        assert np.array_equal(rowmax, row_absmax(stored, name))
        assert finish_checksum(hasher, ids, mask) == sample_checksum(stored, ids, mask)
        if widens:
            want = stored[cut:][first::every]
            want = widen(want, name, np.empty(want.shape, np.float32))
            assert np.array_equal(floats.view(np.uint32), want.view(np.uint32))
    with pytest.raises(ValueError, match="overlap"):
        hasher.copy_rows(stored, stored, rowmax)


def _write_hostile(path, dtype: torch.dtype, aligned: bool) -> dict[str, bytes]:
    """A dataset of hostile samples over several shards: its segment's files by name (those
    that name the segment's random id left out), the index without its ids."""
    g = torch.Generator().manual_seed(11)
    ds = hsstore.create(path, layers=[LayerSpec(k + 1) for k in range(3)], hidden_size=96,
                        dtype=dtype, chunk_bytes=16 << 10, shard_bytes=64 << 10,
                        sample_aligned=aligned)  # fmt: skip
    with ds.writer() as w:
        for i, t in enumerate([1, 7, 300, 5, 64, 1000, 3, 9]):
            ids = torch.randint(0, 1000, (t,), generator=g)
            w.add(f"s{i}", ids, torch.ones(t, dtype=torch.long), hostile_sample(g, t, dtype))
    (seg,) = hsstore.open(path).manifest.segments
    files = {rel: (path / "segments" / seg.id / rel).read_bytes() for rel in seg.files}
    index = pq.read_table(io.BytesIO(files.pop(paths.INDEX))).drop_columns(["sample_id"])
    files.pop(paths.INDEX_COPY, None)
    files.pop("zarr.json")
    return {**files, "index": repr(index.to_pydict()).encode()}


@pytest.mark.parametrize(
    ("dtype", "aligned"),
    [(torch.bfloat16, True), (torch.bfloat16, False), (torch.float16, True), (torch.float32, True)],
)
def test_compiled_and_portable_writers_write_the_same_bytes(tmp_path, monkeypatch, dtype, aligned):
    """States, statistics, columns and index checksums: the same whether the writer copies,
    hashes, measures and splits byte planes in compiled passes or in numpy and xxhash."""
    compiled = _write_hostile(tmp_path / "compiled", dtype, aligned)
    monkeypatch.setenv("HSSTORE_NO_FAST_DECODE", "1")
    assert not RowHasher.available()
    portable = _write_hostile(tmp_path / "portable", dtype, aligned)
    assert sum(rel.startswith(paths.STATES + "/c/") for rel in compiled) >= 3
    assert compiled.keys() == portable.keys()
    for rel in compiled:
        assert compiled[rel] == portable[rel], rel
