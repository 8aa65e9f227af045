"""The real-activation benchmark data: every sample distinct, whatever the corpus repeats."""

from __future__ import annotations

import itertools

import pytest
import torch

from tools import real_states

_TEXT = "Return the number of items in a container, counting every element once. " * 3
_OTHER = "Open the file and return a stream; raise OSError when it cannot be opened. " * 3


def test_corpus_never_repeats_a_paragraph():
    texts = list(itertools.islice(real_states.corpus(), 400))
    assert len(texts) == 400  # enough for the peer race's 300 samples, with room to spare
    assert len(set(texts)) == len(texts)


def test_samples_with_the_same_tokens_count_once(monkeypatch):
    # The second text repeats the first up to max_tokens: the same sample after truncation.
    texts = [_TEXT, _TEXT + " And then some more words.", _TEXT, _OTHER]
    monkeypatch.setattr(real_states, "corpus", lambda: iter(texts))
    samples = real_states.minilm_states(2, layers=(0, 6), max_tokens=24)
    assert [tuple(s.shape) for _, s in samples] == [(24, 2, 384), (24, 2, 384)]
    assert not torch.equal(samples[0][0], samples[1][0])
    assert samples[0][1].dtype == torch.bfloat16
    with pytest.raises(ValueError, match="fewer than 3 distinct samples"):
        real_states.minilm_states(3, layers=(0, 6), max_tokens=24)
