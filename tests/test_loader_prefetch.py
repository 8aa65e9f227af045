"""The device stager's threading logic, run on the CPU with a stand-in for the CUDA API.

The real CUDA path is checked by tools/gpu_check_loader.py on a GPU machine; here the stream,
event and device copy are replaced by CPU equivalents (a copy is a clone) so that ordering,
buffer recycling (a host buffer is reused only after its copy) and shutdown are tested.
"""

from __future__ import annotations

import contextlib

import pytest
import torch

import hsstore
from hsstore import LayerSpec
from hsstore.loader import Loader, train_loader
from hsstore.loader import prefetch as prefetch_mod
from hsstore.loader.collate import RawBatch


class _FakeEvent:
    def record(self, stream=None) -> None:
        pass

    def synchronize(self) -> None:
        pass


class _FakeStream:
    def __init__(self, device=None):
        self.waited = 0

    def wait_event(self, event) -> None:
        self.waited += 1


@pytest.fixture
def fake_cuda(monkeypatch):
    current = _FakeStream()
    monkeypatch.setattr(torch.cuda, "Stream", _FakeStream)
    monkeypatch.setattr(torch.cuda, "Event", _FakeEvent)
    monkeypatch.setattr(torch.cuda, "stream", lambda s: contextlib.nullcontext())
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: current)
    monkeypatch.setattr(torch.cuda, "set_device", lambda device: None)
    monkeypatch.setattr(torch.Tensor, "record_stream", lambda self, s: None)
    # A device copy owns its memory: clone stands in for it.
    monkeypatch.setattr(
        RawBatch,
        "to",
        lambda self, device, non_blocking=False: RawBatch(
            **{k: v.clone() for k, v in self.tensors().items()}
        ),
    )
    # Make the Loader take its device path with this stand-in "device".
    monkeypatch.setattr(
        train_loader, "resolve_device", lambda d: None if d is None else torch.device("cpu")
    )
    return current


@pytest.fixture(scope="module")
def ds(tmp_path_factory):
    path = tmp_path_factory.mktemp("prefetch") / "ds"
    ds = hsstore.create(
        path,
        layers=[LayerSpec(depth=1), LayerSpec(depth=2)],
        hidden_size=16,
        dtype=torch.float16,
        model={
            "name": "toy",
            "revision": None,
            "num_hidden_layers": 2,
            "hidden_size": 16,
            "vocab_size": 9,
        },
    )
    g = torch.Generator().manual_seed(3)
    with ds.writer() as w:
        for k in range(30):
            t = int(torch.randint(1, 40, (1,), generator=g))
            w.add(
                f"s{k}",
                torch.randint(0, 9, (t,), generator=g),
                torch.ones(t, dtype=torch.int64),
                torch.randn(t, 2, 16, generator=g).half(),
            )
    return hsstore.open(path)


def test_staged_batches_stay_valid_and_match(ds, fake_cuda):
    cpu = Loader(ds.path, max_tokens=48, seed=1, prefetch=1)
    expected = [{k: v.clone() for k, v in b.items()} for b in cpu]  # CPU batches: clone to keep
    staged = Loader(ds.path, max_tokens=48, seed=1, prefetch=1, device="cuda")
    assert staged.device is not None
    got = list(staged)  # kept all at once: device batches must not share host buffers
    assert len(got) == len(expected)
    for g, e in zip(got, expected):
        assert g.keys() == e.keys()
        for k in e:
            assert torch.equal(g[k], e[k]), k
    assert fake_cuda.waited == len(expected)  # the consumer's stream waited on every copy


def test_staged_loader_stops_early_and_resumes(ds, fake_cuda):
    full = [b["sample_index"].tolist() for b in Loader(ds.path, max_tokens=48, device="cuda")]
    loader = Loader(ds.path, max_tokens=48, device="cuda")
    got = []
    for b in loader:
        got.append(b["sample_index"].tolist())
        if len(got) == 2:
            break
    state = loader.state_dict()
    again = Loader(ds.path, max_tokens=48, device="cuda")
    again.load_state_dict(state)
    got.extend(b["sample_index"].tolist() for b in again)
    assert got == full


def test_staged_loader_crosses_epochs_and_resumes_at_the_boundary(ds, fake_cuda):
    cpu = Loader(ds.path, max_tokens=48, seed=1)
    expected = [b["sample_index"].tolist() for b in cpu.iter_epochs(2)]
    n0 = len(cpu.plan(0))
    staged = Loader(ds.path, max_tokens=48, seed=1, device="cuda")
    got = []
    for b in staged.iter_epochs():
        got.append(b["sample_index"].tolist())
        if len(got) == n0:  # the last batch of epoch 0; epoch 1 is being staged already
            break
    state = staged.state_dict()
    assert (state["epoch"], state["step"]) == (0, n0)
    staged.close()
    again = Loader(ds.path, max_tokens=48, seed=1, device="cuda")
    again.load_state_dict(state)
    got.extend(b["sample_index"].tolist() for b in again.iter_epochs(2))
    assert got == expected
    assert fake_cuda.waited == len(expected)


def test_real_resolve_device_on_this_machine():
    if torch.cuda.is_available():
        assert prefetch_mod.resolve_device("cuda").type == "cuda"
    else:
        with pytest.warns(UserWarning, match="CUDA"):
            assert prefetch_mod.resolve_device("cuda") is None
    assert prefetch_mod.resolve_device(None) is None
    assert prefetch_mod.resolve_device("cpu") is None
    with pytest.raises(ValueError):
        prefetch_mod.resolve_device("meta")
