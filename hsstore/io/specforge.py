"""SpecForge offline hidden states (``scripts/prepare_hidden_states.py``), read-only.

Layout: ``data_{i}.ckpt`` (or ``data_{i}.ckpt.gz`` with ``--compress``), usually grouped in
``rows_{a}-{b}`` subfolders. Each is a ``torch.save`` dict with ``input_ids`` ([T] or [1, T]),
``loss_mask`` (same), ``hidden_state`` [1, T, H] (the target's final state, after the final norm)
and ``aux_hidden_state`` [1, T, k*H] (k auxiliary layers concatenated in ascending layer order).

The files do not record which layers were captured, so the caller passes the aux layer ids in
SpecForge's own convention (the ids SpecForge hands to sglang, which captures the output of
layer v, i.e. depth v + 1) and the model's num_hidden_layers. The final state is stored as the
last layer, canonical (depth N, final_norm=True).
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from hsstore.errors import BadInputError
from hsstore.format.conventions import SPECFORGE, ConventionError, to_canonical
from hsstore.io.base import (
    SourceItem,
    SourceReader,
    check_finite,
    check_tokens,
    file_index,
    int_view,
    load_torch_file,
    natural_key,
    require_dir,
    require_keys,
    strip_suffix,
    unique_stems,
)

FORMAT = "specforge"
SUFFIXES = (".ckpt", ".ckpt.gz")
KEYS = ("input_ids", "loss_mask", "hidden_state", "aux_hidden_state")


def list_data_files(root: Path) -> list[Path]:
    files = [
        p
        for s in SUFFIXES
        for p in root.rglob(f"data_*{s}")
        if file_index(strip_suffix(p.name, SUFFIXES), "data_") is not None
    ]
    return sorted(set(files), key=lambda p: natural_key(strip_suffix(p.name, SUFFIXES)))


class SpecForgeReader(SourceReader):
    """Reads a SpecForge offline directory; see the module docstring."""

    format = FORMAT

    def __init__(
        self,
        path: str | os.PathLike,
        *,
        layer_ids: Sequence[int] | None = None,
        num_hidden_layers: int | None = None,
    ) -> None:
        self.path = require_dir(path)
        self._files = list_data_files(self.path)
        if not self._files:
            raise BadInputError(
                "no data_{i}.ckpt or data_{i}.ckpt.gz files found", path=str(self.path)
            )
        self._stems = list(unique_stems(self._files, self.path, SUFFIXES))
        if layer_ids is None or num_hidden_layers is None:
            raise BadInputError(
                "SpecForge files do not record their layers; pass --layer-ids (the aux layer "
                "ids given to SpecForge, e.g. 1,15,28) and --num-hidden-layers",
                path=str(self.path),
            )
        aux = sorted(int(v) for v in layer_ids)
        if not aux or len(set(aux)) != len(aux):
            raise BadInputError(
                f"layer ids must be distinct and non-empty, got {list(layer_ids)}",
                path=str(self.path),
            )
        self.aux_layer_ids = aux
        self.num_hidden_layers = num_hidden_layers
        try:
            self.layers = to_canonical(SPECFORGE, [*aux, num_hidden_layers], num_hidden_layers)
        except ConventionError as exc:
            raise BadInputError(str(exc), path=str(self.path)) from None
        if any(s.final_norm for s in self.layers[:-1]):
            raise BadInputError(
                f"aux layer id {num_hidden_layers} names the final state, which SpecForge stores separately",
                path=str(self.path),
            )
        self.hidden_size, self.dtype = self._probe()
        self.model = {
            "name": None,
            "num_hidden_layers": num_hidden_layers,
            "hidden_size": self.hidden_size,
        }

    def _probe(self) -> tuple[int, torch.dtype]:
        empty = None  # why no file could tell, named in the error
        for p in self._files:
            try:
                obj = load_torch_file(p)
            except BadInputError as exc:
                empty = empty or f"; {exc}"
                continue
            h = obj.get("hidden_state") if isinstance(obj, dict) else None
            if isinstance(h, torch.Tensor) and h.dim() >= 2 and h.dtype.is_floating_point:
                if h.shape[-1] == 0:
                    empty = empty or f"; {p}: hidden states of width 0"
                    continue
                return int(h.shape[-1]), h.dtype
        raise BadInputError(
            f"no readable data file to learn hidden size and dtype from{empty or ''}",
            path=str(self.path),
        )

    def __len__(self) -> int:
        return len(self._files)

    def names(self) -> list[str]:
        return [p.relative_to(self.path).as_posix() for p in self._files]

    def read(self, i: int) -> SourceItem:
        p = self._files[i]
        where = str(p)
        obj = require_keys(load_torch_file(p), KEYS, where)
        input_ids, loss_mask = check_tokens(
            obj["input_ids"], obj["loss_mask"], where, strict_dtype=False
        )
        t, h, k = len(input_ids), self.hidden_size, len(self.aux_layer_ids)
        final = self._squeeze(obj["hidden_state"], "hidden_state", t, h, where)
        aux = self._squeeze(obj["aux_hidden_state"], "aux_hidden_state", t, k * h, where)
        hidden = torch.empty((t, k + 1, h), dtype=self.dtype)
        dst = int_view(hidden)
        dst[:, :k, :] = int_view(aux).reshape(t, k, h)
        dst[:, k, :] = int_view(final)
        check_finite(hidden, where)
        return SourceItem(
            self._stems[i], p.relative_to(self.path).as_posix(), input_ids, loss_mask, hidden
        )

    def _squeeze(self, x: Any, key: str, t: int, width: int, where: str) -> torch.Tensor:
        if not isinstance(x, torch.Tensor):
            raise BadInputError(f"{key} is a {type(x).__name__}, expected a tensor", path=where)
        if x.dtype != self.dtype:
            raise BadInputError(f"{key} has dtype {x.dtype}, expected {self.dtype}", path=where)
        if x.dim() == 3 and x.shape[0] == 1:
            x = x[0]
        if x.dim() != 2 or x.shape[1] != width:
            raise BadInputError(
                f"{key} has shape {list(x.shape)}, expected [1, T, {width}]", path=where
            )
        if x.shape[0] != t:
            raise BadInputError(f"{key} has {x.shape[0]} tokens but input_ids has {t}", path=where)
        return x

    def provenance(self) -> dict[str, Any]:
        out = super().provenance()
        out["source_layer_ids"] = {
            "convention": SPECFORGE,
            "ids": [*self.aux_layer_ids, self.num_hidden_layers],
        }
        return out
