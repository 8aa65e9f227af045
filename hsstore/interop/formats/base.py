"""What every foreign-format reader shares: the item it yields and the checks it applies.

A reader turns one foreign file into a :class:`ForeignSample` in hsstore's shape (hidden as
``[T, L, H]``) or raises :class:`BadInputError` naming the file and the problem. Keeping the
validation here means every format rejects the same defects with the same words.
"""

from __future__ import annotations

import json
import os
import re
import tempfile
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from hsstore.codec import fp8
from hsstore.errors import BadInputError
from hsstore.interop.formats.safe_load import load_torch_file
from hsstore.spec.conventions import ConventionError, to_canonical
from hsstore.spec.layers import LayerSpec

FLOAT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)

# Same-width integer view of each float dtype, and the smallest |x| bit pattern that is Inf/NaN
# (exponent all ones): a value is finite iff (bits & sign_off) < that pattern.
_BITS = {
    torch.bfloat16: (torch.int16, 0x7FFF, 0x7F80),
    torch.float16: (torch.int16, 0x7FFF, 0x7C00),
    torch.float32: (torch.int32, 0x7FFFFFFF, 0x7F800000),
    torch.float8_e4m3fn: (torch.int8, 0x7F, 0x7F),  # no Inf; NaN is S.1111.111 only
}


@dataclass
class ForeignSample:
    """One sample of a foreign dataset, already in hsstore's shape."""

    sample_id: str
    name: str  # the file it came from, relative to the source directory
    input_ids: torch.Tensor  # int64 [T]
    loss_mask: torch.Tensor  # int64 0/1 [T]
    hidden: torch.Tensor  # [T, L, H] in the reader's dtype
    scales: torch.Tensor | None = None  # float32 [T] per-token scales of fp8 states, else None

    @property
    def nbytes(self) -> int:
        scale_bytes = 0 if self.scales is None else self.scales.numel() * 4
        return self.hidden.numel() * self.hidden.element_size() + scale_bytes

    def dequantized(self) -> torch.Tensor:
        """The states as values: fp8 ones as speculators' trainer dequantizes them, others as read."""
        return self.hidden if self.scales is None else fp8.dequantize(self.hidden, self.scales)


class ForeignReader(ABC):
    """A foreign dataset opened read-only: metadata up front, samples on demand.

    Attributes: ``format`` (its name), ``path`` (the directory), ``layers`` (canonical, with the
    source's own ids as provenance), ``hidden_size``, ``dtype``, ``model`` (what the source says
    about the target model, or None). ``read`` is safe to call from several threads at once.
    """

    format: str
    path: Path
    layers: list[LayerSpec]
    hidden_size: int
    dtype: torch.dtype
    model: dict | None

    def __init__(
        self,
        path: str | os.PathLike,
        *,
        layer_ids: Sequence[int] | None = None,
        num_hidden_layers: int | None = None,
        **options: Any,
    ) -> None:
        """Open the folder ``path`` (BadInputError naming it when it is not one) and read the
        metadata (`_open`). ``layer_ids`` and ``num_hidden_layers`` say which states the files
        hold where the format does not record it; ``options`` are a format's own."""
        self.path = require_dir(path)
        self._open(layer_ids, num_hidden_layers, **options)

    @abstractmethod
    def _open(
        self, layer_ids: Sequence[int] | None, num_hidden_layers: int | None, **options: Any
    ) -> None:
        """Read what the format records: set ``layers``, ``hidden_size``, ``dtype``, ``model``."""

    def _canonical(self, convention: str, ids: Sequence[int], num_hidden_layers: int) -> list:
        """The canonical layers the format's ``ids`` name, or BadInputError naming the folder."""
        try:
            return to_canonical(convention, ids, num_hidden_layers)
        except ConventionError as exc:
            raise BadInputError(str(exc), path=str(self.path)) from None

    @abstractmethod
    def __len__(self) -> int: ...

    @abstractmethod
    def names(self) -> list[str]:
        """File names (relative to ``path``) in stable order; ``read(i)`` reads ``names()[i]``."""

    def sample_ids(self) -> list[str]:
        """The sample id ``read(i)`` will give, for every i, without reading any sample."""
        return [
            strip_suffix(n.rsplit("/", 1)[-1], (".pt", ".ckpt", ".ckpt.gz", ".safetensors"))
            for n in self.names()
        ]

    @abstractmethod
    def read(self, i: int) -> ForeignSample:
        """Load and validate sample i; raise BadInputError(path=file) if it is malformed."""

    def provenance(self) -> dict[str, Any]:
        """What a converted dataset should remember about this source."""
        return {"source_format": self.format, "source": str(self.path)}


class FileListReader(ForeignReader):
    """A reader of one file per sample: ``_files``, in the order ``read`` numbers them."""

    _files: list[Path]

    def __len__(self) -> int:
        return len(self._files)

    def names(self) -> list[str]:
        return [p.relative_to(self.path).as_posix() for p in self._files]

    def _load(self, i: int, keys: tuple[str, ...]) -> tuple[str, dict]:
        """Sample file i (its path, for errors) and its dict, which must hold ``keys``."""
        where = str(self._files[i])
        return where, require_keys(load_torch_file(self._files[i]), keys, where)

    def _probe(self) -> tuple[int, torch.dtype]:
        """Hidden size and dtype from the first file that loads and tells them (`_shape_of`);
        files may be bad, and ``read`` says which."""
        why = None  # why no file could tell, named in the error
        for p in self._files:
            try:
                obj = load_torch_file(p)
                found = self._shape_of(obj)
                if found is None:  # the keys it lacks, if that is why
                    require_keys(obj, self._keys, str(p))
            except BadInputError as exc:
                why = why or f"; {exc}"
                continue
            if isinstance(found, str):
                why = why or f"; {p}: {found}"
            elif found is not None:
                return found
        raise BadInputError(
            f"no readable {self._file_kind} to learn hidden size and dtype from{why or ''}",
            path=str(self.path),
        )

    _file_kind = "data file"
    _keys: tuple[str, ...] = ()  # what every sample file holds

    @staticmethod
    @abstractmethod
    def _shape_of(obj: Any) -> tuple[int, torch.dtype] | str | None:
        """The hidden size and dtype a loaded file shows, why it cannot (a reason), or None."""


# ----------------------------------------------------------------------------- file discovery

_INDEX_RE = re.compile(r"(\d+)")


def require_dir(path: str | os.PathLike) -> Path:
    """The folder a reader opens, or BadInputError naming it."""
    folder = Path(path)
    if not folder.is_dir():
        raise BadInputError("not a directory", path=str(folder))
    return folder


def natural_key(name: str) -> tuple:
    """Sort key that orders data_2 before data_10 (the producers number files by sample)."""
    parts = _INDEX_RE.split(name)
    return tuple(int(p) if p.isdigit() else p for p in parts)


def file_index(stem: str, prefix: str) -> int | None:
    """The i in ``{prefix}{i}``, or None when the stem does not follow that pattern."""
    if not stem.startswith(prefix):
        return None
    rest = stem[len(prefix) :]
    return int(rest) if rest.isdigit() else None


def unique_stems(paths: list[Path], root: Path, suffixes: tuple[str, ...]) -> dict[str, Path]:
    """Map each file's stem (name minus suffix) to its path; duplicate stems are an error.

    Stems are the sample ids of converted data, so they must be unique across subfolders.
    """
    out: dict[str, Path] = {}
    for p in paths:
        stem = strip_suffix(p.name, suffixes)
        if stem in out:
            raise BadInputError(
                f"two files would get sample id {stem!r}: "
                f"{out[stem].relative_to(root)} and {p.relative_to(root)}",
                path=str(root),
            )
        out[stem] = p
    return out


def strip_suffix(name: str, suffixes: tuple[str, ...]) -> str:
    for s in sorted(suffixes, key=len, reverse=True):
        if name.endswith(s):
            return name[: -len(s)]
    return name


# ----------------------------------------------------------------------------- validation


def require_keys(obj: Any, keys: tuple[str, ...], path: str) -> dict:
    if not isinstance(obj, dict):
        raise BadInputError(f"expected a dict of tensors, found {type(obj).__name__}", path=path)
    missing = [k for k in keys if k not in obj]
    if missing:
        raise BadInputError(
            f"missing key(s) {', '.join(map(repr, missing))}; found {sorted(map(str, obj))}",
            path=path,
        )
    return obj


def check_tokens(
    input_ids: Any, loss_mask: Any, path: str, *, strict_dtype: bool = True
) -> tuple[torch.Tensor, torch.Tensor]:
    """Validate input_ids/loss_mask as 1-D int64 of equal length with a 0/1 mask.

    With ``strict_dtype=False`` (formats that store masks as bool or int32), integer and bool
    masks are widened to int64, which is lossless.
    """
    for key, t in (("input_ids", input_ids), ("loss_mask", loss_mask)):
        if not isinstance(t, torch.Tensor):
            raise BadInputError(f"{key} is a {type(t).__name__}, expected a tensor", path=path)
    if input_ids.dim() == 2 and input_ids.shape[0] == 1 and not strict_dtype:
        input_ids = input_ids[0]
    if loss_mask.dim() == 2 and loss_mask.shape[0] == 1 and not strict_dtype:
        loss_mask = loss_mask[0]
    for key, t in (("input_ids", input_ids), ("loss_mask", loss_mask)):
        if t.dim() != 1:
            raise BadInputError(f"{key} has shape {list(t.shape)}, expected [T]", path=path)
        if t.dtype != torch.int64:
            ok = not strict_dtype and (t.dtype == torch.bool or not t.is_floating_point())
            if not ok:
                raise BadInputError(f"{key} has dtype {t.dtype}, expected torch.int64", path=path)
    if len(input_ids) == 0:
        raise BadInputError("empty sample (0 tokens)", path=path)
    if len(loss_mask) != len(input_ids):
        raise BadInputError(
            f"loss_mask has {len(loss_mask)} tokens but input_ids has {len(input_ids)}", path=path
        )
    loss_mask = loss_mask.to(torch.int64)
    if bool(((loss_mask != 0) & (loss_mask != 1)).any()):
        raise BadInputError("loss_mask holds values other than 0 and 1", path=path)
    lo, hi = int(input_ids.min()), int(input_ids.max())
    if lo < 0 or hi >= 2**31:
        raise BadInputError(f"input_ids hold {lo if lo < 0 else hi}, outside [0, 2^31)", path=path)
    return input_ids.to(torch.int64), loss_mask


def check_hidden(
    hidden: torch.Tensor,
    num_tokens: int,
    num_layers: int,
    hidden_size: int,
    dtype: torch.dtype,
    path: str,
) -> None:
    """Validate a [T, L, H] hidden tensor: shape, dtype and finiteness."""
    if hidden.dtype != dtype:
        raise BadInputError(f"hidden states have dtype {hidden.dtype}, expected {dtype}", path=path)
    expect = [num_tokens, num_layers, hidden_size]
    if list(hidden.shape) != expect:
        raise BadInputError(
            f"hidden states have shape {list(hidden.shape)}, expected [T, L, H] = {expect}",
            path=path,
        )
    check_finite(hidden, path)


def check_layer_tensor(
    t: Any, k: int, num_tokens: int, hidden_size: int, dtype: torch.dtype, path: str
) -> None:
    """Validate one per-layer [T, H] tensor (the v1 list layout)."""
    if not isinstance(t, torch.Tensor):
        raise BadInputError(
            f"hidden_states[{k}] is a {type(t).__name__}, expected a tensor", path=path
        )
    if t.dtype != dtype:
        raise BadInputError(f"hidden_states[{k}] has dtype {t.dtype}, expected {dtype}", path=path)
    if t.dim() != 2 or t.shape[1] != hidden_size:
        raise BadInputError(
            f"hidden_states[{k}] has shape {list(t.shape)}, expected [T, {hidden_size}]", path=path
        )
    if t.shape[0] != num_tokens:
        raise BadInputError(
            f"hidden_states[{k}] has {t.shape[0]} tokens but input_ids has {num_tokens}", path=path
        )


def int_view(t: torch.Tensor) -> np.ndarray:
    """The bit patterns of a float tensor as a numpy integer array (no copy).

    Bulk copies and checks run in numpy on these views: numpy is single-threaded and fast on
    integers, while torch's intra-op pool oversubscribes the cores our own threads already use.
    """
    return t.view(_BITS[t.dtype][0]).numpy()


def stack_layers(tensors: list[torch.Tensor], dtype: torch.dtype) -> torch.Tensor:
    """torch.stack(tensors, dim=1) for [T, H] tensors, copied through numpy integer views."""
    t, h = tensors[0].shape
    out = torch.empty((t, len(tensors), h), dtype=dtype)
    dst = int_view(out)
    for k, x in enumerate(tensors):
        dst[:, k, :] = int_view(x)
    return out


def check_finite(t: torch.Tensor, path: str, what: str = "hidden states") -> None:
    """Reject NaN/Inf by testing the exponent bits (one integer pass, no float temporaries)."""
    _, sign_off, first_bad = _BITS[t.dtype]
    bits = int_view(t.contiguous()).reshape(-1)
    if bits.size == 0:
        return
    # Two reductions and no temporary (a fresh array per sample is slow to first touch): as
    # signed ints the largest positive pattern is at least `first_bad` iff +Inf/NaN is there;
    # as unsigned ints the largest pattern reaches sign|first_bad iff -Inf/-NaN is there.
    unsigned = bits.view(bits.dtype.str.replace("i", "u"))
    if int(bits.max()) < first_bad and int(unsigned.max()) < (sign_off + 1) | first_bad:
        return
    values = t.float() if t.dtype == torch.float8_e4m3fn else t  # fp8 has no isfinite kernel
    bad = ~torch.isfinite(values)
    kind = "NaN" if bool(torch.isnan(values).any()) else "Inf"
    where = bad.nonzero()[0].tolist()
    raise BadInputError(f"{what} contain {kind} (first at index {where})", path=path)


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")


# ----------------------------------------------------------------------------- writing


def atomic_write(path: Path, write) -> None:
    """Write a file whole or not at all: temp file in the same folder, fsync, rename."""
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException as exc:
        Path(tmp).unlink(missing_ok=True)
        # A failed write (a full disk) reaches us bare, or wrapped by torch.save in a
        # RuntimeError; either way say which file could not be written.
        failed = exc if isinstance(exc, OSError) else exc.__context__
        if isinstance(failed, OSError) and failed.errno is not None:
            raise OSError(failed.errno, failed.strerror, str(path)) from None
        raise


def write_json(path: Path, obj: Any) -> None:
    atomic_write(path, lambda f: f.write(json.dumps(obj, indent=2).encode()))


def is_temp_debris(name: str) -> bool:
    """A temp file :func:`atomic_write` leaves when a run is killed mid-write."""
    return name.startswith(".") and name.endswith(".tmp")


class ForeignWriter(ABC):
    """Writes an hsstore dataset out in a foreign format, one file per sample.

    ``convert.export`` drives it: ``sample_path(k)`` for every sample k in storage order (files
    already there are kept, so an interrupted export resumes), ``write(k, sample)`` from several
    threads at once, then ``finish()`` for the dataset-wide files. The constructor validates that
    the format can hold the dataset and raises BadInputError naming the fix when it cannot.
    """

    format: str

    @abstractmethod
    def sample_path(self, k: int) -> Path:
        """Where sample k goes (absolute, under the output folder)."""

    @abstractmethod
    def is_own(self, relative: Path) -> bool:
        """Is this top-level entry of the output folder something this writer makes?"""

    @abstractmethod
    def write(self, k: int, input_ids: Any, loss_mask: Any, hidden: Any) -> None:
        """Write sample k atomically."""

    stores_fp8: bool = False  # write_fp8 takes an fp8 dataset's stored bits and scales

    def write_fp8(self, k: int, input_ids: Any, fp8: Any, scales: Any) -> None:
        """Sample k of an fp8 dataset as stored (only when ``stores_fp8``)."""
        raise NotImplementedError(f"{self.format} does not store fp8 states")

    def finish(self) -> None:  # noqa: B027 (optional hook)
        """Write the files that describe the whole export (called after every sample)."""

    def notes(self) -> list[str]:
        """Lines the user needs to train on the output (e.g. which layer ids to pass)."""
        return []


# ----------------------------------------------------------------------------- the registry

# How sure a format's ``detect`` is: its own marker files at the top of the folder, or only
# files that look like its samples somewhere below (which another format's markers outrank).
NOT_MINE, NESTED, MINE = 0, 1, 2


@dataclass(frozen=True)
class FormatOption:
    """A setting one format's reader or writer takes, with its ``hsstore convert`` flag.

    ``name`` is the keyword the reader/writer factory takes; the flag is either a switch
    (``is_flag``) or a path. ``refusal`` is the message for a format that has no use for it.
    """

    name: str
    flag: str
    help: str
    is_flag: bool = False
    refusal: str = "{flag} applies to {owner} only, not {fmt}"


@dataclass(frozen=True)
class ForeignFormat:
    """One foreign format: everything ``hsstore.interop.formats`` and ``hsstore convert`` know of it.

    ``detect(folder)`` returns NOT_MINE, NESTED or MINE. ``reader(path, *, layer_ids,
    num_hidden_layers, **reader options)`` opens a source; ``writer(ds, out, *, source,
    num_hidden_layers, **writer options)`` exports to it (None: import only). ``marker`` names
    the files ``detect`` looks for, for the message when no format fits.
    """

    name: str
    marker: str
    detect: Callable[[Path], int]
    reader: Callable[..., ForeignReader]
    writer: Callable[..., ForeignWriter] | None = None
    reader_options: tuple[FormatOption, ...] = ()
    writer_options: tuple[FormatOption, ...] = ()


def has_file(folder: Path, pattern: str) -> bool:
    """Does any path under ``folder`` match the glob ``pattern``?"""
    return next(iter(folder.glob(pattern)), None) is not None
