"""The loader's options: one frozen ``LoaderOptions``, shown in full by ``help(Loader)``."""

from __future__ import annotations

import dataclasses
import inspect
import pydoc

import pytest
import torch

import hsstore
from hsstore import LayerSpec
from hsstore.loader import HiddenStateStream, Loader, LoaderOptions, PlannedBatchSampler


@pytest.fixture(scope="module")
def path(tmp_path_factory):
    path = tmp_path_factory.mktemp("options") / "ds"
    ds = hsstore.create(path, layers=[LayerSpec(1), LayerSpec(2)], hidden_size=4,
                        dtype=torch.float32, model={"num_hidden_layers": 2})  # fmt: skip
    with ds.writer() as w:
        for k in range(6):
            t = 3 + k
            w.add(f"s{k}", torch.arange(t), torch.ones(t, dtype=torch.int64),
                  torch.full((t, 2, 4), float(k)))  # fmt: skip
    return path


@pytest.mark.parametrize("cls", [Loader, HiddenStateStream, PlannedBatchSampler])
def test_every_option_and_its_default_is_in_the_signature(cls):
    params = inspect.signature(cls).parameters
    fields = dataclasses.fields(LoaderOptions)
    assert len(fields) > 20
    for f in fields:
        assert f.name in params, f.name
        assert params[f.name].default == f.default, f.name
        assert params[f.name].kind is inspect.Parameter.KEYWORD_ONLY
    text = pydoc.render_doc(cls, renderer=pydoc.plaintext)
    assert "follow_poll_s: 'float' = 0.5" in text and "max_tokens: 'int' = 8192" in text


def test_options_travel_as_one_frozen_object(path):
    opts = LoaderOptions(max_tokens=16, seed=3, aux_layers=[0], rank=0, world_size=1)
    with pytest.raises(dataclasses.FrozenInstanceError):
        opts.seed = 4  # type: ignore[misc]
    assert opts.aux_layers == (0,)
    loader = Loader(path, opts, num_threads=1)
    assert loader.options is opts and loader.rank_plan.options is opts
    assert loader.config == opts.plan_config() and loader.config.seed == 3
    # Keywords over an options object replace its fields; the object itself is left as is.
    other = Loader(path, opts, seed=9, num_threads=1)
    assert other.options.seed == 9 and opts.seed == 3 and other.options.max_tokens == 16
    # The same options give the same batches whichever way they are passed.
    by_keywords = Loader(path, max_tokens=16, seed=3, aux_layers=[0], rank=0, world_size=1,
                         num_threads=1)  # fmt: skip
    a = [b["sample_index"].tolist() for b in loader]
    assert a == [b["sample_index"].tolist() for b in by_keywords] and len(a) > 1
    for ld in (loader, other, by_keywords):
        ld.close()


def test_an_unknown_or_bad_option_is_refused_where_it_is_given(path):
    with pytest.raises(TypeError, match="max_token'"):
        Loader(path, max_token=16)
    with pytest.raises(ValueError, match="follow_window"):
        LoaderOptions(follow=True, follow_window=0)
    with pytest.raises(ValueError, match="tail"):
        PlannedBatchSampler(path, tail="sometimes")
