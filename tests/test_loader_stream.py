"""The loader over real datasets on disk: values, exactly-once, resumption, workers."""

from __future__ import annotations

import time
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader

import hsstore
from hsstore import LayerSpec
from hsstore.errors import IntegrityError, LoaderStateError
from hsstore.loader import (
    HiddenStateDataset,
    HiddenStateStream,
    Loader,
    PlannedBatchSampler,
    pack_collate,
)
from hsstore.loader.collate import as_eagle3
from hsstore.loader.fetch import BatchFetcher

H = 32
MAX_TOKENS = 128
LAYERS = [LayerSpec(depth=1), LayerSpec(depth=3), LayerSpec(depth=5), LayerSpec(depth=6)]


def _write(path, n_per_segment, seed, codec="blosc-zstd"):
    ds = hsstore.create(
        path,
        layers=LAYERS,
        hidden_size=H,
        dtype=torch.bfloat16,
        model={
            "name": "toy",
            "revision": None,
            "num_hidden_layers": 6,
            "hidden_size": H,
            "vocab_size": 50,
        },
        codec=codec,
    )
    g = torch.Generator().manual_seed(seed)
    k = 0
    for n in n_per_segment:  # one writer session = one segment
        with ds.writer() as w:
            for _ in range(n):
                t = int(torch.randint(2, 100, (1,), generator=g))
                if k in (5, 17):
                    t = MAX_TOKENS + 40  # over-long
                w.add(
                    f"s{k:03d}",
                    torch.randint(0, 50, (t,), generator=g),
                    torch.randint(0, 2, (t,), generator=g),
                    torch.randn(t, len(LAYERS), H, generator=g).to(torch.bfloat16),
                )
                k += 1
    return hsstore.open(path)


@pytest.fixture(scope="module")
def ds(tmp_path_factory):
    return _write(tmp_path_factory.mktemp("loader") / "ds", [20, 18], seed=0)


def _indices(batches):
    return [b["sample_index"].tolist() for b in batches]


def _check_batch_values(ds, batch, aux=(0, 1, 2), verifier=3, packed=True):
    real = batch["document_ids"] >= 0  # every non-padding token, in any mode
    assert torch.all(batch["hidden_states"][~real] == 0)
    assert torch.all(batch["loss_mask"][~real] == 0)
    assert int(real.sum()) == int(batch["lengths"].sum())
    for d, i in enumerate(batch["sample_index"].tolist()):
        s = ds[i]
        n = min(s.num_tokens, MAX_TOKENS)
        if packed:
            sel = batch["document_ids"][0] == d
            row, cols = 0, sel.nonzero().flatten()
            assert len(cols) == n
            start = int(cols[0])
            assert torch.equal(cols, torch.arange(start, start + n))
        else:
            row, start = d, 0
            assert int(batch["lengths"][d]) == n
        sl = slice(start, start + n)
        assert torch.equal(batch["input_ids"][row, sl], s.input_ids[:n])
        assert torch.equal(batch["loss_mask"][row, sl], s.loss_mask[:n])
        assert torch.equal(batch["position_ids"][row, sl], torch.arange(n))
        want_aux = s.hidden[:n, list(aux)].reshape(n, len(aux) * H)
        assert torch.equal(batch["hidden_states"][row, sl], want_aux)
        if verifier is not None:
            assert torch.equal(
                batch["verifier_last_hidden_states"][row, sl], s.hidden[:n, verifier]
            )


@pytest.mark.parametrize("threads", [1, 2])
def test_packed_batches_equal_dataset_bytes(ds, threads):
    loader = Loader(ds.path, max_tokens=MAX_TOKENS, seed=3, num_threads=threads)
    seen = []
    for batch in loader.iter_epochs(3):  # the ring's buffers are reused by other batches
        assert batch["input_ids"].shape == (1, MAX_TOKENS)
        assert batch["hidden_states"].shape == (1, MAX_TOKENS, 3 * H)
        used = int(batch["lengths"].sum())
        assert used <= MAX_TOKENS
        assert torch.all(batch["document_ids"][0, used:] == -1)
        assert torch.all(batch["per_layer_hidden_states"][0, used:] == 0)
        assert torch.all(batch["loss_mask"][0, used:] == 0)
        _check_batch_values(ds, batch)
        seen.extend(batch["sample_index"].tolist())
    assert sorted(seen) == sorted(list(range(len(ds))) * 3)


@pytest.mark.parametrize("threads", [1, 2])
def test_padded_mode_and_layer_subset(ds, threads):
    loader = Loader(
        ds.path,
        max_tokens=MAX_TOKENS,
        batch_size=5,
        aux_layers=[2, 0],
        seed=1,
        num_threads=threads,
    )
    seen = []
    for batch in loader.iter_epochs(3):  # batches of other shapes reuse the ring's buffers
        b, t = batch["input_ids"].shape
        assert t % 8 == 0 or t == MAX_TOKENS
        assert batch["per_layer_hidden_states"].shape == (b, t, 3, H)
        lengths = batch["lengths"]
        assert torch.equal(batch["document_ids"] == 0, torch.arange(t)[None] < lengths[:, None])
        _check_batch_values(ds, batch, aux=(2, 0), packed=False)
        seen.extend(batch["sample_index"].tolist())
    assert sorted(seen) == sorted(list(range(len(ds))) * 3)


def test_no_verifier(ds):
    loader = Loader(ds.path, max_tokens=MAX_TOKENS, aux_layers=[1], verifier=False, shuffle=False)
    batch = next(iter(loader))
    assert "verifier_last_hidden_states" not in batch
    _check_batch_values(ds, batch, aux=(1,), verifier=None)


def test_two_ranks_cover_the_epoch_exactly_once(ds):
    per_rank = [
        _indices(
            Loader(ds.path, max_tokens=MAX_TOKENS, rank=r, world_size=2, tail="uneven", seed=1)
        )
        for r in range(2)
    ]
    flat = [i for rank in per_rank for b in rank for i in b]
    assert sorted(flat) == list(range(len(ds)))


def test_epochs_and_seeds_differ(ds):
    loader = Loader(ds.path, max_tokens=MAX_TOKENS, seed=0, block_size=2, window=8)
    e0 = _indices(loader)
    assert loader.epoch == 1  # a finished epoch moves on
    e1 = _indices(loader)
    other = _indices(Loader(ds.path, max_tokens=MAX_TOKENS, seed=1, block_size=2, window=8))
    assert e0 != e1 and e0 != other
    again = Loader(ds.path, max_tokens=MAX_TOKENS, seed=0, block_size=2, window=8)
    assert _indices(again) == e0


@pytest.mark.parametrize("cut", [0, 1, 4, -1])
def test_resume_equals_uninterrupted(ds, cut):
    opts = dict(max_tokens=MAX_TOKENS, seed=7, num_threads=2, prefetch=2)
    full = Loader(ds.path, **opts)
    full.set_epoch(2)
    expected = _indices(full)
    cut = cut % len(expected)
    first = Loader(ds.path, **opts)
    first.set_epoch(2)
    got, state = [], first.state_dict()
    if cut:
        for batch in first:
            got.append(batch["sample_index"].tolist())
            if len(got) == cut:
                state = first.state_dict()  # checkpoint after finishing `cut` steps
                break
    assert state["step"] == cut and got == expected[:cut]
    resumed = Loader(ds.path, **opts)
    resumed.load_state_dict(state)
    resumed.set_epoch(2)  # same epoch: keeps the restored position
    got.extend(_indices(resumed))
    assert got == expected


def test_state_from_another_plan_is_refused(ds):
    state = Loader(ds.path, max_tokens=MAX_TOKENS).state_dict()
    with pytest.raises(LoaderStateError, match="cannot resume"):
        Loader(ds.path, max_tokens=MAX_TOKENS * 2).load_state_dict(state)


def test_dataloader_workers_give_the_rank_order(ds):
    opts = dict(max_tokens=MAX_TOKENS, seed=11)
    expected = _indices(Loader(ds.path, **opts))
    stream = HiddenStateStream(ds.path, num_threads=1, **opts)
    got = _indices(DataLoader(stream, batch_size=None, num_workers=2))
    assert got == expected
    # Resume mid-epoch with workers: the main-process copy carries the position.
    stream.load_state_dict({"epoch": 0, "step": 3})
    assert _indices(DataLoader(stream, batch_size=None, num_workers=2)) == expected[3:]


def test_two_ranks_with_two_workers_each_cover_the_epoch_once(ds):
    seen = []
    for rank in range(2):
        stream = HiddenStateStream(
            ds.path, max_tokens=MAX_TOKENS, rank=rank, world_size=2, tail="uneven", seed=9
        )
        stream.set_epoch(1)
        for batch in DataLoader(stream, batch_size=None, num_workers=2):
            _check_batch_values(ds, batch)
            seen.extend(batch["sample_index"].tolist())
    assert sorted(seen) == list(range(len(ds)))


@pytest.mark.parametrize("num_workers", [0, 2])
def test_stateful_dataloader_resumes_exactly(ds, num_workers):
    """torchdata's StatefulDataLoader snapshots each worker's stream copy and restores it."""
    from torchdata import stateful_dataloader as sdl  # a dev dependency: missing must fail

    opts = dict(max_tokens=MAX_TOKENS, seed=8, num_threads=1)
    expected = _indices(Loader(ds.path, **opts))
    cut = 3
    dl = sdl.StatefulDataLoader(
        HiddenStateStream(ds.path, **opts), batch_size=None, num_workers=num_workers
    )
    got = []
    for batch in dl:
        got.append(batch["sample_index"].tolist())
        if len(got) == cut:
            break
    state = dl.state_dict()
    assert "fingerprint" in repr(state)  # our own state was used, not a replay fallback
    del dl
    resumed = sdl.StatefulDataLoader(
        HiddenStateStream(ds.path, **opts), batch_size=None, num_workers=num_workers
    )
    resumed.load_state_dict(state)
    got.extend(_indices(resumed))
    assert got == expected


def test_loader_with_worker_processes(ds):
    opts = dict(max_tokens=MAX_TOKENS, seed=5)
    expected = _indices(Loader(ds.path, **opts))
    loader = Loader(ds.path, workers=2, **opts)
    got = []
    for batch in loader:
        _check_batch_values(ds, batch)
        got.append(batch["sample_index"].tolist())
    assert got == expected


def test_map_style_with_planned_sampler(ds):
    opts = dict(max_tokens=MAX_TOKENS, seed=4)
    loader_idx = _indices(Loader(ds.path, **opts))
    mapped = HiddenStateDataset(ds.path, max_tokens=MAX_TOKENS)
    sampler = PlannedBatchSampler(ds.path, **opts)
    dl = DataLoader(
        mapped, batch_sampler=sampler, collate_fn=pack_collate(MAX_TOKENS), num_workers=0
    )
    assert [list(b) for b in sampler] == loader_idx  # the same plan as the Loader's
    batches = list(dl)
    assert len(batches) == len(loader_idx)
    for idx, batch in zip(loader_idx, batches):
        batch["sample_index"] = torch.tensor(idx)  # pack_collate keeps the sampler's order
        _check_batch_values(ds, batch)


def test_cuda_request_without_cuda_falls_back(ds):
    if torch.cuda.is_available():
        pytest.skip("CUDA present: the GPU path is checked by tools/gpu_check_loader.py")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        loader = Loader(ds.path, max_tokens=MAX_TOKENS, device="cuda")
    assert loader.device is None
    assert any("CUDA" in str(w.message) for w in caught)
    batch = next(iter(loader))
    assert batch["hidden_states"].device.type == "cpu"


def test_corrupted_bytes_surface_in_the_consumer(tmp_path):
    bad = _write(tmp_path / "bad", [12], seed=1)
    shards = sorted(p for p in Path(bad.path).rglob("states/c/*/0/0"))
    data = bytearray(shards[0].read_bytes())
    mid = len(data) // 3
    data[mid : mid + 64] = bytes(64)
    shards[0].write_bytes(bytes(data))
    with pytest.raises(IntegrityError):
        for _ in Loader(bad.path, max_tokens=MAX_TOKENS, shuffle=False):
            pass


def test_memory_is_bounded_by_the_ring(ds):
    """Buffers are reused: a slow consumer does not make the loader allocate more."""
    loader = Loader(ds.path, max_tokens=MAX_TOKENS, prefetch=2, shuffle=False)
    pointers = set()
    for batch in loader:
        pointers.add(batch["per_layer_hidden_states"].data_ptr())
    assert 1 <= len(pointers) <= 3  # prefetch + 1 buffers
    assert np.unique(list(pointers)).size == len(pointers)


def test_used_buffers_go_back_quietly_while_batches_are_ready(ds):
    """The hand-off wakes the producer only when the queue is about to run dry (a wake-up
    inside it can cost the training loop a scheduler tick); otherwise the producer finds the
    returned buffer by polling, and the batches are the same."""
    loader = Loader(ds.path, max_tokens=MAX_TOKENS, shuffle=False)
    plan = loader.plan()
    fetcher = BatchFetcher(
        loader.source, loader.choice, loader.shape, iter(plan), num_threads=1, prefetch=2
    )
    wakes = []
    put = fetcher._free.put
    fetcher._free.put = lambda buf, *a, **k: (wakes.append(buf), put(buf, *a, **k))
    got = []
    for raw in fetcher:
        got.append(raw.sample_index.tolist())
        _check_batch_values(ds, as_eagle3(raw, loader.choice))
        deadline = time.monotonic() + 30  # let the producer fill the queue again
        while not fetcher._out.full() and fetcher._thread.is_alive():
            assert time.monotonic() < deadline
            time.sleep(0.001)
    assert got == [plan.batch(j)[0].tolist() for j in range(len(plan))]
    assert len(plan) > 6
    assert len([b for b in wakes if b is not None]) <= 2  # only as the plan runs out


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_device_batches_equal_dataset_bytes(ds):
    loader = Loader(ds.path, max_tokens=MAX_TOKENS, device="cuda", seed=6, prefetch=2)
    seen = []
    for batch in loader:
        assert batch["hidden_states"].is_cuda and batch["lengths"].is_cuda
        _check_batch_values(ds, {k: v.cpu() for k, v in batch.items()})
        seen.extend(batch["sample_index"].tolist())
    assert sorted(seen) == list(range(len(ds)))


class _DecodeSpy:
    """Records the samples a loader's decode threads read (in the order they draw them) and the
    tasks they ran them in."""

    def __init__(self, loader: Loader, monkeypatch):
        self.reads: list[int] = []
        self.tasks = 0
        read, read_many = loader.source.read_hidden_into, loader.source.read_hidden_many_into

        def reading(i, out, layers):  # a truncated sample, decoded whole on the side
            self.reads.append(i)
            read(i, out, layers)

        loader.source.read_hidden_into = reading  # type: ignore[method-assign]

        def drawn(placed):
            for i, row in placed:
                self.reads.append(i)
                yield i, row

        def reading_many(out, placed, layers, unchecked=None, runs_to=None):
            return read_many(out, drawn(placed), layers, unchecked, runs_to)

        loader.source.read_hidden_many_into = reading_many  # type: ignore[method-assign]
        claimed = BatchFetcher._decode_claimed

        def counting(fetcher, rows, todo, unchecked, runs_to=None):
            self.tasks += 1
            claimed(fetcher, rows, todo, unchecked, runs_to)

        monkeypatch.setattr(BatchFetcher, "_decode_claimed", counting)


@pytest.mark.parametrize("threads", [1, 3])
def test_a_batch_decodes_in_one_task_per_thread_in_storage_order(ds, monkeypatch, threads):
    loader = Loader(ds.path, max_tokens=MAX_TOKENS, seed=5)
    spy = _DecodeSpy(loader, monkeypatch)
    plan = loader.plan()
    fetcher = BatchFetcher(
        loader.source, loader.choice, loader.shape, iter(plan), num_threads=threads
    )
    batches = []
    for raw in fetcher:
        _check_batch_values(ds, as_eagle3(raw, loader.choice))
        batches.append(raw.sample_index.tolist())
    assert batches == [plan.batch(j)[0].tolist() for j in range(len(plan))]
    assert sorted(spy.reads) == sorted(i for b in batches for i in b)  # each sample once
    assert spy.tasks == sum(min(threads, len(b)) for b in batches)
    if threads == 1:  # one thread reads each batch forwards through the storage
        assert spy.reads == [i for b in batches for i in sorted(b)]
        assert any(b != sorted(b) for b in batches)  # the plan's own order is another


@pytest.mark.parametrize("threads", [1, 3])
def test_a_corrupted_sample_is_named_by_the_loader(tmp_path, threads):
    bad = _write(tmp_path / "bad", [12], seed=2, codec="none")
    (shard,) = Path(bad.path).rglob("states/c/0/0/0")  # one raw chunk: rows from byte 0
    data = bytearray(shard.read_bytes())
    at = (int(bad.index.column("row_offset")[6]) + 1) * len(LAYERS) * H * 2  # sample 6's 2nd row
    data[at : at + 8] = bytes(b ^ 0xFF for b in data[at : at + 8])
    shard.write_bytes(bytes(data))
    fresh = hsstore.open(bad.path)
    failing = []
    for i in range(len(fresh)):
        out = torch.empty(fresh.num_tokens_of(i), len(LAYERS), H, dtype=torch.bfloat16)
        try:
            fresh.read_hidden_into(i, out)
        except IntegrityError:
            failing.append(fresh.sample_ids[i])
    assert failing == [bad.sample_ids[6]]
    loader = Loader(bad.path, max_tokens=MAX_TOKENS, shuffle=False, num_threads=threads)
    with pytest.raises(IntegrityError, match="sample checksum mismatch") as caught:
        for _ in loader:
            pass
    assert caught.value.sample_id == failing[0]
    assert repr(failing[0]) in str(caught.value)
