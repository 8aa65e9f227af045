"""The transformers backend stores the states asked for whatever the list form of
``output_hidden_states`` returns on the installed release.

Releases disagree: some ignore a list and return all N + 1 states, some return N entries indexed
by decoder layer with no final state, some the N + 1 asked for with ``None`` elsewhere. The first
test runs the installed release as it is (scripts/test_transformers_versions.sh runs it under
each release hsstore declares); the others wrap the real model's forward so that a list gets one
of the wrong answers, and the stored states must still be the all-states forward's.
"""

from __future__ import annotations

import pytest
import torch
import transformers
from transformers import AutoModelForCausalLM, LlamaModel

from hsstore.demo_model import build_tiny_model
from hsstore.extractors.backends.transformers import TransformersBackend
from hsstore.extractors.chat_tokens import TokenizedPrompt
from hsstore.extractors.layer_select import parse_layers

N_LAYERS = 4
LAYERS = "1,3,final"  # hidden_states indices 1, 3 and 4 (= N, the normed final state)
INDICES = [1, 3, N_LAYERS]
RELEASE = tuple(int(p) for p in transformers.__version__.split(".")[:2])


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("tiny"), layers=N_LAYERS)


def prompts() -> list[TokenizedPrompt]:
    out = []
    for i, n in enumerate([5, 9]):
        ids = (torch.arange(n, dtype=torch.int64) * 7 + i) % 300 + 10
        out.append(TokenizedPrompt(f"s{i}", i, ids, torch.ones(n, dtype=torch.int64), "t", False))
    return out


def all_states(model_dir, prompt: TokenizedPrompt) -> list[torch.Tensor]:
    """The wanted entries of the all-states forward of one unpadded prompt."""
    model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    with torch.inference_mode():
        hs = model.model(
            input_ids=prompt.input_ids[None], output_hidden_states=True, use_cache=False
        ).hidden_states
    assert len(hs) == N_LAYERS + 1
    return [hs[i][0] for i in INDICES]


def extract(model_dir) -> list[torch.Tensor]:
    backend = TransformersBackend(str(model_dir), parse_layers(LAYERS, N_LAYERS))
    try:
        return [backend.run([p])[0] for p in prompts()]
    finally:
        backend.close()


def assert_stored_equal_all_states(model_dir, stored):
    for prompt, got in zip(prompts(), stored):
        want = all_states(model_dir, prompt)
        assert got.shape == (prompt.num_tokens, len(INDICES), 64)
        for pos, state in enumerate(want):
            assert torch.equal(got[:, pos], state), f"index {INDICES[pos]} differs"
        assert not torch.equal(got[:, 0], got[:, 1])  # a mix-up of layers could not pass


def test_installed_release_stores_the_states_asked_for(tiny):
    assert_stored_equal_all_states(tiny, extract(tiny))


def wrap_list_form(monkeypatch, answer):
    """Make LlamaModel answer a list of indices with ``answer(all_states, indices)``."""
    forward = LlamaModel.forward
    asked: list[list[int]] = []

    def wrapped(self, *args, output_hidden_states=None, **kwargs):
        if not isinstance(output_hidden_states, list):
            return forward(self, *args, output_hidden_states=output_hidden_states, **kwargs)
        asked.append(output_hidden_states)
        out = forward(self, *args, output_hidden_states=True, **kwargs)
        out.hidden_states = answer(out.hidden_states, set(output_hidden_states))
        return out

    monkeypatch.setattr(LlamaModel, "forward", wrapped)
    return asked


def by_decoder_layer(every, wanted):
    """N entries, entry i the output of decoder layer i, no embedding and no final state."""
    return tuple(every[i + 1] if i in wanted else None for i in range(len(every) - 1))


def shifted_by_one(every, wanted):
    """The right count, every wanted entry one layer too deep: only content can tell."""
    return tuple(
        every[min(i + 1, len(every) - 1)] if i in wanted else None for i in range(len(every))
    )


@pytest.mark.parametrize("answer", [by_decoder_layer, shifted_by_one])
def test_a_wrong_list_form_is_never_stored(tiny, monkeypatch, answer):
    asked = wrap_list_form(monkeypatch, answer)
    stored = extract(tiny)
    assert asked or RELEASE < (5, 0), "the list form was never tried: nothing was tested"
    assert_stored_equal_all_states(tiny, stored)


def test_a_right_list_form_is_used(tiny, monkeypatch):
    """Where the list comes back right, every forward asks only for the wanted states."""
    if RELEASE < (5, 0):
        pytest.skip(f"transformers {transformers.__version__} takes a bool only")

    def exact(every, wanted):
        return tuple(s if i in wanted else None for i, s in enumerate(every))

    asked = wrap_list_form(monkeypatch, exact)
    stored = extract(tiny)
    assert len(asked) == 1 + len(prompts()) and all(a == INDICES for a in asked)
    assert_stored_equal_all_states(tiny, stored)
