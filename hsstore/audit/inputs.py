"""What inspect audits: one reading interface over an hsstore dataset (at a path or URL) and
the foreign directories convert reads.

inspect works on both so users can audit data they already have. hsstore datasets give a lot
for free (index lengths and loss-token counts, write-time statistics,
cheap token columns); a foreign directory has to be opened file by file, so those answers are
None there and the audit falls back to what it reads.
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from hsstore.commits.runs import completion
from hsstore.dataset.dataset import Dataset
from hsstore.dataset.segment_set import left_out_line
from hsstore.errors import HsstoreError, NotADatasetError, no_such_path
from hsstore.interop.formats.base import ForeignReader
from hsstore.segment.stats import LayerStats
from hsstore.spec.layers import LayerSpec
from hsstore.storage.locations import datasets_below, is_url


@dataclass
class AuditSample:
    sample_id: str
    input_ids: torch.Tensor
    loss_mask: torch.Tensor
    hidden: torch.Tensor  # [T, L, H] in the stored dtype


def dir_bytes(path: Path) -> int:
    """Bytes of every file under ``path`` (what the dataset costs on disk)."""
    total = 0
    for root, _dirs, files in os.walk(path):
        for f in files:
            try:
                total += os.lstat(os.path.join(root, f)).st_size
            except OSError:
                continue
    return total


class AuditSource:
    """Base: metadata up front, samples on demand. Subclasses fill the attributes."""

    path: str  # a local path, or a URL for a dataset in object storage
    kind: str
    format_version: int | None = None
    version: int | None = None  # the committed version read (hsstore datasets only)
    layers: list[LayerSpec]
    hidden_size: int
    dtype: str
    model: dict[str, Any]
    codec: dict[str, Any] | None = None
    extraction: dict[str, Any] | None = None  # what the run records say (hsstore.commits.runs)
    # Committed samples the view leaves out (one line), and how its version was rebuilt around
    # lost manifest files (hsstore datasets only).
    left_out: str | None = None
    rebuilt: str | None = None

    def __len__(self) -> int:
        raise NotImplementedError

    def sample_id(self, i: int) -> str:
        raise NotImplementedError

    def read(self, i: int) -> AuditSample:
        raise NotImplementedError

    def lengths(self) -> np.ndarray | None:
        """Token count of every sample, when known without reading states."""
        return None

    def loss_tokens(self) -> np.ndarray | None:
        """Loss-token count of every sample, when known without reading states."""
        return None

    def write_stats(self) -> list[LayerStats] | None:
        """Per-layer statistics recorded at write time, if any."""
        return None

    def iter_tokens(self) -> Iterator[tuple[int, np.ndarray]] | None:
        """(position, input_ids) of every sample, when that is much cheaper than reading states."""
        return None

    def bytes_on_disk(self) -> int:
        return dir_bytes(Path(self.path))


class HsstoreSource(AuditSource):
    def __init__(self, ds: Dataset):
        man = ds.manifest
        self.ds = ds
        self.path = ds.path
        self.kind = "hsstore"
        self.format_version = man.format_version
        self.layers = list(ds.layers)
        self.hidden_size = ds.hidden_size
        self.dtype = man.dtype
        self.model = man.model.to_json()
        self.codec = man.codec.to_json()
        self.version = man.version
        self.left_out = left_out_line(ds)
        self.rebuilt = ds.rebuilt.describe(ds.storage) if ds.rebuilt is not None else None
        done = completion(man.provenance)
        if done.records:
            self.extraction = {"complete": done.complete, "pending": done.pending}

    def __len__(self) -> int:
        return len(self.ds)

    def sample_id(self, i: int) -> str:
        return self.ds.sample_ids[i]

    def read(self, i: int) -> AuditSample:
        s = self.ds.read(i)
        # fp8 states are audited as the trainer sees them (dequantized); others as stored.
        return AuditSample(s.sample_id, s.input_ids, s.loss_mask, s.dequantized())

    def lengths(self) -> np.ndarray:
        return self.ds.index.column("num_tokens").to_numpy()

    def loss_tokens(self) -> np.ndarray:
        return self.ds.index.column("num_loss_tokens").to_numpy()

    def bytes_on_disk(self) -> int:
        return sum(info.size for info in self.ds.storage.walk(""))

    def write_stats(self) -> list[LayerStats] | None:
        try:
            return self.ds.layer_stats()
        except (HsstoreError, KeyError, OSError):
            return None

    def iter_tokens(self) -> Iterator[tuple[int, np.ndarray]]:
        for i in range(len(self.ds)):
            ids, _mask = self.ds.read_tokens(i)
            yield i, ids.numpy()


class ForeignSource(AuditSource):
    """A directory `convert` reads (speculators v1, SpecForge, speculators Arrow), read-only."""

    def __init__(self, reader: ForeignReader):
        self.reader = reader
        self.path = str(reader.path)
        self.kind = reader.format
        self.layers = list(reader.layers)
        self.hidden_size = reader.hidden_size
        self.dtype = str(reader.dtype).removeprefix("torch.")
        self.model = dict(reader.model or {})
        self._ids = reader.sample_ids()

    def __len__(self) -> int:
        return len(self.reader)

    def sample_id(self, i: int) -> str:
        return self._ids[i]

    def read(self, i: int) -> AuditSample:
        item = self.reader.read(i)
        return AuditSample(item.sample_id, item.input_ids, item.loss_mask, item.dequantized())


def open_audit_source(
    path: str | os.PathLike[str],
    *,
    layer_ids: Sequence[int] | None = None,
    num_hidden_layers: int | None = None,
) -> AuditSource:
    """An hsstore dataset if ``path`` is one, else any foreign format `convert` reads.

    ``layer_ids`` / ``num_hidden_layers`` describe a foreign directory that does not record
    them (as for convert). Raises FileNotFoundError for a missing path, NotADatasetError when
    no format fits, BadInputError when a foreign directory cannot be opened.
    """
    import hsstore
    from hsstore.interop.formats import detect_format, open_foreign

    if is_url(path):  # only hsstore datasets live in object storage
        return HsstoreSource(hsstore.open(path))
    p = Path(path)
    if not p.exists():
        raise no_such_path(p)
    try:
        return HsstoreSource(hsstore.open(p))
    except NotADatasetError:
        if datasets_below(p):  # the folder around a dataset, not a foreign directory
            raise
    try:
        fmt = detect_format(p)
    except HsstoreError:
        raise NotADatasetError(
            "not an hsstore dataset (no committed manifest) nor a directory convert reads "
            "(no data_*.pt, data_*.ckpt[.gz] or Arrow dataset)",
            path=str(p),
        ) from None
    return ForeignSource(
        open_foreign(p, fmt=fmt, layer_ids=layer_ids, num_hidden_layers=num_hidden_layers)
    )
