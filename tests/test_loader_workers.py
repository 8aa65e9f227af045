"""The Loader's worker-process mode: the same batches as its decode threads, made into the
trainer's keys once, and worker processes that end when the Loader is closed."""

from __future__ import annotations

import multiprocessing

import pytest
import torch

import hsstore
from hsstore import LayerSpec
from hsstore.loader import HiddenStateStream, Loader, LoaderOptions, RankPlan
from hsstore.loader.worker_batches import RawBatchStream

OPTS = dict(max_tokens=64, seed=5, block_size=2, window=8, num_threads=2, prefetch=2)


@pytest.fixture(scope="module")
def path(tmp_path_factory):
    path = tmp_path_factory.mktemp("workers") / "ds"
    ds = hsstore.create(path, layers=[LayerSpec(1), LayerSpec(2), LayerSpec(3)], hidden_size=8,
                        dtype=torch.bfloat16, model={"num_hidden_layers": 3})  # fmt: skip
    g = torch.Generator().manual_seed(2)
    with ds.writer() as w:
        for k in range(20):
            t = int(torch.randint(3, 30, (1,), generator=g))
            hidden = torch.randn(t, 3, 8, generator=g).to(torch.bfloat16)
            w.add(
                f"s{k}",
                torch.randint(0, 50, (t,), generator=g),
                torch.ones(t, dtype=torch.int64),
                hidden,
            )
    return path


def _batches(loader: Loader) -> list[dict[str, torch.Tensor]]:
    # CPU batches reuse their buffers: keep copies.
    return [{k: v.clone() for k, v in b.items()} for b in loader]


def test_workers_give_the_same_batches_as_threads(path):
    threads = _batches(Loader(path, **OPTS))
    loader = Loader(path, workers=2, **OPTS)
    workers = _batches(loader)
    assert len(workers) == len(threads) > 2
    for got, want in zip(workers, threads):
        assert got.keys() == want.keys()
        for key in want:
            assert torch.equal(got[key], want[key]), key
    loader.close()


def test_worker_batches_are_views_of_one_buffer(path):
    loader = Loader(path, workers=2, **OPTS)
    batch = next(iter(loader))
    base = batch["per_layer_hidden_states"]
    assert batch["verifier_last_hidden_states"].untyped_storage().data_ptr() == (
        base.untyped_storage().data_ptr()
    )
    assert batch["hidden_states"].untyped_storage().data_ptr() == base.untyped_storage().data_ptr()
    loader.close()


def test_the_workers_plan_is_the_loaders_and_close_ends_them(path):
    loader = Loader(path, workers=2, **OPTS)
    it = iter(loader)
    next(it)
    assert len(multiprocessing.active_children()) == 2
    loader.close()
    assert multiprocessing.active_children() == []
    # The stream the workers iterate is built from the Loader's own RankPlan, not from options.
    stream = RawBatchStream(loader.rank_plan)
    assert stream.rank_plan is loader.rank_plan and stream.fingerprint == loader.fingerprint
    with pytest.raises(TypeError, match="fixes them"):
        HiddenStateStream(loader.rank_plan, max_tokens=8)
    plan_opts = {k: OPTS[k] for k in ("max_tokens", "seed", "block_size", "window")}
    assert RankPlan.from_options(path, LoaderOptions(**plan_opts)).config == loader.config
