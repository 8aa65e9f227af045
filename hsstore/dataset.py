"""Dataset, Sample and Writer: segments composed under a manifest.

`Dataset` is a read-only view of one committed version (``refresh()`` moves it to the latest).
`Writer` fills segments of its own and publishes them with an atomic commit.
"""

from __future__ import annotations

import contextlib
import os
import uuid
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import Any

import numpy as np
import pyarrow as pa
import torch
import xxhash

from hsstore.codecs import CodecConfig
from hsstore.errors import (
    BadInputError,
    ConflictError,
    DuplicateSampleError,
    IntegrityError,
)
from hsstore.format import commit, paths, zarr_meta
from hsstore.format.layers import LayerSpec
from hsstore.format.manifest import (
    DTYPES,
    Layout,
    Manifest,
    ModelInfo,
    SegmentInfo,
    dtype_name,
    now_iso,
)
from hsstore.format.store import LocalStorage
from hsstore.segment import SegmentReader, SegmentWriter, ShardFlusher, finish_checksum
from hsstore.stats import LayerStats, merge_layer_stats


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
        self.manifest = manifest
        self._readers = [SegmentReader(self.storage, manifest, s) for s in manifest.segments]
        tables = []
        for k, reader in enumerate(self._readers):
            t = reader.index()
            if t.num_rows != reader.info.num_samples:
                raise IntegrityError(
                    f"index has {t.num_rows} rows, manifest says {reader.info.num_samples}",
                    path=reader.where(paths.INDEX),
                )
            tables.append(t.append_column("segment", pa.array(np.full(t.num_rows, k, np.int32))))
        if tables:
            self.index: pa.Table = pa.concat_tables(tables)
        else:
            from hsstore.segment import INDEX_SCHEMA

            self.index = INDEX_SCHEMA.empty_table().append_column(
                "segment", pa.array([], pa.int32())
            )
        self._segment = self.index.column("segment").to_numpy()
        self._row = self.index.column("row_offset").to_numpy()
        self._len = self.index.column("num_tokens").to_numpy()
        self._checksum = self.index.column("checksum").to_numpy()
        self._ids: list[str] | None = None
        self._pos: dict[str, int] | None = None

    def refresh(self) -> Dataset:
        """Move to the latest committed version."""
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
        return int(self._len[i])

    def layer_stats(self) -> list[LayerStats]:
        """Per-layer statistics recorded at write time, merged over every segment."""
        return merge_layer_stats([r.stats() for r in self._readers], self.manifest.num_layers)

    def segment_reader(self, segment: int) -> SegmentReader:
        return self._readers[segment]

    def __len__(self) -> int:
        return int(self._len.shape[0])

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
        reader = self._readers[self._segment[i]]
        row, n = int(self._row[i]), int(self._len[i])
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
        reader = self._readers[self._segment[i]]
        row, n = int(self._row[i]), int(self._len[i])
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
        if hasher is not None and finish_checksum(hasher, ids, mask) != int(self._checksum[i]):
            raise IntegrityError(
                "sample checksum mismatch (corrupted bytes)",
                path=str(self.path / paths.segment_dir(reader.info.id)),
                sample_id=self.sample_ids[i],
            )
        return ids, mask, out

    # -- writing -------------------------------------------------------------------------------
    def writer(self, *, segment_bytes: int = 2 << 30, encode_threads: int | None = None) -> Writer:
        """A writer that appends segments of its own; use as a context manager."""
        return Writer(self, segment_bytes=segment_bytes, encode_threads=encode_threads)

    def close(self) -> None:
        self.storage.close()


class Writer:
    """Appends samples to a dataset; ``commit()`` publishes them atomically.

    Used as a context manager it commits on a clean exit and publishes nothing when the block
    raises. Several writers (threads or processes) may append to one dataset at once; each owns
    its segments, and commits are serialised by the manifest's put-if-absent. A sample id that
    is already committed, or added twice, raises DuplicateSampleError.
    """

    def __init__(self, ds: Dataset, *, segment_bytes: int, encode_threads: int | None):
        self.ds = ds
        ds.refresh()
        self.storage = ds.storage
        self.manifest = ds.manifest
        self.segment_bytes = segment_bytes
        self._flusher = ShardFlusher(
            (
                self.manifest.layout.rows_per_shard,
                self.manifest.num_layers,
                self.manifest.hidden_size,
            ),
            self.manifest.storage_dtype,
            encode_threads or os.cpu_count() or 1,
        )
        self._known_segments = {s.id for s in ds.manifest.segments}
        self._committed_ids = set(ds.sample_ids)
        self._new_ids: set[str] = set()
        self._segment: SegmentWriter | None = None
        self._locks: dict[str, commit.SegmentLock] = {}
        self._finished: list[SegmentInfo] = []
        self._skipped: list[dict[str, str]] = []
        self._bytes_committed = 0
        self._closed = False

    # -- adding ----------------------------------------------------------------------------
    def add(
        self,
        sample_id: str,
        input_ids: torch.Tensor | np.ndarray | Sequence[int],
        loss_mask: torch.Tensor | np.ndarray | Sequence[int],
        hidden: torch.Tensor,
        *,
        source: str | None = None,
    ) -> None:
        if self._closed:
            raise ConflictError("writer is closed", path=str(self.ds.path))
        if not isinstance(sample_id, str) or not sample_id:
            raise BadInputError(
                f"sample id must be a non-empty string, got {sample_id!r}", path=source
            )
        if sample_id in self._committed_ids or sample_id in self._new_ids:
            raise DuplicateSampleError(
                "sample id is already in the dataset", path=str(self.ds.path), sample_id=sample_id
            )
        hid, ids, mask = self._validate(sample_id, input_ids, loss_mask, hidden, source)
        if self._segment is None:
            self._segment = self._new_segment()
        self._segment.add(sample_id, ids, mask, storage_view(hid), source)
        self._new_ids.add(sample_id)
        if self._segment.raw_bytes() >= self.segment_bytes:
            self._finish_segment()

    def _validate(
        self,
        sample_id: str,
        input_ids: Any,
        loss_mask: Any,
        hidden: Any,
        source: str | None,
    ) -> tuple[torch.Tensor, np.ndarray, np.ndarray]:
        man = self.manifest
        where = source or str(self.ds.path)

        def bad(msg: str) -> BadInputError:
            return BadInputError(msg, path=where, sample_id=sample_id)

        if isinstance(hidden, np.ndarray):
            hidden = torch.from_numpy(hidden)
        if not isinstance(hidden, torch.Tensor):
            raise bad(f"hidden must be a tensor, got {type(hidden).__name__}")
        if hidden.dim() != 3:
            raise bad(f"hidden must be [tokens, layers, hidden], got shape {tuple(hidden.shape)}")
        t, n_layers, h = hidden.shape
        if n_layers != man.num_layers or h != man.hidden_size:
            raise bad(
                f"hidden has {n_layers} layers x {h}, dataset stores {man.num_layers} x {man.hidden_size}"
            )
        if hidden.dtype != man.torch_dtype:
            raise bad(
                f"hidden is {hidden.dtype}, dataset stores {man.torch_dtype} (hsstore never casts silently)"
            )
        if t < 1:
            raise bad("sample has no tokens")
        hidden = hidden.detach().to("cpu").contiguous()
        ids = torch.as_tensor(input_ids).detach().cpu()
        mask = torch.as_tensor(loss_mask).detach().cpu()
        if ids.dim() != 1 or ids.shape[0] != t:
            raise bad(f"input_ids has shape {tuple(ids.shape)}, states have {t} tokens")
        if mask.dim() != 1 or mask.shape[0] != t:
            raise bad(f"loss_mask has shape {tuple(mask.shape)}, states have {t} tokens")
        if ids.dtype.is_floating_point or ids.dtype == torch.bool:
            raise bad(f"input_ids must be integers, got {ids.dtype}")
        if int(ids.min()) < 0 or int(ids.max()) >= 2**31:
            raise bad("input_ids out of range [0, 2^31)")
        if mask.dtype.is_floating_point:
            raise bad(f"loss_mask must be integer or bool, got {mask.dtype}")
        if mask.numel() and (int(mask.min()) < 0 or int(mask.max()) > 1):
            raise bad("loss_mask must hold only 0 and 1")
        return (
            hidden,
            ids.numpy().astype("<i4"),
            mask.numpy().astype("<u1"),
        )

    @property
    def bytes_written(self) -> int:
        """Bytes this writer has put on disk so far (compressed), committed or not."""
        done = sum(f.size for seg in self._finished for f in seg.files.values())
        return self._bytes_committed + done + (self._segment.bytes_written if self._segment else 0)

    def record_skipped(self, name: str, reason: str) -> None:
        """Note an input that was not added; it is written to the manifest's provenance."""
        self._skipped.append({"name": str(name), "reason": str(reason)})

    # -- segments ----------------------------------------------------------------------------
    def _new_segment(self) -> SegmentWriter:
        seg_id = uuid.uuid4().hex
        self._locks[seg_id] = commit.SegmentLock(self.storage, seg_id)
        return SegmentWriter(self.storage, self.manifest, seg_id, self._flusher)

    def _finish_segment(self) -> None:
        if self._segment is not None:
            self._finished.append(self._segment.finalize())
            self._segment = None

    # -- committing --------------------------------------------------------------------------
    def commit(self) -> Manifest | None:
        """Publish everything added so far as a new version; returns it (None if nothing new)."""
        self._finish_segment()
        if not self._finished and not self._skipped:
            return None
        mine = list(self._finished)
        my_ids = set(self._new_ids)
        skipped = list(self._skipped)

        def build_next(latest: Manifest) -> Manifest:
            for seg in latest.segments:
                if seg.id in self._known_segments:
                    continue
                theirs = set(
                    SegmentReader(self.storage, latest, seg).index().column("sample_id").to_pylist()
                )
                clash = theirs & my_ids
                if clash:
                    raise DuplicateSampleError(
                        f"{len(clash)} sample id(s) were committed by another writer meanwhile "
                        f"(first: {sorted(clash)[0]!r}); nothing from this commit was published",
                        path=str(self.ds.path),
                        sample_id=sorted(clash)[0],
                    )
                self._known_segments.add(seg.id)
                self._committed_ids |= theirs
            provenance = dict(latest.provenance)
            if skipped:
                provenance["skipped"] = list(provenance.get("skipped", [])) + skipped
            return latest.with_segments(
                latest.segments + tuple(mine), provenance, latest.version + 1
            )

        try:
            published = commit.publish(self.storage, build_next)
        except ConflictError:
            self.abort()
            raise
        for seg in mine:
            self._bytes_committed += sum(f.size for f in seg.files.values())
            self._locks.pop(seg.id).release()
            self._known_segments.add(seg.id)
        self._committed_ids |= my_ids
        self._new_ids.clear()
        self._finished.clear()
        self._skipped.clear()
        self.manifest = published
        self.ds.refresh()
        return published

    def abort(self) -> None:
        """Drop every segment not yet committed (its files are deleted)."""
        with contextlib.suppress(Exception):
            self._flusher.wait()  # a shard still being written would re-create the folder
        self._segment = None
        self._finished.clear()
        for seg_id, lock in list(self._locks.items()):
            self.storage.delete_tree(paths.segment_dir(seg_id))
            lock.release()
        self._locks.clear()
        self._new_ids.clear()
        self._skipped.clear()

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            self._flusher.close()

    def __enter__(self) -> Writer:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        try:
            if exc_type is None:
                self.commit()
            else:
                self.abort()
        finally:
            self.close()
