"""speculators 0.5+ offline data: an Arrow dataset plus ``hs_{i}.safetensors`` files.

Layout (speculators ``scripts/prepare_data.py`` + ``scripts/data_generation_offline.py``):

- the directory is a Hugging Face ``datasets`` ``save_to_disk`` folder: ``state.json``,
  ``dataset_info.json`` and ``data-XXXXX-of-XXXXX.arrow`` (Arrow IPC stream) with one row per
  sample and columns ``input_ids`` (list<int64>), ``loss_mask`` (list<int64|bool>), ``seq_len``;
- ``hidden_states/hs_{i}.safetensors`` holds row i's ``hidden_states`` [T, L, H] and
  ``token_ids`` [T] (which must equal the row's ``input_ids``). The folder may sit elsewhere
  (speculators' ``--hidden-states-path``, ``hs_connectors/transfer.py`` ``FileBackend``).
- the FP8 variant (hs-connectors 0.9 ``fp8_hidden_states_connector.py``) stores
  ``hidden_states`` as ``float8_e4m3fn`` plus ``hidden_states_scales`` fp32 [T, 1, 1]; this
  reader returns the fp8 states and the scales as they are (an hsstore ``float8_e4m3fn``
  dataset keeps both), and the writer writes them back unchanged (`hsstore.codec.fp8` holds the
  trainer's dequantizing arithmetic).

speculators 0.9's ``ArrowDataset`` (``speculators/train/data.py``, ``_get_raw_data``) takes every
layer but the last as the drafter's input and the last as the verifier's final (pre-norm) state,
so the writer here refuses datasets whose last layer is not depth N before the final norm.

The files do not record the layers. They come from vLLM's ``extract_hidden_states`` with
``eagle_aux_hidden_state_layer_ids`` (vLLM convention: id v = residual entering decoder layer v,
depth v; speculators' ``launch_vllm.py`` appends ``num_hidden_layers`` as the final, pre-norm
state), so the caller passes those ids; num_hidden_layers defaults to the largest id.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pyarrow as pa
import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save

from hsstore.codec import fp8 as fp8_states
from hsstore.dataset.dataset import Dataset
from hsstore.errors import BadInputError
from hsstore.interop.formats.base import (
    FLOAT_DTYPES,
    MINE,
    NOT_MINE,
    ForeignFormat,
    ForeignReader,
    ForeignSample,
    ForeignWriter,
    FormatOption,
    atomic_write,
    check_finite,
    check_hidden,
    check_tokens,
    has_file,
    write_json,
)
from hsstore.interop.formats.export_refusals import export_refusal, require_prenorm_final
from hsstore.spec.conventions import VLLM, ConventionError, from_canonical
from hsstore.spec.layers import LayerSpec

FORMAT = "speculators-arrow"
HS_DIR = "hidden_states"
SCALES_KEY = "hidden_states_scales"  # hs_connectors/fp8_utils.py SCALES_KEY
FP8_SAFETENSORS = "F8_E4M3"
_SAFETENSORS_DTYPES = {
    "BF16": torch.bfloat16,
    "F16": torch.float16,
    "F32": torch.float32,
    FP8_SAFETENSORS: fp8_states.FP8_DTYPE,  # kept as is, with its per-token scales
}


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

    def _open(
        self,
        layer_ids: Sequence[int] | None,
        num_hidden_layers: int | None,
        hidden_states_path: str | os.PathLike | None = None,
    ) -> None:
        self.hs_dir = Path(hidden_states_path) if hidden_states_path else self.path / HS_DIR
        if not self.hs_dir.is_dir():
            where = "--hidden-states-path" if hidden_states_path else f"{HS_DIR}/"
            raise BadInputError(
                f"no {where} folder of hs_{{i}}.safetensors files (pass --hidden-states-path "
                "when the states sit elsewhere)",
                path=str(self.hs_dir),
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
                "(vLLM eagle_aux_hidden_state_layer_ids plus the final layer N, e.g. 2,16,29,32)",
                path=str(self.path),
            )
        ids = [int(v) for v in layer_ids]
        if not ids or len(set(ids)) != len(ids):
            raise BadInputError(
                f"layer ids must be distinct and non-empty, got {ids}", path=str(self.path)
            )
        self.layer_ids = sorted(ids)
        self.hidden_size, self.dtype, self.fp8, stored_layers = self._probe()
        if stored_layers == len(ids) + 1:
            # speculators 0.9 (launch_vllm.py) appends num_hidden_layers to the aux ids itself.
            raise BadInputError(
                f"the files hold {stored_layers} layers but --layer-ids names {len(ids)}: did you "
                f"forget the final layer N in --layer-ids (e.g. {','.join(map(str, ids))},N)?",
                path=str(self.path),
            )
        if stored_layers != len(ids):
            raise BadInputError(
                f"the files hold {stored_layers} layers but --layer-ids names {len(ids)}",
                path=str(self.path),
            )
        n = num_hidden_layers if num_hidden_layers is not None else max(ids)
        self.num_hidden_layers = n
        self.layers = self._canonical(VLLM, self.layer_ids, n)
        self.model = {"name": None, "num_hidden_layers": n, "hidden_size": self.hidden_size}

    def _hs_path(self, i: int) -> Path:
        return self.hs_dir / f"hs_{i}.safetensors"

    def _probe(self) -> tuple[int, torch.dtype, bool, int]:
        """(hidden size, dtype, stored as fp8 with scales?, layers) from the first file."""
        for i in range(len(self)):
            p = self._hs_path(i)
            if not p.exists():
                continue
            try:
                with safe_open(str(p), framework="pt") as f:
                    sl = f.get_slice("hidden_states")
                    shape, dt = sl.get_shape(), sl.get_dtype()
                    fp8 = SCALES_KEY in set(f.keys())
            except (SafetensorError, OSError, KeyError):
                continue
            if dt == FP8_SAFETENSORS and not fp8:
                raise BadInputError(
                    f"float8 hidden_states without {SCALES_KEY!r}; cannot dequantize", path=str(p)
                )
            dtype = _SAFETENSORS_DTYPES.get(dt)
            if dtype is not None and len(shape) == 3:
                return int(shape[2]), dtype, fp8, int(shape[1])
        raise BadInputError(
            "no readable hs_{i}.safetensors file (bf16/fp16/fp32, or fp8 with "
            f"{SCALES_KEY}) to learn hidden size and dtype from",
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
                scales = f.get_tensor(SCALES_KEY) if SCALES_KEY in keys else None
        except SafetensorError as exc:
            raise BadInputError(
                f"corrupt or truncated safetensors file ({exc})", path=where
            ) from None
        if hidden.dtype == fp8_states.FP8_DTYPE:
            scales = check_scales(scales, len(input_ids), where)
        elif hidden.dtype not in FLOAT_DTYPES:
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
            f"hs_{i}",
            f"{HS_DIR}/hs_{i}.safetensors",
            input_ids,
            loss_mask,
            hidden,
            scales if hidden.dtype == fp8_states.FP8_DTYPE else None,
        )

    def provenance(self) -> dict[str, Any]:
        out = super().provenance()
        out["source_layer_ids"] = {"convention": VLLM, "ids": self.layer_ids}
        if self.hs_dir != self.path / HS_DIR:
            out["hidden_states_path"] = str(self.hs_dir)
        return out


def check_scales(scales: torch.Tensor | None, num_tokens: int, where: str) -> torch.Tensor:
    """The ``hidden_states_scales`` of an fp8 file as float32 [T], or BadInputError."""
    if scales is None:
        raise BadInputError(f"float8 hidden_states without {SCALES_KEY!r}", path=where)
    if scales.dtype != torch.float32 or list(scales.shape) != [num_tokens, 1, 1]:
        raise BadInputError(
            f"{SCALES_KEY} has {scales.dtype} {list(scales.shape)}, expected float32 "
            f"[{num_tokens}, 1, 1]",
            path=where,
        )
    check_finite(scales, where, what=SCALES_KEY)
    if not bool((scales > 0).all()):
        raise BadInputError(f"{SCALES_KEY} holds a scale <= 0", path=where)
    return scales.reshape(-1)


# --------------------------------------------------------------------------------- writing

ARROW_FILE = "data-00000-of-00001.arrow"
_COLUMNS_INFO = {  # datasets' `features` for the three columns speculators' ArrowDataset reads
    "input_ids": {"feature": {"dtype": "int64", "_type": "Value"}, "_type": "List"},
    "loss_mask": {"feature": {"dtype": "int64", "_type": "Value"}, "_type": "List"},
    "seq_len": {"dtype": "int64", "_type": "Value"},
}


def arrow_layer_ids(layers: Sequence[LayerSpec], num_hidden_layers: int, path: str) -> list[int]:
    """vLLM ids of a dataset's layers, or BadInputError saying why speculators cannot train on
    them (its trainer takes the last layer as the verifier's final, pre-norm state) and which
    ``--layers`` would have stored a dataset it can."""
    n = num_hidden_layers
    require_prenorm_final(FORMAT, layers, n, path)
    try:
        return from_canonical(VLLM, layers, n)
    except ConventionError as exc:
        raise export_refusal(FORMAT, str(exc), layers, n, path) from None


def write_hidden_states(
    path: Path, input_ids: torch.Tensor, hidden: torch.Tensor, *, fp8: bool
) -> None:
    """One ``hs_{i}.safetensors`` as vLLM's hidden-states connector (or hs-connectors' FP8 one)
    writes it: ``hidden_states`` [T, L, H], ``token_ids`` int64 [T] (+ fp8 ``hidden_states_scales``)."""
    tensors = {"hidden_states": hidden.contiguous(), "token_ids": input_ids.to(torch.int64)}
    if fp8:
        quantized, scales = fp8_states.quantize(hidden)
        tensors["hidden_states"], tensors[SCALES_KEY] = quantized, as_file_scales(scales, hidden)
    atomic_write(path, lambda f: f.write(save(tensors)))


def as_file_scales(scales: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
    """Per-token scales [T] shaped as hs-connectors stores them: [T, 1, 1] for [T, L, H]."""
    return scales.reshape(-1, *([1] * (hidden.dim() - 1))).contiguous()


def write_fp8_states(
    path: Path, input_ids: torch.Tensor, fp8: torch.Tensor, scales: torch.Tensor
) -> None:
    """One fp8 ``hs_{i}.safetensors`` from states already quantized (the bits as they are)."""
    tensors = {
        "hidden_states": fp8.contiguous(),
        "token_ids": input_ids.to(torch.int64),
        SCALES_KEY: as_file_scales(scales, fp8),
    }
    atomic_write(path, lambda f: f.write(save(tensors)))


def write_rows(out: Path, rows: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
    """The ``datasets.save_to_disk`` folder speculators' ``prepare_data`` writes (torch format)."""
    table = pa.table(
        {
            "input_ids": pa.array([r[0].tolist() for r in rows], type=pa.list_(pa.int64())),
            "loss_mask": pa.array([r[1].tolist() for r in rows], type=pa.list_(pa.int64())),
            "seq_len": pa.array([len(r[0]) for r in rows], type=pa.int64()),
        }
    )
    meta = {"huggingface": json.dumps({"info": {"features": _COLUMNS_INFO}})}
    table = table.replace_schema_metadata(meta)

    def write_arrow(f) -> None:
        with pa.ipc.new_stream(f, table.schema) as stream:
            stream.write_table(table)

    atomic_write(out / ARROW_FILE, write_arrow)
    write_json(out / "dataset_info.json", {"features": _COLUMNS_INFO})
    # speculators' preprocessing calls dataset.set_format(type="torch") before save_to_disk.
    state = {
        "_data_files": [{"filename": ARROW_FILE}],
        "_fingerprint": hashlib.sha256(table.to_string().encode()).hexdigest()[:16],
        "_format_columns": None,
        "_format_kwargs": {},
        "_format_type": "torch",
        "_output_all_columns": False,
        "_split": None,
    }
    write_json(out / "state.json", state)


class SpeculatorsArrowWriter(ForeignWriter):
    """Writes the layout speculators 0.9's ``ArrowDataset`` reads; ``fp8`` as hs-connectors."""

    format = FORMAT

    def __init__(
        self, ds: Dataset, out: Path, *, source: str, num_hidden_layers: int, fp8: bool = False
    ) -> None:
        self.ds, self.out, self.stores_fp8 = ds, out, fp8
        self.layer_ids = arrow_layer_ids(ds.layers, num_hidden_layers, source)

    def sample_path(self, k: int) -> Path:
        return self.out / HS_DIR / f"hs_{k}.safetensors"

    def is_own(self, relative: Path) -> bool:
        return relative.name in (ARROW_FILE, "dataset_info.json", "state.json", HS_DIR)

    def write(self, k: int, input_ids, loss_mask, hidden) -> None:
        (self.out / HS_DIR).mkdir(exist_ok=True)
        write_hidden_states(self.sample_path(k), input_ids, hidden, fp8=self.stores_fp8)

    def write_fp8(self, k: int, input_ids, fp8, scales) -> None:
        """Sample k of an fp8 dataset: its stored bits and per-token scales, not requantized."""
        (self.out / HS_DIR).mkdir(exist_ok=True)
        write_fp8_states(self.sample_path(k), input_ids, fp8, scales)

    def finish(self) -> None:
        write_rows(self.out, [self.ds.read_tokens(k) for k in range(len(self.ds))])

    def notes(self) -> list[str]:
        # speculators 0.9 speculators/train/config/schema.py (target_layer_ids, ~line 115): the
        # aux ids, "excluding the final layer launch_vllm.py appends".
        aux = ",".join(map(str, self.layer_ids[:-1]))
        return [
            f"vLLM layer ids {','.join(map(str, self.layer_ids))} (speculators' "
            f"--target-layer-ids {aux}; it appends the final layer {self.layer_ids[-1]} itself)"
            + (
                "; states are fp8: train with --hidden-states-backend fp8"
                if self.stores_fp8
                else ""
            )
        ]


def detect(folder: Path) -> int:
    arrow = has_file(folder, "*.arrow") or (folder / "state.json").exists()
    return MINE if (folder / HS_DIR).is_dir() and arrow else NOT_MINE


HIDDEN_STATES_PATH = FormatOption(
    "hidden_states_path",
    "--hidden-states-path",
    "the hs_{i}.safetensors folder when it is not DIR/hidden_states.",
)
FP8 = FormatOption(
    "fp8",
    "--fp8",
    "store float8_e4m3fn states with per-token scales, as hs-connectors' FP8 connector writes "
    "them.",
    is_flag=True,
)
FOREIGN_FORMAT = ForeignFormat(FORMAT, "Arrow dataset", detect, SpeculatorsArrowReader,
                               SpeculatorsArrowWriter, (HIDDEN_STATES_PATH,), (FP8,))  # fmt: skip
