"""Dataset and Sample: a read-only view of one committed version, composed of segments.

`create` makes a dataset, `open` opens one; ``refresh()`` moves a view to the latest version.
Writing goes through `hsstore.writer.Writer` (``ds.writer()``).
"""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import pyarrow as pa
import torch
import xxhash

from hsstore.codecs import CodecConfig
from hsstore.errors import (
    BadInputError,
    ConflictError,
    IntegrityError,
)
from hsstore.format import commit, paths, zarr_meta
from hsstore.format.layers import LayerSpec
from hsstore.format.manifest import (
    DTYPES,
    Layout,
    Manifest,
    ModelInfo,
    dtype_name,
    now_iso,
)
from hsstore.format.store import LocalStorage
from hsstore.segment import SegmentReader, finish_checksum
from hsstore.stats import LayerStats, merge_layer_stats

if TYPE_CHECKING:
    from hsstore.writer import Writer


@dataclass(frozen=True)
class Sample:
    """One sample: token ids, loss mask and hidden states [T, num_layers, H]."""

    sample_id: str
    input_ids: torch.Tensor
    loss_mask: torch.Tensor
    hidden: torch.Tensor

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[0])


def storage_view(t: torch.Tensor) -> np.ndarray:
    """The storage-dtype numpy view of a CPU tensor (bf16 -> its uint16 bit patterns)."""
    if t.dtype == torch.bfloat16:
        return t.view(torch.int16).numpy().view("<u2")
    return t.numpy()


def create(
    path: str | os.PathLike[str],
    *,
    layers: Sequence[LayerSpec | Mapping[str, Any]],
    hidden_size: int,
    dtype: torch.dtype | str,
    model: ModelInfo | Mapping[str, Any] | None = None,
    tokenizer: Mapping[str, Any] | None = None,
    codec: str | CodecConfig = "blosc-zstd",
    layers_per_chunk: int | None = None,
    chunk_bytes: int = 1 << 20,
    shard_bytes: int = 64 << 20,
    provenance: Mapping[str, Any] | None = None,
    exist_ok: bool = False,
) -> Dataset:
    """Make an empty dataset (version 1). With ``exist_ok``, open a compatible existing one."""
    specs = tuple(x if isinstance(x, LayerSpec) else LayerSpec.from_json(dict(x)) for x in layers)
    if not specs:
        raise BadInputError("a dataset needs at least one layer", path=str(path))
    name = dtype_name(dtype)
    codec_cfg = codec if isinstance(codec, CodecConfig) else CodecConfig(name=codec)
    model_info = model if isinstance(model, ModelInfo) else ModelInfo.from_json(dict(model or {}))
    if model_info.hidden_size is not None and model_info.hidden_size != hidden_size:
        raise BadInputError(
            f"model hidden_size {model_info.hidden_size} != hidden_size {hidden_size}",
            path=str(path),
        )
    layout = Layout.choose(
        num_layers=len(specs),
        hidden_size=hidden_size,
        itemsize=DTYPES[name][1].itemsize,
        layers_per_chunk=layers_per_chunk,
        chunk_bytes=chunk_bytes,
        shard_bytes=shard_bytes,
    )
    now = now_iso()
    man = Manifest(
        version=1,
        dataset_id=uuid.uuid4().hex,
        created_at=now,
        committed_at=now,
        model=model_info,
        tokenizer=dict(tokenizer) if tokenizer is not None else None,
        hidden_size=hidden_size,
        dtype=name,
        layers=specs,
        codec=codec_cfg,
        layout=layout,
        provenance=dict(provenance or {}),
    )
    storage = LocalStorage(path)
    data = man.to_bytes()
    if commit.list_versions(storage):
        if not exist_ok:
            raise ConflictError("a dataset already exists here", path=str(path))
        return _open_compatible(path, man)
    os.makedirs(storage.root, exist_ok=True)
    for key, doc in (
        (
            paths.ROOT_ZARR_JSON,
            zarr_meta.group_json({"hsstore": {"format_version": man.format_version}}),
        ),
        (paths.SEGMENTS_ZARR_JSON, zarr_meta.group_json()),
    ):
        storage.put_if_absent(key, doc)
    if not storage.put_if_absent(paths.manifest_key(1), data):
        if not exist_ok:
            raise ConflictError("a dataset already exists here", path=str(path))
        return _open_compatible(path, man)
    return Dataset(path)


def _open_compatible(path: str | os.PathLike[str], wanted: Manifest) -> Dataset:
    ds = Dataset(path)
    have = ds.manifest

    def semantics(m: Manifest) -> list[tuple[int, bool]]:
        # Canonical meaning only: the same state named in another convention is the same state.
        return [(layer.depth, layer.final_norm) for layer in m.layers]

    if semantics(have) != semantics(wanted):
        raise ConflictError(
            f"existing dataset stores layers {semantics(have)} (depth, final_norm), asked for "
            f"{semantics(wanted)}",
            path=str(path),
        )
    for what in ("hidden_size", "dtype"):
        if getattr(have, what) != getattr(wanted, what):
            raise ConflictError(
                f"existing dataset has {what}={getattr(have, what)!r}, asked for "
                f"{getattr(wanted, what)!r}",
                path=str(path),
            )
    return ds


def open(
    path: str | os.PathLike[str], *, version: int | None = None, verify_reads: bool = True
) -> Dataset:  # noqa: A001
    """Open the latest committed version (or ``version``) of a dataset."""
    return Dataset(path, version=version, verify_reads=verify_reads)


class Dataset:
    """A read-only view of one committed version of a dataset.

    verify_reads: check each whole-sample read against its stored checksum (and every chunk
    read whole against its crc32c), so corrupted bytes raise IntegrityError instead of being
    returned as data.
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        *,
        version: int | None = None,
        verify_reads: bool = True,
        manifest: Manifest | None = None,
    ):
        self.path = Path(path)
        if not self.path.is_dir():
            raise FileNotFoundError(2, "no such dataset directory", str(path))
        self.storage = LocalStorage(self.path)
        self.verify_reads = verify_reads
        self._load(
            manifest if manifest is not None else commit.load_manifest(self.storage, version)
        )

    def _load(self, manifest: Manifest) -> None:
        # Segments are immutable and a newer version only appends to an older one: on
        # refresh, keep the readers (and their decoded indexes and caches) of segments already
        # loaded and read only the new ones; the joined index is rebuilt when next used.
        readers: list[SegmentReader] = getattr(self, "_readers", [])
        tables: list[pa.Table] = getattr(self, "_tables", [])
        n = len(readers)
        # Segment ids are unique and append-only: the same n-th id means the same first n.
        if n and (len(manifest.segments) < n or manifest.segments[n - 1].id != readers[-1].info.id):
            readers, tables, n = [], [], 0
        self.manifest = manifest
        self._readers, self._tables = readers[:n], tables[:n]
        for info in manifest.segments[n:]:
            reader = SegmentReader(self.storage, manifest, info)
            table = reader.index()
            if table.num_rows != info.num_samples:
                raise IntegrityError(
                    f"index has {table.num_rows} rows, manifest says {info.num_samples}",
                    path=reader.where(paths.INDEX),
                )
            self._readers.append(reader)
            self._tables.append(table)
        self._joined: _JoinedIndex | None = None
        self._ids: list[str] | None = None
        self._pos: dict[str, int] | None = None

    @property
    def _index(self) -> _JoinedIndex:
        if self._joined is None:
            self._joined = _JoinedIndex(self._tables)
        return self._joined

    @property
    def index(self) -> pa.Table:
        """One row per sample (the segments' index.parquet rows) plus its ``segment`` number."""
        return self._index.table

    def refresh(self, *, to: Manifest | None = None) -> Dataset:
        """Move to the latest committed version; with ``to`` (a version a writer just
        published, so no manifest is read), move forward to it."""
        if to is not None:
            if to.version > self.manifest.version:
                self._load(to)
            return self
        latest = commit.load_manifest(self.storage)
        if latest.version != self.manifest.version:
            self._load(latest)
        return self

    # -- pickling: worker processes re-open from the path ----------------------------------
    def __getstate__(self) -> dict[str, Any]:
        return {
            "path": str(self.path),
            "version": self.manifest.version,
            "verify": self.verify_reads,
        }

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(state["path"], version=state["version"], verify_reads=state["verify"])  # type: ignore[misc]

    # -- description ---------------------------------------------------------------------------
    @property
    def layers(self) -> list[LayerSpec]:
        return list(self.manifest.layers)

    @property
    def hidden_size(self) -> int:
        return self.manifest.hidden_size

    @property
    def dtype(self) -> torch.dtype:
        return self.manifest.torch_dtype

    @property
    def num_tokens(self) -> int:
        return self.manifest.num_tokens

    @property
    def sample_ids(self) -> list[str]:
        if self._ids is None:
            self._ids = self.index.column("sample_id").to_pylist()
        return self._ids

    def position(self, sample_id: str) -> int:
        """Storage position of a sample id; KeyError if it is not committed."""
        if self._pos is None:
            self._pos = {sid: i for i, sid in enumerate(self.sample_ids)}
        return self._pos[sample_id]

    def num_tokens_of(self, i: int) -> int:
        return int(self._index.len[i])

    def layer_stats(self) -> list[LayerStats]:
        """Per-layer statistics recorded at write time, merged over every segment."""
        return merge_layer_stats([r.stats() for r in self._readers], self.manifest.num_layers)

    def segment_reader(self, segment: int) -> SegmentReader:
        return self._readers[segment]

    def __len__(self) -> int:
        return self._index.num_samples

    def __contains__(self, sample_id: object) -> bool:
        try:
            self.position(sample_id)  # type: ignore[arg-type]
        except (KeyError, TypeError):
            return False
        return True

    def __repr__(self) -> str:
        return (
            f"hsstore.Dataset({str(self.path)!r}, version={self.manifest.version}, "
            f"samples={len(self)}, tokens={self.num_tokens}, layers={len(self.layers)}, "
            f"hidden_size={self.hidden_size}, dtype={self.manifest.dtype})"
        )

    # -- reading -------------------------------------------------------------------------------
    def __getitem__(self, i: int) -> Sample:
        return self.read(i)

    def __iter__(self) -> Iterator[Sample]:
        for i in range(len(self)):
            yield self.read(i)

    def get(self, sample_id: str, *, layers: Sequence[int] | None = None) -> Sample:
        return self.read(self.position(sample_id), layers=layers)

    def _check_position(self, i: int) -> int:
        n = len(self)
        if not -n <= i < n:
            raise IndexError(f"sample {i} out of range for a dataset of {n} samples")
        return i % n

    def _check_layers(self, layers: Sequence[int] | None) -> list[int] | None:
        if layers is None:
            return None
        out = [int(x) for x in layers]
        for x in out:
            if not 0 <= x < self.manifest.num_layers:
                raise IndexError(
                    f"layer position {x} out of range (dataset stores {self.manifest.num_layers})"
                )
        return out

    def read_tokens(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(input_ids, loss_mask) of sample ``i`` as int64, without decoding any state.

        The token columns of a segment are decoded once and cached, so a pass over every sample
        (building a vocabulary, counting loss tokens) costs a few bytes per token.
        """
        i = self._check_position(i)
        reader = self._readers[self._index.segment[i]]
        row, n = int(self._index.row[i]), int(self._index.len[i])
        ids = reader.column("input_ids")[row : row + n].astype(np.int64)
        mask = reader.column("loss_mask")[row : row + n].astype(np.int64)
        return torch.from_numpy(ids), torch.from_numpy(mask)

    def read_hidden_into(
        self, i: int, out: torch.Tensor, *, layers: Sequence[int] | None = None
    ) -> torch.Tensor:
        """Decode sample ``i``'s states straight into ``out`` ([T, len(layers), H], contiguous CPU)."""
        self._read(self._check_position(i), self._check_layers(layers), out)
        return out

    def read(
        self, i: int, *, layers: Sequence[int] | None = None, out: torch.Tensor | None = None
    ) -> Sample:
        """Sample ``i`` in storage order; ``layers`` picks stored layers by position."""
        i = self._check_position(i)
        layer_list = self._check_layers(layers)
        ids, mask, hidden = self._read(i, layer_list, out)
        return Sample(
            sample_id=self.sample_ids[i],
            input_ids=torch.from_numpy(ids.astype(np.int64)),
            loss_mask=torch.from_numpy(mask.astype(np.int64)),
            hidden=hidden,
        )

    def _read(
        self, i: int, layers: list[int] | None, out: torch.Tensor | None
    ) -> tuple[np.ndarray, np.ndarray, torch.Tensor]:
        reader = self._readers[self._index.segment[i]]
        row, n = int(self._index.row[i]), int(self._index.len[i])
        width = self.manifest.num_layers if layers is None else len(layers)
        shape = (n, width, self.manifest.hidden_size)
        if out is None:
            out = torch.empty(shape, dtype=self.manifest.torch_dtype)
        elif (
            tuple(out.shape) != shape
            or out.dtype != self.manifest.torch_dtype
            or not out.is_contiguous()
        ):
            raise BadInputError(
                f"out must be a contiguous {self.manifest.dtype} tensor of shape {shape}, got "
                f"{out.dtype} {tuple(out.shape)}",
                path=str(self.path),
            )
        np_out = storage_view(out)
        check = self.verify_reads and layers is None
        try:
            hasher = xxhash.xxh3_64() if check else None
            reader.read_rows(row, row + n, layers, np_out, hasher=hasher)
            ids = reader.column("input_ids")[row : row + n]
            mask = reader.column("loss_mask")[row : row + n]
        except IntegrityError as exc:
            raise IntegrityError(exc.message, path=exc.path, sample_id=self.sample_ids[i]) from exc
        if hasher is not None and finish_checksum(hasher, ids, mask) != int(
            self._index.checksum[i]
        ):
            raise IntegrityError(
                "sample checksum mismatch (corrupted bytes)",
                path=str(self.path / paths.segment_dir(reader.info.id)),
                sample_id=self.sample_ids[i],
            )
        return ids, mask, out

    # -- writing -------------------------------------------------------------------------------
    def writer(self, *, segment_bytes: int = 2 << 30, encode_threads: int | None = None) -> Writer:
        """A writer that appends segments of its own; use as a context manager."""
        from hsstore.writer import Writer

        return Writer(self, segment_bytes=segment_bytes, encode_threads=encode_threads)

    def close(self) -> None:
        self.storage.close()


class _JoinedIndex:
    """The sample index of every segment, joined (built on first use after each refresh)."""

    def __init__(self, tables: list[pa.Table]):
        from hsstore.segment import INDEX_SCHEMA

        parts = [
            t.append_column("segment", pa.array(np.full(t.num_rows, k, np.int32)))
            for k, t in enumerate(tables)
        ]
        empty = INDEX_SCHEMA.empty_table().append_column("segment", pa.array([], pa.int32()))
        self.table: pa.Table = pa.concat_tables(parts) if parts else empty
        self.segment = self.table.column("segment").to_numpy()
        self.row = self.table.column("row_offset").to_numpy()
        self.len = self.table.column("num_tokens").to_numpy()
        self.checksum = self.table.column("checksum").to_numpy()
        self.num_samples = int(self.len.shape[0])
