"""A training run past a damaged sample: one byte flipped in a real chunk on disk. Without
``skip_damaged`` the Loader stops with an error that names the sample, `hsstore repair` and the
option; with it, each damaged sample is named (warning and log record), blanked in its batch
and counted in the state, every rank keeps its number of batches, and a resumed run delivers
exactly the batches the uninterrupted one did."""

from __future__ import annotations

import logging
import shutil
import warnings

import pytest
import torch

import hsstore
from hsstore import LayerSpec
from hsstore.loader import HiddenStateStream, Loader
from hsstore.spec import paths
from hsstore.storage.locations import open_storage
from tools.synthetic import random_sample

H = 16
LAYERS = [LayerSpec(1), LayerSpec(2), LayerSpec(3)]
OPTIONS = {"max_tokens": 64, "seed": 3, "block_size": 2, "window": 8}


def _build(location: str) -> None:
    ds = hsstore.create(location, layers=LAYERS, hidden_size=H, dtype=torch.bfloat16,
                        chunk_bytes=1024, shard_bytes=4096)  # fmt: skip
    for c in range(3):
        with ds.writer(encode_threads=1) as w:
            for i in range(6):
                w.add(f"c{c}-s{i}", *random_sample(9 + 3 * i, len(LAYERS), H, seed=10 * c + i))


@pytest.fixture(scope="module")
def datasets(tmp_path_factory) -> tuple[str, str]:
    """(a clean dataset, its copy with one byte flipped in the first chunk of a segment)."""
    root = tmp_path_factory.mktemp("damaged")
    clean, damaged = str(root / "clean"), str(root / "damaged")
    _build(clean)
    shutil.copytree(clean, damaged)
    storage = open_storage(damaged)
    seg = hsstore.open(damaged).manifest.segments[1]
    key = paths.segment_file(seg.id, paths.shard_relpath(0))
    data = bytearray(storage.read_bytes(key))
    data[40] ^= 0xFF
    storage.delete(key)
    storage.put(key, bytes(data))
    return clean, damaged


def _damaged_ids(location: str) -> set[str]:
    ds = hsstore.open(location)
    bad = set()
    for i, sid in enumerate(ds.sample_ids):
        try:
            ds.read(i)
        except hsstore.IntegrityError:
            bad.add(sid)
    return bad


def _batches(loader, n: int | None = None) -> list[dict[str, torch.Tensor]]:
    out = []
    for batch in loader.iter_epochs(2):
        out.append({k: v.clone() for k, v in batch.items()})
        if n is not None and len(out) == n:
            break
    return out


def _blanked(batch: dict[str, torch.Tensor], positions: set[int]) -> dict[str, torch.Tensor]:
    """A clean batch as the loader makes it when ``positions`` are damaged."""
    out = {k: v.clone() for k, v in batch.items()}
    start = 0
    for pos, n in zip(batch["sample_index"].tolist(), batch["lengths"].tolist()):
        if pos in positions:
            out["per_layer_hidden_states"][0, start : start + n] = 0
            out["loss_mask"][0, start : start + n] = 0
        start += n
    k = len(LAYERS) - 1
    hidden = out["per_layer_hidden_states"]
    out["hidden_states"] = hidden[:, :, :k].reshape(*hidden.shape[:2], k * H)
    out["verifier_last_hidden_states"] = hidden[:, :, k]
    return out


def _same(got: list[dict], want: list[dict]) -> None:
    assert len(got) == len(want)
    for a, b in zip(got, want):
        assert a.keys() == b.keys()
        for key in a:
            assert torch.equal(a[key], b[key]), key


def test_without_the_option_the_error_names_the_sample_repair_and_the_option(datasets):
    _, damaged = datasets
    bad = _damaged_ids(damaged)
    assert bad  # the flipped byte hit at least one sample
    with pytest.raises(hsstore.IntegrityError) as info:
        _batches(Loader(damaged, **OPTIONS))
    assert info.value.sample_id in bad
    text = str(info.value)
    assert f"hsstore repair {damaged}" in text and "skip_damaged=True" in text
    assert "--skip-damaged" in text


@pytest.mark.parametrize("num_threads", [1, 3])
def test_skip_damaged_names_blanks_and_counts_each_damaged_sample(datasets, num_threads, caplog):
    clean, damaged = datasets
    bad = _damaged_ids(damaged)
    positions = {hsstore.open(damaged).position(sid) for sid in bad}
    want = [_blanked(b, positions) for b in _batches(Loader(clean, **OPTIONS))]
    loader = Loader(damaged, skip_damaged=True, num_threads=num_threads, **OPTIONS)
    with warnings.catch_warnings(record=True) as caught, caplog.at_level(logging.WARNING):
        warnings.simplefilter("always")
        got = _batches(loader)
    _same(got, want)  # every batch, the damaged samples blanked, everything else exact
    assert set(loader.skipped) == bad and len(loader.skipped) == len(bad)  # each found once
    assert loader.state_dict()["skipped"] == loader.skipped
    named = [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)]
    logged = [r.getMessage() for r in caplog.records if r.name == "hsstore.loader"]
    for sid in bad:
        for lines in (named, logged):
            mine = [line for line in lines if repr(sid) in line]
            assert len(mine) == 1 and "damaged" in mine[0] and "hsstore repair" in mine[0]


def test_every_rank_keeps_its_number_of_batches(datasets):
    clean, damaged = datasets
    world = 3
    for tail in ("pad", "drop"):
        counts, clean_counts, found = [], [], set()
        for rank in range(world):
            opts = {**OPTIONS, "rank": rank, "world_size": world, "tail": tail}
            loader = Loader(damaged, skip_damaged=True, **opts)
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", RuntimeWarning)
                counts.append(len(_batches(loader)))
            found |= set(loader.skipped)
            clean_counts.append(len(_batches(Loader(clean, **opts))))
        assert counts == clean_counts and len(set(counts)) == 1, (tail, counts)
        if tail == "pad":  # every sample is in some rank's batches
            assert found == _damaged_ids(damaged)


@pytest.mark.parametrize("stop_after", [1, 4])
def test_a_resumed_run_continues_exactly(datasets, stop_after):
    _, damaged = datasets
    opts = {**OPTIONS, "skip_damaged": True}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        whole = Loader(damaged, **opts)
        want = _batches(whole)
        first = Loader(damaged, **opts)
        head = _batches(first, stop_after)
        state = first.state_dict()
        first.close()
    resumed = Loader(damaged, **opts)
    resumed.load_state_dict(state)
    assert resumed.skipped == state["skipped"]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        tail = _batches(resumed)
    _same(head + tail, want)
    assert sorted(resumed.skipped) == sorted(whole.skipped)
    # a sample the saved run had already found is not named again
    again = [w for w in caught if any(repr(s) in str(w.message) for s in state["skipped"])]
    assert not again


def test_worker_processes_skip_the_same_samples(datasets):
    clean, damaged = datasets
    bad = _damaged_ids(damaged)
    positions = {hsstore.open(damaged).position(sid) for sid in bad}
    want = [_blanked(b, positions) for b in _batches(Loader(clean, **OPTIONS))]
    loader = Loader(damaged, skip_damaged=True, workers=1, **OPTIONS)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        _same(_batches(loader), want)
    assert set(loader.skipped) == bad


def test_the_stream_refuses_an_option_it_does_not_honour(datasets):
    with pytest.raises(TypeError, match="skip_damaged is an option of the Loader"):
        HiddenStateStream(datasets[0], skip_damaged=True)
