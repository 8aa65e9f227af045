"""The Loader across epoch boundaries: decoding rolls on into the next epoch, positions stay exact.

The pipeline plans epoch e+1 itself and decodes its first batches before the consumer asks for
them; these tests pin down that this changes nothing observable: the same batches in the same
order as epoch-by-epoch iteration, every sample once per epoch, ``state_dict()`` counting only
delivered batches, and resumption at any cut (right before and right after a boundary
included) continuing with exactly the uninterrupted sequence.
"""

from __future__ import annotations

import threading

import pytest
import torch

import hsstore
from hsstore import LayerSpec
from hsstore.errors import BadInputError
from hsstore.loader import Loader

MAX_TOKENS = 64
N_SAMPLES = 24
OPTS = dict(max_tokens=MAX_TOKENS, seed=3, block_size=2, window=8, num_threads=2, prefetch=2)


@pytest.fixture(scope="module")
def path(tmp_path_factory):
    path = tmp_path_factory.mktemp("epochs") / "ds"
    ds = hsstore.create(
        path,
        layers=[LayerSpec(depth=1), LayerSpec(depth=2)],
        hidden_size=8,
        dtype=torch.float16,
        model={"name": "toy", "num_hidden_layers": 2, "hidden_size": 8, "vocab_size": 20},
    )
    g = torch.Generator().manual_seed(1)
    with ds.writer() as w:
        for k in range(N_SAMPLES):
            t = int(torch.randint(4, 40, (1,), generator=g))
            w.add(
                f"s{k:02d}",
                torch.randint(0, 20, (t,), generator=g),
                torch.ones(t, dtype=torch.int64),
                torch.randn(t, 2, 8, generator=g).half(),
            )
    return path


def epoch_batches(path, epoch: int, **opts) -> list[list[int]]:
    """Reference: one epoch from a fresh Loader (no pipeline carried over from anything)."""
    loader = Loader(path, **{**OPTS, **opts})
    loader.set_epoch(epoch)
    out = [b["sample_index"].tolist() for b in loader]
    loader.close()
    return out


@pytest.fixture(scope="module")
def reference(path) -> list[list[list[int]]]:
    ref = [epoch_batches(path, e) for e in range(3)]
    planner = Loader(path, **OPTS)
    for e, batches in enumerate(ref):  # and that is the pure epoch plan
        plan = planner.plan(e)
        assert batches == [plan.batch(j)[0].tolist() for j in range(len(plan))]
    return ref


class DecodeCounter:
    """Counts samples decoded by a Loader's threads; ``wait_beyond(n)`` blocks until more than
    n were decoded (so a test can tell that decoding ran ahead of what was delivered)."""

    def __init__(self, loader: Loader):
        self.count = 0
        self._cond = threading.Condition()
        read, read_many = loader.source.read_hidden_into, loader.source.read_hidden_many_into

        def counting(i, out, layers):  # a truncated sample
            read(i, out, layers)
            self._done(1)

        def drawn(placed):  # a sample is decoded once the next one is drawn
            for k, pair in enumerate(placed):
                if k:
                    self._done(1)
                yield pair

        def counting_many(out, placed, layers, unchecked=None, runs_to=None):
            n = read_many(out, drawn(placed), layers, unchecked, runs_to)
            self._done(1 if n else 0)
            return n

        loader.source.read_hidden_into = counting  # type: ignore[method-assign]
        loader.source.read_hidden_many_into = counting_many  # type: ignore[method-assign]

    def _done(self, n: int) -> None:
        with self._cond:
            self.count += n
            self._cond.notify_all()

    def wait_beyond(self, n: int) -> bool:
        with self._cond:
            return self._cond.wait_for(lambda: self.count > n, timeout=30)


def test_iter_epochs_gives_the_epoch_by_epoch_batches_each_sample_once(path, reference):
    loader = Loader(path, **OPTS)
    got, epochs = [], []
    for batch in loader.iter_epochs(3):
        got.append(batch["sample_index"].tolist())
        epochs.append(loader.epoch)  # the epoch of the batch just delivered
    assert got == [b for epoch in reference for b in epoch]
    assert epochs == [e for e, epoch in enumerate(reference) for _ in epoch]
    for epoch in reference:
        assert sorted(i for b in epoch for i in b) == list(range(N_SAMPLES))
    assert reference[0] != reference[1]  # epochs are reshuffled: the boundary matters
    assert (loader.epoch, loader.step) == (3, 0)
    loader.close()


def test_decoding_rolls_into_the_next_epoch_of_a_per_epoch_loop(path, reference):
    loader = Loader(path, **OPTS)
    decoded = DecodeCounter(loader)
    first = [b["sample_index"].tolist() for b in loader]
    assert first == reference[0]
    assert (loader.epoch, loader.step) == (1, 0)
    # Nobody asked for epoch 1 yet, but its first batch is being decoded already...
    assert decoded.wait_beyond(N_SAMPLES)
    assert loader.state_dict()["epoch"] == 1 and loader.state_dict()["step"] == 0
    pipeline = loader._pipe  # white-box: the pipeline that decoded ahead...
    # ...is the one that delivers, and the loop goes on exactly as a fresh loader would.
    for epoch in (1, 2):
        loader.set_epoch(epoch)  # as in docs/LOADER.md: a no-op here, keeps what was decoded
        assert [b["sample_index"].tolist() for b in loader] == reference[epoch]
        assert loader._pipe is pipeline
    loader.close()


@pytest.mark.parametrize("where", ["before", "after", "one-before", "second-boundary"])
@pytest.mark.parametrize("api", ["iter_epochs", "per_epoch"])
def test_resume_at_an_epoch_boundary_equals_uninterrupted(path, reference, where, api):
    flat = [b for epoch in reference for b in epoch]
    n0, n1 = len(reference[0]), len(reference[1])
    cut = {
        "one-before": n0 - 1,  # epoch 0's last batch not delivered yet
        "before": n0,  # epoch 0 delivered, epoch 1 not started
        "after": n0 + 1,  # epoch 1's first batch delivered
        "second-boundary": n0 + n1,
    }[where]
    first = Loader(path, **OPTS)
    decoded = DecodeCounter(first)
    got = []
    for batch in first.iter_epochs():
        got.append(batch["sample_index"].tolist())
        if len(got) == cut:
            break
    # Decoding has run past the cut (into the next epoch for "before")...
    assert decoded.wait_beyond(sum(len(b) for b in flat[:cut]))
    state = first.state_dict()
    # ...but the state counts only what was delivered.
    epoch, step = (0, cut) if cut <= n0 else (1, cut - n0) if cut <= n0 + n1 else (2, 0)
    assert (state["epoch"], state["step"]) == (epoch, step)
    first.close()

    resumed = Loader(path, **OPTS)
    resumed.load_state_dict(state)
    if api == "iter_epochs":
        rest = [b["sample_index"].tolist() for b in resumed.iter_epochs(3)]
    else:
        rest = []
        for e in range(resumed.epoch, 3):
            resumed.set_epoch(e)
            rest.extend(b["sample_index"].tolist() for b in resumed)
    assert got + rest == flat
    resumed.close()


def test_the_same_loader_resumes_after_a_break_and_stale_iterators_stop(path, reference):
    loader = Loader(path, **OPTS)
    old = iter(loader)
    assert next(old)["sample_index"].tolist() == reference[0][0]
    new = loader.iter_epochs(2)
    got = [next(new)["sample_index"].tolist()]  # takes over: continues where `old` stopped
    assert list(old) == []  # the older iterator stops instead of stealing batches
    got.extend(b["sample_index"].tolist() for b in new)
    assert got == reference[0][1:] + reference[1]
    loader.close()


def test_moving_elsewhere_drops_what_was_decoded_ahead(path, reference):
    loader = Loader(path, **OPTS)
    decoded = DecodeCounter(loader)
    assert [b["sample_index"].tolist() for b in loader] == reference[0]
    assert decoded.wait_beyond(N_SAMPLES)  # epoch 1 is being decoded
    loader.set_epoch(2)
    assert [b["sample_index"].tolist() for b in loader] == reference[2]
    loader.load_state_dict({"epoch": 1, "step": 2})
    assert [b["sample_index"].tolist() for b in loader] == reference[1][2:]
    loader.close()


def test_worker_processes_cross_epochs_too(path, reference):
    loader = Loader(path, workers=2, **OPTS)
    got = [b["sample_index"].tolist() for b in loader.iter_epochs(2)]
    assert got == reference[0] + reference[1]
    loader.close()


def test_a_rank_without_batches(path):
    opts = {**OPTS, "rank": 63, "world_size": 64, "tail": "drop"}
    loader = Loader(path, **opts)
    assert len(loader) == 0
    assert list(loader.iter_epochs(2)) == []  # bounded: empty epochs are simply passed
    assert loader.epoch == 2
    with pytest.raises(BadInputError, match="no batches"):
        next(loader.iter_epochs())  # unbounded: an error, not an endless loop
