"""SpecForge offline hidden states (``scripts/prepare_hidden_states.py``): reader and writer.

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

from hsstore.dataset.dataset import Dataset
from hsstore.errors import BadInputError
from hsstore.interop.formats.base import (
    MINE,
    NOT_MINE,
    FileListReader,
    ForeignFormat,
    ForeignSample,
    ForeignWriter,
    FormatOption,
    atomic_write,
    check_finite,
    check_tokens,
    file_index,
    has_file,
    int_view,
    natural_key,
    strip_suffix,
    unique_stems,
)
from hsstore.interop.formats.export_refusals import export_refusal
from hsstore.interop.formats.final_norm import FinalNorm, load_final_norm
from hsstore.spec.conventions import SPECFORGE, ConventionError, from_canonical
from hsstore.spec.layers import LayerSpec

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


class SpecForgeReader(FileListReader):
    """Reads a SpecForge offline directory; see the module docstring."""

    format = FORMAT
    _keys = KEYS

    def _open(self, layer_ids: Sequence[int] | None, num_hidden_layers: int | None) -> None:
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
        self.layers = self._canonical(SPECFORGE, [*aux, num_hidden_layers], num_hidden_layers)
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

    @staticmethod
    def _shape_of(obj: Any) -> tuple[int, torch.dtype] | str | None:
        h = obj.get("hidden_state") if isinstance(obj, dict) else None
        if isinstance(h, torch.Tensor) and h.dim() >= 2 and h.dtype.is_floating_point:
            return "hidden states of width 0" if h.shape[-1] == 0 else (int(h.shape[-1]), h.dtype)
        return None

    def read(self, i: int) -> ForeignSample:
        p = self._files[i]
        where, obj = self._load(i, self._keys)
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
        return ForeignSample(
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


# --------------------------------------------------------------------------------- writing

GROUP_SIZE = 2000  # scripts/prepare_hidden_states.py groups files in rows_{g}-{g+2000} folders
NUM_AUX = 3  # SpecForge's EAGLE-3 drafter fuses exactly three aux layers (fc is 3H -> H)


def sample_relpath(k: int) -> str:
    """Where an export puts sample ``k``, relative to the export's root."""
    g = k // GROUP_SIZE * GROUP_SIZE
    return f"rows_{g}-{g + GROUP_SIZE}/data_{k}.ckpt"


def reader_order(n: int) -> list[int]:
    """Sample indices of an export of ``n`` samples in the order SpecForge's
    ``OfflineManifestReader`` lists them: it sorts the file paths as text (``list_feature_files``),
    so ``data_10`` comes before ``data_2`` and ``rows_10000-12000`` before ``rows_2000-4000``."""
    return sorted(range(n), key=sample_relpath)


def specforge_layout(layers: Sequence[LayerSpec], num_hidden_layers: int, path: str) -> list[int]:
    """SpecForge aux ids of a dataset's layers, or BadInputError saying why it cannot hold them
    and which ``--layers`` would have stored a dataset it can."""
    n = num_hidden_layers
    *aux, final = layers

    def refuse(why: str) -> BadInputError:
        # three aux layers kept as they are; otherwise the default choice, which has three
        keep = layers if len({s.depth for s in aux if s.depth < n}) == NUM_AUX else []
        return export_refusal(FORMAT, why, keep, n, path)

    if len(aux) != NUM_AUX or final.depth != n:
        raise refuse(
            f"it needs exactly {NUM_AUX} aux layers plus the final state (after {n}) last, but "
            f"this dataset stores {[s.label for s in layers]}"
        )
    depths = [s.depth for s in aux]
    if depths != sorted(set(depths)) or any(s.final_norm for s in aux):
        raise refuse(
            "its aux layers are concatenated in ascending order, but this dataset stores "
            f"{[s.label for s in aux]}"
        )
    try:
        ids = from_canonical(SPECFORGE, aux, n)
    except ConventionError as exc:
        raise refuse(str(exc)) from None
    return ids


def specforge_features(
    input_ids: torch.Tensor,
    loss_mask: torch.Tensor,
    hidden: torch.Tensor,
    norm: FinalNorm | None,
) -> dict[str, torch.Tensor]:
    """One sample as SpecForge's offline files hold it, from hsstore's [T, 3 + 1, H] states."""
    t, _, h = hidden.shape
    final = hidden[:, NUM_AUX, :]
    if norm is not None:
        final = norm(final)
    return {
        "input_ids": input_ids.to(torch.int64).contiguous().clone(),
        "loss_mask": loss_mask.to(torch.int64).contiguous().clone(),
        "hidden_state": final.contiguous().clone().unsqueeze(0),
        "aux_hidden_state": hidden[:, :NUM_AUX, :].reshape(t, NUM_AUX * h).clone().unsqueeze(0),
    }


def check_final_norm(
    layers: Sequence[LayerSpec],
    num_hidden_layers: int,
    norm: FinalNorm | None,
    path: str,
    recorded_model: str | None = None,
) -> FinalNorm | None:
    """The norm to apply to the final state (None when it is stored after the norm), or
    BadInputError when it is needed and missing or belongs to another model."""
    if layers[-1].final_norm:
        return None
    if norm is None:
        where = (
            f" (the dataset records the model as {recorded_model!r}, which is not a model folder "
            "here)"
            if recorded_model
            else ""
        )
        raise BadInputError(
            "the final state is stored before the final norm, but SpecForge needs it after "
            "(its target head is the lm_head alone); pass --target MODEL_DIR so the model's "
            f"final RMSNorm can be applied{where}",
            path=path,
        )
    if norm.num_hidden_layers not in (None, num_hidden_layers):
        raise BadInputError(
            f"--target has {norm.num_hidden_layers} decoder layers but the dataset's model "
            f"has {num_hidden_layers}: is this the dataset's target model?",
            path=norm.source,
        )
    return norm


def recorded_model_folder(ds: Dataset) -> str | None:
    """The model folder the dataset records (``hsstore extract --model``) when it is one here."""
    name = ds.manifest.model.name if ds.manifest.model else None
    if name and os.path.isfile(os.path.join(name, "config.json")):
        return name
    return None


class SpecForgeWriter(ForeignWriter):
    """Writes what SpecForge 0.2's offline reader (``runtime/data_plane/offline_reader.py``) and
    EAGLE-3 normaliser (``algorithms/eagle3/data.py``) read. A pre-norm final state gets the
    target's final norm applied (``norm``: see :func:`open_writer`); without it the export is
    refused."""

    format = FORMAT

    def __init__(
        self,
        ds: Dataset,
        out: Path,
        *,
        source: str,
        num_hidden_layers: int,
        norm: FinalNorm | None = None,
    ) -> None:
        self.out = out
        self.aux_ids = specforge_layout(ds.layers, num_hidden_layers, source)
        recorded = ds.manifest.model.name if ds.manifest.model else None
        self.norm = check_final_norm(ds.layers, num_hidden_layers, norm, source, recorded)

    def sample_path(self, k: int) -> Path:
        return self.out / sample_relpath(k)

    def is_own(self, relative: Path) -> bool:
        return relative.name.startswith("rows_")

    def notes(self) -> list[str]:
        lines = [f"SpecForge aux layer ids {','.join(map(str, self.aux_ids))}"]
        if self.norm is not None:
            lines.append(f"final norm applied to the final state (from {self.norm.source})")
        return lines

    def write(self, k: int, input_ids, loss_mask, hidden) -> None:
        path = self.sample_path(k)
        path.parent.mkdir(parents=True, exist_ok=True)
        obj = specforge_features(input_ids, loss_mask, hidden, self.norm)
        atomic_write(path, lambda f: torch.save(obj, f))


def open_writer(
    ds: Dataset,
    out: Path,
    *,
    source: str,
    num_hidden_layers: int,
    target: str | os.PathLike | None = None,
) -> SpecForgeWriter:
    """A writer for ``ds``. A final state stored before the norm gets the final norm of
    ``target`` (a model folder), or else of the model folder the dataset records when it is
    there; a state already normed needs neither."""
    norm = None
    if not ds.layers[-1].final_norm:
        folder = target if target is not None else recorded_model_folder(ds)
        if folder is not None:
            norm = load_final_norm(folder, hidden_size=ds.hidden_size)
    return SpecForgeWriter(ds, out, source=source, num_hidden_layers=num_hidden_layers, norm=norm)


def detect(folder: Path) -> int:
    patterns = ("data_*.ckpt", "data_*.ckpt.gz", "rows_*/data_*.ckpt*")
    return MINE if any(has_file(folder, p) for p in patterns) else NOT_MINE


TARGET = FormatOption(
    "target",
    "--target",
    "the target model folder (config.json + safetensors); only its final norm is read, to apply "
    "to a final state stored before the norm.",
    refusal="{flag} is used only to apply the final norm for {owner}, not {fmt}",
)
FOREIGN_FORMAT = ForeignFormat(FORMAT, "data_*.ckpt[.gz]", detect, SpecForgeReader, open_writer,
                               writer_options=(TARGET,))  # fmt: skip
