"""Dataset and Sample: a read-only view of one committed version, composed of segments.

`create` makes a dataset, `open` opens one; ``refresh()`` moves a view to the latest version.
Writing goes through `hsstore.writer.Writer` (``ds.writer()``).
"""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import pyarrow as pa
import torch
import xxhash

from hsstore import fp8
from hsstore.errors import (
    BadInputError,
    ConflictError,
    HsstoreError,
    IntegrityError,
    StorageError,
)
from hsstore.format import commit, paths, zarr_meta
from hsstore.format.codecs import DEFAULT_CODEC, CodecConfig
from hsstore.format.dtypes import DTYPES, columns_for, dtype_name, storage_view
from hsstore.format.layers import MAX_DEPTH, LayerSpec, check_layer_list
from hsstore.format.layout import Layout
from hsstore.format.lease import DEFAULT_TTL_S
from hsstore.format.locations import nesting_problem, open_storage
from hsstore.format.manifest import Manifest, ModelInfo, now_iso
from hsstore.format.sample_index import INDEX_SCHEMA, finish_checksum
from hsstore.format.store import Storage
from hsstore.segment import SegmentReader
from hsstore.stats import LayerStats, merge_layer_stats
from hsstore.writer import Writer

# The widest released models are ~25k wide; a hidden size past this is an error, refused before
# it sizes chunks and buffers.
MAX_HIDDEN_SIZE = 1 << 20


@dataclass(frozen=True)
class Sample:
    """One sample: token ids, loss mask and hidden states [T, num_layers, H] as stored.

    In a ``float8_e4m3fn`` dataset ``hidden`` holds the fp8 states and ``scales`` their float32
    per-token scales [T] (None for every other dtype); `dequantized` gives the values.
    """

    sample_id: str
    input_ids: torch.Tensor
    loss_mask: torch.Tensor
    hidden: torch.Tensor
    scales: torch.Tensor | None = None

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[0])

    def dequantized(self, dtype: torch.dtype = fp8.DEQUANTIZED_DTYPE) -> torch.Tensor:
        """The states as values: fp8 ones as speculators' trainer computes them (hs-connectors'
        ``fp8.to(dtype) * scale.to(dtype)``, bf16 by default, bit for bit); the states of any
        other dtype are returned as stored (``dtype`` does not apply to them)."""
        if self.scales is None:
            return self.hidden
        return fp8.dequantize(self.hidden, self.scales, dtype)


def create(
    path: str | os.PathLike[str] | Storage,
    *,
    layers: Sequence[LayerSpec | Mapping[str, Any]],
    hidden_size: int,
    dtype: torch.dtype | str,
    model: ModelInfo | Mapping[str, Any] | None = None,
    tokenizer: Mapping[str, Any] | None = None,
    codec: str | CodecConfig = DEFAULT_CODEC,
    layers_per_chunk: int | None = None,
    chunk_bytes: int | None = None,
    shard_bytes: int = 64 << 20,
    sample_aligned: bool | None = None,
    provenance: Mapping[str, Any] | None = None,
    exist_ok: bool = False,
) -> Dataset:
    """Make an empty dataset (version 1). With ``exist_ok``, open a compatible existing one.

    ``sample_aligned`` (default: whenever the codec compresses) starts every sample at a chunk
    boundary, so a random read decodes only its own rows; chunks are ~``chunk_bytes`` (default
    1 MiB), at most 32 rows when aligned (see `Layout.choose`).

    ``path`` is a local path or a URL (``s3://bucket/prefix``, ``gs://``, ``az://``,
    ``file://``); see docs/STORAGE.md.
    """
    if isinstance(hidden_size, bool) or not isinstance(hidden_size, int):
        raise BadInputError(f"hidden_size must be an integer, got {hidden_size!r}", path=str(path))
    if not 1 <= hidden_size <= MAX_HIDDEN_SIZE:
        raise BadInputError(
            f"hidden_size must be in 1..{MAX_HIDDEN_SIZE}, got {hidden_size}", path=str(path)
        )
    try:
        specs = tuple(
            x if isinstance(x, LayerSpec) else LayerSpec.from_json(dict(x)) for x in layers
        )
    except (ValueError, TypeError, KeyError) as exc:
        raise BadInputError(f"bad layer spec: {exc}", path=str(path)) from None
    name = dtype_name(dtype)
    codec_cfg = codec if isinstance(codec, CodecConfig) else CodecConfig(name=codec)
    model_info = model if isinstance(model, ModelInfo) else ModelInfo.from_json(dict(model or {}))
    n_layers = model_info.num_hidden_layers
    if n_layers is not None and (
        isinstance(n_layers, bool)
        or not isinstance(n_layers, int)
        or not 1 <= n_layers <= MAX_DEPTH
    ):
        raise BadInputError(
            f"model num_hidden_layers must be an integer in 1..{MAX_DEPTH}, got {n_layers!r}",
            path=str(path),
        )
    try:
        check_layer_list(specs, n_layers)
    except ValueError as exc:
        raise BadInputError(str(exc), path=str(path)) from None
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
        sample_aligned=codec_cfg.compressed if sample_aligned is None else sample_aligned,
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
        columns=columns_for(name),
    )
    storage = open_storage(path)
    data = man.to_bytes()
    if commit.list_versions(storage):
        if not exist_ok:
            raise ConflictError("a dataset already exists here", path=storage.root)
        return _open_compatible(storage, man)
    nested = nesting_problem(storage)
    if nested:
        raise BadInputError(nested, path=storage.root)
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
            raise ConflictError("a dataset already exists here", path=storage.root)
        return _open_compatible(storage, man)
    return Dataset(storage)


def _open_compatible(storage: Storage, wanted: Manifest) -> Dataset:
    ds = Dataset(storage)
    ds.manifest.check_compatible(
        wanted.layers,
        hidden_size=wanted.hidden_size,
        dtype=wanted.dtype,
        num_hidden_layers=wanted.model.num_hidden_layers,
        path=storage.root,
    )
    return ds


def open(
    path: str | os.PathLike[str] | Storage,
    *,
    version: int | None = None,
    verify_reads: bool = True,
    read_threads: int | None = None,
) -> Dataset:  # noqa: A001
    """Open the latest committed version (or ``version``) of a dataset at a path or URL."""
    return Dataset(path, version=version, verify_reads=verify_reads, read_threads=read_threads)


def default_read_threads() -> int:
    """Threads one sample's read may decode on: the usable cores, at most 4 (a sample's chunks
    rarely keep more busy, and a caller running many reads at once keeps the cores busy itself).
    """
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return max(1, min(4, cores or 1))


class Dataset:
    """A read-only view of one committed version of a dataset.

    verify_reads: check each whole-sample read against its stored checksum, so corrupted bytes
    raise IntegrityError instead of being returned as data. Chunks a sample checksum does not
    cover (reads of some layers, or every read when this is off) are checked against their
    crc32c.

    read_threads: how many threads one `read` or `read_hidden_into` of a large compressed
    sample decodes on (shares of at least 1 MiB of its chunks, the calling thread taking one);
    default `default_read_threads`. 1 decodes on the calling thread only. Batch reads
    (`read_hidden_many_into`) always decode on the calling thread: the loader runs its own.
    """

    def __init__(
        self,
        path: str | os.PathLike[str] | Storage,
        *,
        version: int | None = None,
        verify_reads: bool = True,
        read_threads: int | None = None,
        manifest: Manifest | None = None,
    ):
        if read_threads is not None and read_threads < 1:
            raise BadInputError(f"read_threads must be at least 1, got {read_threads}")
        self.storage = open_storage(path)
        self.storage.check_root()
        # Where the dataset lives, as given: a local path or a URL.
        self.path: str = self.storage.root
        self.verify_reads = verify_reads
        self.read_threads = default_read_threads() if read_threads is None else read_threads
        self._readers: list[SegmentReader] = []
        self._tables: list[pa.Table] = []
        self._seen: tuple[str, ...] = ()
        self.unreadable: dict[str, str] = {}
        self._load(
            manifest if manifest is not None else commit.load_manifest(self.storage, version)
        )

    def _load(self, manifest: Manifest) -> None:
        # Segments are immutable and a commit usually only appends: on refresh, keep the
        # readers (and their decoded indexes and caches) of segments already loaded and read
        # only the new ones; the joined index is rebuilt when next used.
        readers, tables = list(self._readers), list(self._tables)
        seen, unreadable = self._seen, dict(self.unreadable)
        n = len(seen)
        if tuple(s.id for s in manifest.segments[:n]) != seen:  # a repair removed some
            readers, tables, seen, unreadable = [], [], (), {}
            n = 0
        for info in manifest.segments[n:]:
            # A segment whose index cannot be read is left out of the view, named in
            # `unreadable`: damage stays in the samples it touched (verify names them, and
            # `hsstore.repair` publishes a version without them).
            reader = SegmentReader(self.storage, manifest, info)
            try:
                table = reader.index()
                if table.num_rows != info.num_samples:
                    raise IntegrityError(
                        f"index has {table.num_rows} rows, manifest says {info.num_samples}",
                        path=reader.where(paths.INDEX),
                    )
            except HsstoreError as exc:
                if not _is_damage(exc) or _file_intact(reader, paths.INDEX):
                    # A storage that failed to answer (the view stays at its old version), or
                    # intact bytes that disagree with the manifest: neither is local damage.
                    raise
                unreadable[info.id] = str(exc)
                continue
            except OSError as exc:
                if not _is_damage(exc):
                    raise
                unreadable[info.id] = f"{exc.filename or reader.where(paths.INDEX)}: " + (
                    f"cannot read ({exc.strerror or exc})"
                )
                continue
            readers.append(reader)
            tables.append(table)
        # Only once every index is in: a failed read leaves the view at its old version.
        self.manifest = manifest
        self._readers, self._tables = readers, tables
        self._seen, self.unreadable = tuple(s.id for s in manifest.segments), unreadable
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

    # -- pickling: worker processes re-open from the storage (its location, no handles) ------
    def __getstate__(self) -> dict[str, Any]:
        return {
            "path": self.storage,
            "version": self.manifest.version,
            "verify": self.verify_reads,
            "read_threads": self.read_threads,
        }

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(  # type: ignore[misc]
            state["path"],
            version=state["version"],
            verify_reads=state["verify"],
            read_threads=state["read_threads"],
        )

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

    def read_tokens_many(
        self, positions: Sequence[int] | np.ndarray, takes: Sequence[int] | np.ndarray
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(input_ids, loss_mask) as int64 of the first ``takes[k]`` tokens of sample
        ``positions[k]``, for every k, back to back: a batch's token columns in one gather per
        segment instead of one `read_tokens` per sample."""
        index, n = self._index, len(self)
        pos, count = np.asarray(positions, np.int64), np.asarray(takes, np.int64)
        if pos.shape != count.shape or pos.ndim != 1:
            raise ValueError("positions and takes must be 1-d and of the same length")
        for k in np.flatnonzero((pos < -n) | (pos >= n))[:1].tolist():
            raise IndexError(f"sample {int(pos[k])} out of range for a dataset of {n} samples")
        pos %= max(n, 1)
        for k in np.flatnonzero((count < 0) | (count > index.len[pos]))[:1].tolist():
            sid, has = self.sample_ids[int(pos[k])], int(index.len[pos[k]])
            raise ValueError(f"cannot take {int(count[k])} tokens of sample {sid!r} ({has} tokens)")
        rows = np.repeat(index.row[pos] - (np.cumsum(count) - count), count)
        rows += np.arange(len(rows))
        ids, mask = np.empty(len(rows), np.int64), np.empty(len(rows), np.int64)
        segments = np.unique(index.segment[pos]).tolist()
        for seg in segments:  # usually one: then no masks
            sel = slice(None) if len(segments) == 1 else np.repeat(index.segment[pos], count) == seg
            ids[sel] = self._readers[seg].column("input_ids")[rows[sel]]
            mask[sel] = self._readers[seg].column("loss_mask")[rows[sel]]
        return torch.from_numpy(ids), torch.from_numpy(mask)

    def will_read(
        self, positions: Sequence[int] | np.ndarray, *, layers: Sequence[int] | None = None
    ) -> None:
        """Samples about to be read (the loader hints its next batch while it decodes the
        current one): on local disk the reads of their chunks start now, so the reads that
        follow find them in memory instead of waiting for the device; on object storage
        nothing happens. A hint: it neither checks nor decodes anything."""
        layer_list = self._check_layers(layers)
        index, n = self._index, len(self)
        pos = np.asarray(positions, np.int64)
        for k in np.flatnonzero((pos < -n) | (pos >= n))[:1].tolist():
            raise IndexError(f"sample {int(pos[k])} out of range for a dataset of {n} samples")
        pos = pos % max(n, 1)
        segment, row, num_tokens = index.segment[pos], index.row[pos], index.len[pos]
        for seg in np.unique(segment).tolist():
            mine = segment == seg
            starts = row[mine]
            self._readers[seg].will_read_rows(starts, starts + num_tokens[mine], layer_list)

    def read_hidden_into(
        self, i: int, out: torch.Tensor, *, layers: Sequence[int] | None = None
    ) -> torch.Tensor:
        """Decode sample ``i``'s states straight into ``out`` ([T, len(layers), H], contiguous CPU)
        of the dataset's dtype; for an fp8 dataset ``out`` may instead be bf16, which receives
        the values as `Sample.dequantized` computes them."""
        self._read(
            self._check_position(i),
            self._check_layers(layers),
            out,
            values_out_ok=True,
            threads=self.read_threads,
        )
        return out

    def read_hidden_many_into(
        self,
        out: torch.Tensor,
        placed: Iterable[tuple[int, int]],
        *,
        layers: Sequence[int] | None = None,
    ) -> int:
        """Decode whole samples into the token rows of ``out`` ([R, len(layers), H], contiguous
        CPU, the dataset's dtype): for every ``(i, row)`` drawn from ``placed``, sample ``i``
        lands in ``out[row : row + T_i]``. Returns how many samples were read.

        The same bytes and checks as `read_hidden_into` per sample, but the checks of ``out``
        and its array view are done once: on samples of a few hundred tokens they took a sixth
        of the time of a `read_hidden_into` call. ``placed`` is drawn one pair at a time, as
        each read is done, so threads that each draw from their own generator over one shared
        queue of work split a batch between them.
        """
        layer_list = self._check_layers(layers)
        man = self.manifest
        width = man.num_layers if layer_list is None else len(layer_list)
        if out.dim() != 3 or tuple(out.shape[1:]) != (width, man.hidden_size):
            raise BadInputError(
                f"out must be [rows, {width}, {man.hidden_size}], got {tuple(out.shape)}",
                path=str(self.path),
            )
        dequantize = man.scaled and out.dtype == fp8.DEQUANTIZED_DTYPE  # per sample, in _read
        if not dequantize and (
            out.dtype != man.torch_dtype or not out.is_contiguous() or out.device.type != "cpu"
        ):
            raise BadInputError(
                f"out must be a contiguous CPU {man.dtype} tensor, got {out.dtype} on {out.device}",
                path=str(self.path),
            )
        np_out = None if dequantize else storage_view(out)
        done = 0
        for i, first in placed:
            i = self._check_position(i)
            n = int(self._index.len[i])
            if not 0 <= first <= out.shape[0] - n:  # a slice would silently shrink
                raise BadInputError(
                    f"sample {i} ({n} tokens) at row {first} overruns out ({out.shape[0]} rows)",
                    path=str(self.path),
                )
            if np_out is None:
                self._read(i, layer_list, out[first : first + n], values_out_ok=True)
            else:
                self._decode(i, layer_list, np_out[first : first + n], columns=False)
            done += 1
        return done

    def read(
        self, i: int, *, layers: Sequence[int] | None = None, out: torch.Tensor | None = None
    ) -> Sample:
        """Sample ``i`` in storage order; ``layers`` picks stored layers by position."""
        i = self._check_position(i)
        layer_list = self._check_layers(layers)
        ids, mask, scales, hidden = self._read(i, layer_list, out, threads=self.read_threads)
        return Sample(
            sample_id=self.sample_ids[i],
            input_ids=torch.from_numpy(ids.astype(np.int64)),
            loss_mask=torch.from_numpy(mask.astype(np.int64)),
            hidden=hidden,
            scales=None if scales is None else torch.from_numpy(scales.copy()),
        )

    def _read(
        self,
        i: int,
        layers: list[int] | None,
        out: torch.Tensor | None,
        *,
        values_out_ok: bool = False,
        threads: int = 1,
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray | None, torch.Tensor]:
        width = self.manifest.num_layers if layers is None else len(layers)
        shape = (int(self._index.len[i]), width, self.manifest.hidden_size)
        values_out = None  # a bf16 `out` of an fp8 dataset: decode, then dequantize into it
        if (
            values_out_ok
            and out is not None
            and self.manifest.scaled
            and out.dtype == fp8.DEQUANTIZED_DTYPE
            and tuple(out.shape) == shape
            and out.is_contiguous()
        ):
            values_out, out = out, None
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
        ids, mask, scales = self._decode(
            i, layers, storage_view(out), columns=True, threads=threads
        )
        if values_out is not None:
            fp8.dequantize(out, torch.from_numpy(scales.copy()), values_out.dtype, out=values_out)
            out = values_out
        return ids, mask, scales, out

    def _decode(
        self,
        i: int,
        layers: list[int] | None,
        np_out: np.ndarray,
        *,
        columns: bool,
        threads: int = 1,
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
        """Decode sample ``i``'s states into ``np_out`` (its storage-dtype view) and verify the
        sample checksum when reads are verified and all layers are read. Returns its token
        columns and scales, read only when ``columns`` or the checksum needs them (else empty)."""
        reader = self._readers[self._index.segment[i]]
        row, n = int(self._index.row[i]), int(self._index.len[i])
        hasher = xxhash.xxh3_64() if self.verify_reads and layers is None else None
        ids = mask = _NO_ROWS
        scales = None
        try:
            reader.read_rows(row, row + n, layers, np_out, hasher=hasher, threads=threads)
            if columns or hasher is not None:
                ids = reader.column("input_ids")[row : row + n]
                mask = reader.column("loss_mask")[row : row + n]
                if self.manifest.scaled:
                    scales = reader.column(paths.SCALES)[row : row + n]
        except HsstoreError as exc:
            cls = IntegrityError if _is_damage(exc) else StorageError
            raise cls(exc.message, path=exc.path, sample_id=self.sample_ids[i]) from exc
        except OSError as exc:  # a committed file missing or unreadable
            if not _is_damage(exc):
                raise
            raise IntegrityError(
                f"cannot read a committed file ({exc.strerror or exc})",
                path=exc.filename or self.storage.path_of(paths.segment_dir(reader.info.id)),
                sample_id=self.sample_ids[i],
            ) from exc
        if hasher is not None and finish_checksum(hasher, ids, mask, scales) != int(
            self._index.checksum[i]
        ):
            raise IntegrityError(
                "sample checksum mismatch (corrupted bytes)",
                path=self.storage.path_of(paths.segment_dir(reader.info.id)),
                sample_id=self.sample_ids[i],
            )
        return ids, mask, scales

    # -- writing -------------------------------------------------------------------------------
    def writer(
        self,
        *,
        segment_bytes: int = 2 << 30,
        encode_threads: int | None = None,
        lease_ttl_s: float | None = None,
    ) -> Writer:
        """A writer that appends segments of its own; use as a context manager.

        lease_ttl_s: how long gc must see no heartbeat before it may judge this writer's
        segments dead (default 60 s, or ``$HSSTORE_LEASE_TTL``).
        """
        return Writer(
            self,
            segment_bytes=segment_bytes,
            encode_threads=encode_threads,
            lease_ttl_s=lease_ttl_s or DEFAULT_TTL_S,
        )

    def close(self) -> None:
        self.storage.close()


_NO_ROWS = np.empty(0, np.int64)


def _is_damage(exc: BaseException) -> bool:
    """Whether a failed read shows damage to committed files (missing, truncated, a FIFO where
    a file belongs, bytes failing their checksum), rather than a storage that failed to answer
    (a network error, an I/O error), which a later read may get past: only damage makes a
    segment unreadable or a sample's read an IntegrityError."""
    if isinstance(exc, HsstoreError):
        return not isinstance(exc, StorageError)
    return isinstance(
        exc, (FileNotFoundError, IsADirectoryError, NotADirectoryError, PermissionError)
    )


def _file_intact(reader: SegmentReader, relpath: str) -> bool:
    """Whether a committed file reads with the size and crc32c the manifest recorded."""
    try:
        reader.read_small(relpath)
    except (HsstoreError, OSError):
        return False
    return True


class _JoinedIndex:
    """The sample index of every segment, joined (built on first use after each refresh)."""

    def __init__(self, tables: list[pa.Table]):
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
