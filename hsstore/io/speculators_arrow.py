"""speculators 0.5+ offline data: an Arrow dataset plus ``hs_{i}.safetensors`` files, read-only.

Layout (speculators ``scripts/prepare_data.py`` + ``scripts/data_generation_offline.py``):

- the directory is a Hugging Face ``datasets`` ``save_to_disk`` folder: ``state.json``,
  ``dataset_info.json`` and ``data-XXXXX-of-XXXXX.arrow`` (Arrow IPC stream) with one row per
  sample and columns ``input_ids`` (list<int64>), ``loss_mask`` (list<int64|bool>), ``seq_len``;
- ``hidden_states/hs_{i}.safetensors`` holds row i's ``hidden_states`` [T, L, H] and
  ``token_ids`` [T] (which must equal the row's ``input_ids``).

The files do not record the layers. They come from vLLM's ``extract_hidden_states`` with
``eagle_aux_hidden_state_layer_ids`` (vLLM convention: id v = residual entering decoder layer v,
depth v; speculators' ``launch_vllm.py`` appends ``num_hidden_layers`` as the final, pre-norm
state), so the caller passes those ids; num_hidden_layers defaults to the largest id.
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pyarrow as pa
import torch
from safetensors import SafetensorError, safe_open

from hsstore.errors import BadInputError
from hsstore.format.conventions import VLLM, ConventionError, to_canonical
from hsstore.io.base import (
    FLOAT_DTYPES,
    ForeignReader,
    ForeignSample,
    check_hidden,
    check_tokens,
    require_dir,
)

FORMAT = "speculators-arrow"
HS_DIR = "hidden_states"


def arrow_files(root: Path) -> list[Path]:
    """The dataset's Arrow shards in row order (``state.json`` lists them when present)."""
    state = root / "state.json"
    if state.exists():
        try:
            files = [root / d["filename"] for d in json.loads(state.read_text())["_data_files"]]
        except (json.JSONDecodeError, KeyError, TypeError) as exc:
            raise BadInputError(
                f"unreadable datasets state.json ({exc})", path=str(state)
            ) from None
        return files
    return sorted(root.glob("*.arrow"))


def read_arrow_table(files: list[Path]) -> pa.Table:
    tables = []
    for f in files:
        try:
            with pa.memory_map(str(f)) as src:
                try:
                    tables.append(pa.ipc.open_stream(src).read_all())
                except pa.ArrowInvalid:
                    src.seek(0)
                    tables.append(pa.ipc.open_file(src).read_all())
        except FileNotFoundError:
            raise BadInputError("Arrow shard is missing", path=str(f)) from None
        except (pa.ArrowInvalid, OSError) as exc:
            raise BadInputError(f"not a readable Arrow file ({exc})", path=str(f)) from None
    if not tables:
        raise BadInputError("no Arrow files found", path=str(files[0].parent if files else "."))
    return pa.concat_tables(tables)


class SpeculatorsArrowReader(ForeignReader):
    """Reads a speculators 0.5+ dataset directory; see the module docstring."""

    format = FORMAT

    def __init__(
        self,
        path: str | os.PathLike,
        *,
        layer_ids: Sequence[int] | None = None,
        num_hidden_layers: int | None = None,
    ) -> None:
        self.path = require_dir(path)
        self.hs_dir = self.path / HS_DIR
        if not self.hs_dir.is_dir():
            raise BadInputError(
                f"no {HS_DIR}/ folder of hs_{{i}}.safetensors files", path=str(self.path)
            )
        files = arrow_files(self.path)
        if not files:
            raise BadInputError("no Arrow files (data-*.arrow) found", path=str(self.path))
        table = read_arrow_table(files)
        for col in ("input_ids", "loss_mask"):
            if col not in table.column_names:
                raise BadInputError(f"Arrow dataset has no {col!r} column", path=str(self.path))
        self._input_ids = table.column("input_ids").combine_chunks()
        self._loss_mask = table.column("loss_mask").combine_chunks()
        if layer_ids is None:
            raise BadInputError(
                "speculators 0.5+ data does not record its layers; pass --layer-ids "
                "(vLLM eagle_aux_hidden_state_layer_ids, e.g. 2,16,29,32)",
                path=str(self.path),
            )
        ids = [int(v) for v in layer_ids]
        if not ids or len(set(ids)) != len(ids):
            raise BadInputError(
                f"layer ids must be distinct and non-empty, got {ids}", path=str(self.path)
            )
        self.layer_ids = sorted(ids)
        n = num_hidden_layers if num_hidden_layers is not None else max(ids)
        self.num_hidden_layers = n
        try:
            self.layers = to_canonical(VLLM, self.layer_ids, n)
        except ConventionError as exc:
            raise BadInputError(str(exc), path=str(self.path)) from None
        self.hidden_size, self.dtype = self._probe()
        self.model = {"name": None, "num_hidden_layers": n, "hidden_size": self.hidden_size}

    def _hs_path(self, i: int) -> Path:
        return self.hs_dir / f"hs_{i}.safetensors"

    def _probe(self) -> tuple[int, torch.dtype]:
        for i in range(len(self)):
            p = self._hs_path(i)
            if not p.exists():
                continue
            try:
                with safe_open(str(p), framework="pt") as f:
                    sl = f.get_slice("hidden_states")
                    shape, dt = sl.get_shape(), sl.get_dtype()
            except (SafetensorError, OSError, KeyError):
                continue
            dtype = {"BF16": torch.bfloat16, "F16": torch.float16, "F32": torch.float32}.get(dt)
            if dtype is not None and len(shape) == 3:
                return int(shape[2]), dtype
        raise BadInputError(
            "no readable hs_{i}.safetensors file to learn hidden size and dtype from",
            path=str(self.hs_dir),
        )

    def __len__(self) -> int:
        return len(self._input_ids)

    def names(self) -> list[str]:
        return [f"{HS_DIR}/hs_{i}.safetensors" for i in range(len(self))]

    def read(self, i: int) -> ForeignSample:
        p = self._hs_path(i)
        where = str(p)
        row_ids = torch.from_numpy(self._input_ids[i].values.to_numpy(zero_copy_only=False).copy())
        row_mask = torch.from_numpy(self._loss_mask[i].values.to_numpy(zero_copy_only=False).copy())
        input_ids, loss_mask = check_tokens(row_ids, row_mask, where, strict_dtype=False)
        if not p.exists():
            raise BadInputError("file is missing (no hidden states for this row)", path=where)
        try:
            with safe_open(where, framework="pt") as f:
                keys = set(f.keys())
                missing = [k for k in ("hidden_states", "token_ids") if k not in keys]
                if missing:
                    raise BadInputError(
                        f"missing key(s) {missing}; found {sorted(keys)}", path=where
                    )
                hidden = f.get_tensor("hidden_states")
                token_ids = f.get_tensor("token_ids")
        except SafetensorError as exc:
            raise BadInputError(
                f"corrupt or truncated safetensors file ({exc})", path=where
            ) from None
        if hidden.dtype not in FLOAT_DTYPES:
            raise BadInputError(
                f"hidden_states has dtype {hidden.dtype}, expected a float type", path=where
            )
        t = len(input_ids)
        if token_ids.dim() != 1 or not torch.equal(token_ids.to(torch.int64), input_ids):
            raise BadInputError("token_ids do not match the dataset row's input_ids", path=where)
        if hidden.dim() == 3 and hidden.shape[0] != t:
            raise BadInputError(
                f"hidden_states has {hidden.shape[0]} tokens but input_ids has {t}", path=where
            )
        check_hidden(hidden, t, len(self.layers), self.hidden_size, self.dtype, where)
        return ForeignSample(
            f"hs_{i}", f"{HS_DIR}/hs_{i}.safetensors", input_ids, loss_mask, hidden
        )

    def provenance(self) -> dict[str, Any]:
        out = super().provenance()
        out["source_layer_ids"] = {"convention": VLLM, "ids": self.layer_ids}
        return out
