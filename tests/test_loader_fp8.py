"""Batches of fp8 datasets: decoded in their stored form (fp8 states and scales), dequantized
once per batch on the host, or after the copy where the batch goes (`hsstore.loader.dequant`),
and in every case bit for bit the values of dequantizing `Dataset.get`'s states by hand.

The device path runs on the CPU here: the CUDA stream, event and copy are stood in for by
tests/test_loader_prefetch.py's fixture, and the dequantization after the copy is the very
function the CUDA path runs (tools/gpu_check_loader.py compares the two on a GPU).
"""

from __future__ import annotations

import pytest
import torch

import hsstore
from hsstore.codec import fp8
from hsstore.loader import Loader
from hsstore.loader.dequant import dequantize_batch, to_device
from hsstore.loader.fetch import BatchFetcher
from hsstore.spec.layers import LayerSpec
from tests.test_interop_speculators import bits
from tests.test_loader_prefetch import fake_cuda  # noqa: F401  (a fixture)
from tools.synthetic import llm_like_states

H = 256  # per-token rows of 4 layers reach the CPU's table path; per-layer rows do not
LAYERS = [LayerSpec(1), LayerSpec(2), LayerSpec(3), LayerSpec(4)]
TIERS = ("fp8-token", "fp8-token-layer")
# (aux layers, verifier): every layer in storage order, and a subset with the verifier last.
CHOICES = ((None, True), ([0, 2], True), ([1], False))


@pytest.fixture(scope="module", params=TIERS)
def ds(request, tmp_path_factory):
    path = tmp_path_factory.mktemp("fp8") / request.param
    ds = hsstore.create(path, layers=LAYERS, hidden_size=H, dtype="bf16",
                        model={"num_hidden_layers": 4}, tier=request.param)  # fmt: skip
    g = torch.Generator().manual_seed(7)
    with ds.writer() as w:
        for k in range(14):
            t = int(torch.randint(2, 40, (1,), generator=g))
            hidden = llm_like_states(t, len(LAYERS), H, seed=k)
            w.add(f"s{k}", torch.randint(0, 99, (t,), generator=g), torch.ones(t).long(), hidden)
    return hsstore.open(path)


def by_hand(ds: hsstore.Dataset, i: int) -> torch.Tensor:
    """hs-connectors' dequantization of the stored fp8 states and scales of sample ``i``."""
    s = ds.get(ds.sample_ids[i])
    assert s.hidden.dtype == torch.float8_e4m3fn
    scale = s.scales.to(torch.bfloat16).reshape(s.num_tokens, -1, 1)
    return s.hidden.to(torch.bfloat16) * scale


def check_batch(ds, batch, aux, verifier, max_tokens) -> set[int]:
    """Every token of every sample of ``batch`` holds the by-hand values; the samples seen."""
    aux = [0, 1, 2] if aux is None else aux
    assert batch["hidden_states"].dtype == torch.bfloat16
    b, t = batch["input_ids"].shape
    hidden = batch["hidden_states"].reshape(b, t, len(aux), H)
    seen = set()
    for d, i in enumerate(batch["sample_index"].tolist()):
        values = by_hand(ds, i)[:max_tokens]
        row, where = (0, batch["document_ids"][0] == d) if b == 1 else (d, None)
        cols = (
            where.nonzero().flatten()
            if where is not None
            else torch.arange(int(batch["lengths"][d]))
        )
        assert len(cols) == len(values)
        assert bits(hidden[row, cols]) == bits(values[:, aux])
        if verifier:
            assert bits(batch["verifier_last_hidden_states"][row, cols]) == bits(values[:, 3])
        pad = torch.ones(t, dtype=torch.bool)
        pad[cols] = False
        if b > 1:  # the rest of a padded row is zero
            assert not hidden[row, pad].any()
        seen.add(i)
    return seen


def test_the_table_dequantization_is_hs_connectors_arithmetic_bit_for_bit():
    """The CPU's table path against ``fp8.to(bf16) * scale.to(bf16)``: every code (NaN and
    subnormals included) under scales across bf16's range, per token and per token and
    layer, rows long (one lookup per row) and short (blocks of rows)."""
    g = torch.Generator().manual_seed(1)
    codes = torch.arange(256, dtype=torch.uint8)
    for t, n_layers, h, per_layer in ((6, 2, 4096, True), (40, 4, 1024, False),
                                      (300, 4, 1024, True)):  # fmt: skip
        states = codes[torch.randint(0, 256, (t, n_layers, h), generator=g)]
        states[0, 0, :256] = codes
        states = states.view(torch.float8_e4m3fn)
        scales = torch.exp2(torch.randn(t, n_layers if per_layer else 1, generator=g) * 40)
        scales[0, 0], scales[1, -1] = 1e-12, 3e38  # the smallest scale; overflow to inf
        want = states.to(torch.bfloat16) * scales.to(torch.bfloat16)[:, :, None]
        assert fp8._by_table(states, scales.to(torch.bfloat16)[:, :, None], None)
        assert bits(fp8.dequantize(states, scales.reshape(t, -1))) == bits(want)
        out = torch.empty(states.shape, dtype=torch.bfloat16)
        fp8.dequantize(states, scales, out=out)
        assert bits(out) == bits(want)


@pytest.mark.parametrize(("aux", "verifier"), CHOICES)
@pytest.mark.parametrize("packed", [True, False])
def test_host_batches_are_the_values_dequantized_by_hand(ds, aux, verifier, packed):
    opts = dict(aux_layers=aux, verifier=verifier, seed=3, shuffle=True)
    if packed:
        opts.update(max_tokens=48)  # samples of up to 40 tokens: some batches cut none
    else:
        opts.update(max_tokens=32, batch_size=3)  # longer samples are truncated
    seen = set()
    for threads in (1, 2):
        for batch in Loader(ds.path, num_threads=threads, **opts):
            seen |= check_batch(ds, batch, aux, verifier, opts["max_tokens"])
    assert seen == set(range(len(ds)))


@pytest.mark.parametrize(("aux", "verifier"), CHOICES[:2])
@pytest.mark.parametrize("packed", [True, False])
def test_device_batches_cross_in_stored_form_and_match_the_host_ones(
    ds,
    fake_cuda,  # noqa: F811  (the fixture imported above)
    aux,
    verifier,
    packed,
):
    opts = dict(aux_layers=aux, verifier=verifier, seed=4, max_tokens=48)
    if not packed:
        opts.update(batch_size=2)
    host = [{k: v.clone() for k, v in b.items()} for b in Loader(ds.path, **opts)]
    staged = Loader(ds.path, device="cuda", num_threads=2, **opts)
    got = list(staged)  # fresh "device" batches: all kept at once
    assert len(got) == len(host) > 1
    for g, h in zip(got, host, strict=True):
        assert g.keys() == h.keys()
        for k in h:
            assert g[k].dtype == h[k].dtype and bits(g[k]) == bits(h[k]), k
        check_batch(ds, g, aux, verifier, 48)
    assert fake_cuda.waited == len(host)


def test_the_stored_form_is_fp8_and_scales_and_dequantizes_anywhere(ds):
    """What crosses to a device: fp8 states (half the bytes of bf16) and float32 scales; the
    function run after the copy gives the host path's values on any device."""
    loader = Loader(ds.path, max_tokens=48, aux_layers=[2, 0], seed=1)
    width = 1 if ds.manifest.tier.name == "fp8-token" else 3
    plan = loader.plan()  # epoch 0's, as the loader delivers it below
    fetcher = BatchFetcher(loader.source, loader.choice, loader.shape,
                           [plan.batch(j) for j in range(len(plan))],
                           num_threads=2, reuse_buffers=False, dequantize=False)  # fmt: skip
    values = [{k: v.clone() for k, v in b.items()} for b in loader]
    for raw, want in zip(fetcher, values, strict=True):
        assert raw.hidden.dtype == torch.float8_e4m3fn
        assert raw.scales.dtype == torch.float32 and raw.scales.shape[-1] == width
        for out in (to_device(raw, torch.device("cpu")), dequantize_batch(raw)):
            assert out.scales is None
            assert bits(out.hidden) == bits(want["per_layer_hidden_states"])


@pytest.mark.usefixtures("fake_cuda")  # "cuda": the stand-in device
@pytest.mark.parametrize("device", [None, "cuda"])
def test_worker_processes_deliver_the_same_values(ds, device):
    opts = dict(max_tokens=48, seed=2, aux_layers=[0, 2])
    host = [{k: v.clone() for k, v in b.items()} for b in Loader(ds.path, **opts)]
    got = [{k: v.clone() for k, v in b.items()}
           for b in Loader(ds.path, workers=1, device=device, **opts)]  # fmt: skip
    assert len(got) == len(host)
    for g, h in zip(got, host, strict=True):
        for k in h:
            assert bits(g[k]) == bits(h[k]), k


def test_scales_of_a_batch_across_segments_are_the_samples_heads(tmp_path):
    ds = hsstore.create(tmp_path / "ds", layers=LAYERS, hidden_size=8, dtype="bf16",
                        model={"num_hidden_layers": 4}, tier="fp8-token-layer")  # fmt: skip
    for part in range(2):  # one segment per writer
        with ds.writer() as w:
            for k in range(3):
                t = 4 + k
                hidden = llm_like_states(t, len(LAYERS), 8, seed=10 * part + k)
                w.add(f"s{part}-{k}", torch.arange(t), torch.ones(t).long(), hidden)
    ds = hsstore.open(ds.path)
    assert len(set(ds.index.column("segment").to_pylist())) == 2
    positions, takes = [4, 0, 5], [3, 4, 6]
    (scales,) = ds.read_columns_many(positions, takes, ["scales"])
    want = torch.cat([ds[i].scales[:n] for i, n in zip(positions, takes, strict=True)])
    assert scales.shape == (sum(takes), len(LAYERS))
    assert bits(torch.from_numpy(scales)) == bits(want)
