"""A local Hugging Face model folder, read one named tensor at a time.

The audit (output head), SpecForge export (final norm) and the reference trainer (embedding,
norm, head) each need a few tensors of the target model, never the whole model. This is where
``config.json`` is read and a tensor name is found, through the shard index
(``model.safetensors.index.json``) or the headers of the ``*.safetensors`` files themselves.
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from functools import cached_property
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

from hsstore.errors import BadInputError, no_such_path


class ModelFolder:
    """``config.json`` and the safetensors weights of the model in ``model_dir``.

    Every problem (no folder, no or bad config.json, unreadable index or weights) is a
    BadInputError naming the file.
    """

    def __init__(self, model_dir: str | os.PathLike[str]):
        self.root = Path(model_dir)
        if not self.root.is_dir():
            if not self.root.exists():
                raise no_such_path(self.root)
            raise BadInputError("not a directory (a model folder is)", path=str(self.root))
        self.config = read_config(self.root)
        # Multimodal wrappers keep the language model's settings under text_config.
        self.text_config: dict = self.config.get("text_config") or self.config

    @property
    def model_type(self) -> str:
        return str(self.text_config.get("model_type") or self.config.get("model_type") or "")

    def first(self, names: Sequence[str]) -> str | None:
        """The first of ``names`` the weights hold, or None."""
        return next((n for n in names if n in self._files), None)

    def __contains__(self, name: str) -> bool:
        return name in self._files

    def where(self, name: str) -> str:
        """``file:tensor``, to name a tensor in messages."""
        return f"{self._files[name]}:{name}"

    def tensor(self, name: str) -> torch.Tensor:
        path = self._files[name]
        try:
            with safe_open(str(path), framework="pt") as st:
                return st.get_tensor(name)
        except (SafetensorError, OSError, ValueError, RuntimeError) as exc:
            raise BadInputError(f"cannot read tensor {name} ({exc})", path=str(path)) from None

    @cached_property
    def _files(self) -> dict[str, Path]:
        """Tensor name -> safetensors file, from the shard index or the files' headers."""
        index = self.root / "model.safetensors.index.json"
        if index.is_file():
            try:
                weight_map = json.loads(index.read_text())["weight_map"]
                return {k: self.root / v for k, v in weight_map.items()}
            except (KeyError, TypeError, AttributeError, ValueError, OSError) as exc:
                raise BadInputError(f"unreadable shard index ({exc})", path=str(index)) from None
        files = sorted(self.root.glob("*.safetensors"))
        if not files:
            raise BadInputError(
                "no *.safetensors weights in the model directory", path=str(self.root)
            )
        out: dict[str, Path] = {}
        for f in files:
            try:
                with safe_open(str(f), framework="pt") as st:
                    out.update(dict.fromkeys(st.keys(), f))
            except (SafetensorError, OSError) as exc:
                raise BadInputError(f"unreadable safetensors file ({exc})", path=str(f)) from None
        return out


def read_config(root: Path) -> dict:
    """The model folder's ``config.json`` as a dict, or BadInputError naming what is wrong."""
    path = root / "config.json"
    if not path.is_file():
        raise BadInputError("no config.json: not a Hugging Face model directory", path=str(root))
    try:
        config = json.loads(path.read_text())
    except (UnicodeDecodeError, ValueError, OSError) as exc:
        raise BadInputError(f"config.json is not valid JSON ({exc})", path=str(path)) from None
    if not isinstance(config, dict):
        raise BadInputError("config.json is not a JSON object", path=str(path))
    return config
