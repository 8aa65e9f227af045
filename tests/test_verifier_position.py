"""One rule says which stored state is the verifier's; the loader, trainer and audit agree."""

from __future__ import annotations

import itertools

import pytest

from hsstore.audit.checks import check_model_depth
from hsstore.loader.dataset_handle import LayerChoice
from hsstore.spec.layers import LayerSpec, verifier_position
from hsstore.trainers.eagle3.train import split_layers

PRE, NORMED = LayerSpec(8), LayerSpec(8, final_norm=True)


@pytest.mark.parametrize(
    "layers", [list(p) for p in itertools.permutations([LayerSpec(2), LayerSpec(5), PRE, NORMED])]
)
def test_every_caller_picks_the_normed_final_state_in_any_order(layers):
    want = layers.index(NORMED)  # the state the target's head reads
    assert verifier_position(layers) == want
    assert LayerChoice.resolve(layers, None, verifier=True).verifier == want
    aux, verifier = split_layers(layers, 8, need_last=True)
    assert verifier == want and sorted(aux) == sorted(set(range(4)) - {want})
    # the order the engines feed fc in: shallowest first, whatever the stored order
    assert [layers[i].depth for i in aux] == [2, 5, 8]
    depth = check_model_depth(layers, recorded=8, model_layers=4)
    assert depth.verdict.value == "FAIL" and "labelled after 8 +final_norm of 8" in depth.reason


def test_deepest_wins_over_an_earlier_normed_state():
    layers = [LayerSpec(3, final_norm=True), LayerSpec(6)]
    assert verifier_position(layers) == 1
    with pytest.raises(ValueError, match="at least one layer"):
        verifier_position([])
