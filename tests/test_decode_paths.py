"""The loader's decode paths (`LoaderOptions.decode_path`): inline (every decode thread hashes
what it decodes) and pipelined (a checker thread beside the decoders and, with one decode
thread, the chunk pipeline) run on any machine when asked for, and yield the same batches;
"auto" resolves from the core count in one place."""

from __future__ import annotations

import threading

import pytest
import torch

import hsstore
from hsstore.cores import usable_cores
from hsstore.loader import Loader
from hsstore.loader.decode_paths import resolve_decode_path
from tests.test_batch_reads import _dataset as uncompressed_dataset
from tests.test_chunk_pipeline import _dataset as compressed_dataset


@pytest.fixture(scope="module", params=["compressed", "uncompressed"])
def dataset(request, tmp_path_factory) -> str:
    """Samples spanning several chunks (and, uncompressed, several segments and shards)."""
    make = compressed_dataset if request.param == "compressed" else uncompressed_dataset
    return make(tmp_path_factory.mktemp("paths") / "ds").path


def _epoch(path: str, decode_path: str, num_threads: int) -> tuple[list[dict], set[str]]:
    """One epoch's batches (copied: the loader reuses its buffers) and the names of the
    threads alive while they came."""
    loader = Loader(path, max_tokens=160, shuffle=True, seed=3, num_threads=num_threads,
                    decode_path=decode_path)  # fmt: skip
    batches, threads = [], set()
    for batch in loader:
        batches.append({k: v.clone() for k, v in batch.items()})
        threads |= {t.name for t in threading.enumerate()}
    loader.close()
    return batches, threads


@pytest.mark.parametrize("num_threads", [1, 2])
def test_inline_and_pipelined_decoding_yield_the_same_batches(dataset, num_threads):
    inline, inline_threads = _epoch(dataset, "inline", num_threads)
    pipelined, pipelined_threads = _epoch(dataset, "pipelined", num_threads)
    assert len(inline) == len(pipelined) > 1
    for a, b in zip(inline, pipelined, strict=True):
        assert a.keys() == b.keys()
        for key in a:
            assert torch.equal(a[key], b[key]), key
    # Each ran the path asked for, whatever this machine's cores.
    assert not any(name.startswith("hsstore-check") for name in inline_threads)
    assert any(name.startswith("hsstore-check") for name in pipelined_threads)
    ds = hsstore.open(dataset)
    for batch in inline:
        states, at = batch["per_layer_hidden_states"][0], 0
        for i, n in zip(batch["sample_index"].tolist(), batch["lengths"].tolist(), strict=True):
            assert torch.equal(states[at : at + n], ds[i].hidden)
            at += n


def test_auto_is_pipelined_exactly_where_the_decode_threads_leave_a_core_free():
    cores = usable_cores()
    assert resolve_decode_path("auto", cores) == "inline"
    assert resolve_decode_path("auto", cores + 1) == "inline"
    if cores > 1:
        assert resolve_decode_path("auto", cores - 1) == "pipelined"
    for asked in ("inline", "pipelined"):
        assert resolve_decode_path(asked, 1) == resolve_decode_path(asked, 64) == asked


def test_an_unknown_decode_path_is_refused_where_it_is_given(dataset):
    with pytest.raises(ValueError, match="decode_path must be one of .*'threads'"):
        Loader(dataset, decode_path="threads")
