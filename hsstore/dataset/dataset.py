"""Dataset and Sample: a read-only view of one committed version, composed of segments.

`create` makes a dataset, `open` opens one; ``refresh()`` moves a view to the latest version.
Writing goes through `hsstore.dataset.writer.Writer` (``ds.writer()``).
"""

from __future__ import annotations

import functools
import os
import threading
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import numpy as np
import pyarrow as pa
import torch
import xxhash

from hsstore.codec import fp8, tiers
from hsstore.commits.rebuild import Rebuilt, open_manifest, require_whole
from hsstore.cores import default_read_threads
from hsstore.dataset.joined_index import JoinedIndex
from hsstore.dataset.sample import Sample
from hsstore.dataset.sample_checks import (
    check_sample,
    hand_off_as_sample,
    raise_as_sample_error,
    token_columns,
)
from hsstore.dataset.segment_set import LoadedSegments, load_segments, say_what_is_left_out
from hsstore.dataset.writer import ViewWriter, Writer
from hsstore.errors import (
    BadInputError,
    HsstoreError,
)
from hsstore.segment.reader import SegmentReader
from hsstore.segment.row_reads import (
    CHUNK_CHECKED,
    CHUNKS_UNCHECKED,
    STREAMED,
    STREAMED_UNCHECKED,
    HandedOff,
    Hashed,
    InShares,
    RowRead,
)
from hsstore.segment.rows import PlannedRead
from hsstore.segment.stats import LayerStats, merge_layer_stats
from hsstore.spec.dtypes import storage_view
from hsstore.spec.layers import LayerSpec
from hsstore.spec.manifest import Manifest
from hsstore.storage.locations import open_storage
from hsstore.storage.store import Storage


def open(
    path: str | os.PathLike[str] | Storage,
    *,
    version: int | None = None,
    verify_reads: bool = True,
    read_threads: int | None = None,
) -> Dataset:  # noqa: A001
    """Open the latest committed version (or ``version``) of a dataset at a path or URL."""
    return Dataset(path, version=version, verify_reads=verify_reads, read_threads=read_threads)


class Dataset:
    """A read-only view of one committed version of a dataset.

    verify_reads: check each whole-sample read against its stored checksum, so corrupted bytes
    raise IntegrityError instead of being returned as data. Chunks a sample checksum does not
    cover (reads of some layers, or every read when this is off) are checked against their
    crc32c.

    read_threads: how many threads one `read` or `read_hidden_into` of a large compressed
    sample decodes on (shares of at least 1 MiB of its chunks, the calling thread taking one);
    default `default_read_threads`. 1 decodes on the calling thread only.
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
        self._loaded: LoadedSegments | None = None
        # A version a writer of this view published, with the indexes that writer read, whose
        # new segments are not loaded yet: most writers never read their view again, so the
        # indexes are read when something first needs them (`_segments`).
        self._pending: tuple[Manifest, dict[str, tuple[SegmentReader, pa.Table]]] | None = None
        self._pending_lock = threading.Lock()
        self.rebuilt: Rebuilt | None = None  # how it was rebuilt around lost manifest files
        given = manifest is not None  # by verify or repair, whose reports say what is damaged
        if manifest is None:
            manifest, self.rebuilt = open_manifest(self.storage, version)
        self._load(manifest)
        if not given and (self.rebuilt is not None or self.unreadable):
            say_what_is_left_out(self)

    def _load(
        self,
        manifest: Manifest,
        known: Mapping[str, tuple[SegmentReader, pa.Table]] | None = None,
    ) -> None:
        # Segments are immutable and a commit usually only appends: on refresh, keep the
        # readers (and their decoded indexes and caches) of segments already loaded and read
        # only the new ones; the joined index is rebuilt when next used.
        if self._pending is not None:
            known = {**self._pending[1], **(known or {})}
        loaded = load_segments(self.storage, manifest, self._loaded, known)
        # Only once every index is in: a failed read leaves the view at its old version.
        self.manifest, self._loaded, self._pending = manifest, loaded, None
        self._forget_joined()

    def _move_to(
        self, manifest: Manifest, known: Mapping[str, tuple[SegmentReader, pa.Table]]
    ) -> None:
        """Move to ``manifest``, a later version a writer of this view published, reading
        nothing: its new segments' indexes are read when first needed (`_segments`), those in
        ``known`` (read by the writer) taken as they are."""
        with self._pending_lock:
            held = {} if self._pending is None else self._pending[1]
            self._pending = (manifest, {**held, **known})
            self.manifest = manifest
            self._forget_joined()

    def _segments(self) -> LoadedSegments:
        """The readers and indexes of this view's version: every accessor of them comes here,
        which loads a version a writer moved the view to. A failed read raises and leaves the
        version pending, tried again on the next access."""
        if self._pending is not None:
            with self._pending_lock:
                if self._pending is not None:
                    self._load(self._pending[0])
                    if self._loaded is not None and self._loaded.unreadable:
                        say_what_is_left_out(self)
        assert self._loaded is not None  # loaded by __init__
        return self._loaded

    def _forget_joined(self) -> None:
        self._joined: JoinedIndex | None = None
        self._ids: list[str] | None = None
        self._pos: dict[str, int] | None = None

    @property
    def unreadable(self) -> dict[str, str]:
        """The segments this version leaves out, their index unreadable: id -> why."""
        return self._segments().unreadable

    @property
    def _readers(self) -> list[SegmentReader]:
        return self._segments().readers

    @property
    def _index(self) -> JoinedIndex:
        tables = self._segments().tables  # first: loading a pending version forgets the join
        if self._joined is None:
            self._joined = JoinedIndex(tables)
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
                if self.unreadable:
                    say_what_is_left_out(self)
            return self
        latest, rebuilt = open_manifest(self.storage)
        if latest.version != self.manifest.version or (rebuilt is None) != (self.rebuilt is None):
            self.rebuilt = rebuilt
            self._load(latest)
            if rebuilt is not None or self.unreadable:
                say_what_is_left_out(self)
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
        index = self._index  # first: loading a pending version forgets the ids
        if self._ids is None:
            self._ids = index.table.column("sample_id").to_pylist()
        return self._ids

    def position(self, sample_id: str) -> int:
        """Storage position of a sample id; KeyError if it is not committed."""
        ids = self.sample_ids
        if self._pos is None:
            self._pos = {sid: i for i, sid in enumerate(ids)}
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
        """(input_ids, loss_mask) of sample ``i`` as int64, without decoding any state (a
        segment's token columns are decoded once and cached: a few bytes per token)."""
        return self.read_tokens_many([i], [self.num_tokens_of(i)])

    def read_tokens_many(
        self, positions: Sequence[int] | np.ndarray, takes: Sequence[int] | np.ndarray
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(input_ids, loss_mask) as int64 of the first ``takes[k]`` tokens of sample
        ``positions[k]``, for every k, back to back: a batch's token columns in one gather per
        segment instead of one `read_tokens` per sample."""
        ids, mask = self.read_columns_many(positions, takes, ("input_ids", "loss_mask"))
        return torch.from_numpy(ids.astype(np.int64)), torch.from_numpy(mask.astype(np.int64))

    def read_columns_many(
        self,
        positions: Sequence[int] | np.ndarray,
        takes: Sequence[int] | np.ndarray,
        names: Sequence[str],
    ) -> list[np.ndarray]:
        """Per-token columns ``names`` (``input_ids``, ``loss_mask``, the scales of a scaled
        dataset: ``[rows]`` or ``[rows, layers]``) as stored, for the tokens `read_tokens_many`
        takes."""
        return self._index.gather_columns(positions, takes, names, self._readers, self.sample_ids)

    def will_read(
        self, positions: Sequence[int] | np.ndarray, *, layers: Sequence[int] | None = None
    ) -> None:
        """Samples about to be read (the loader hints its next batch while it decodes this
        one): on local disk their chunks start coming in from the device now. A hint: it
        neither checks nor decodes."""
        layer_list = self._check_layers(layers)
        index = self._index
        pos = index.positions(positions)
        segment, start = index.segment[pos], index.row[pos]
        stop = start + index.len[pos]
        for seg in np.unique(segment).tolist():
            mine = segment == seg
            self._readers[seg].will_read_rows(start[mine], stop[mine], layer_list)

    def read_hidden_into(
        self, i: int, out: torch.Tensor, *, layers: Sequence[int] | None = None
    ) -> torch.Tensor:
        """Decode sample ``i``'s states straight into ``out`` ([T, len(layers), H], contiguous CPU)
        of the dataset's dtype; for an fp8 dataset ``out`` may instead be bf16, which receives
        the values as `Sample.dequantized` computes them."""
        i = self._index.position(i)
        layer_list = self._check_layers(layers)
        values = self._check_out(out, layer_list, int(self._index.len[i]), values_ok=True)
        self._read_into(i, layer_list, out, values, threads=self.read_threads)
        return out

    def read(
        self, i: int, *, layers: Sequence[int] | None = None, out: torch.Tensor | None = None
    ) -> Sample:
        """Sample ``i`` in storage order; ``layers`` picks stored layers by position."""
        i = self._index.position(i)
        layer_list = self._check_layers(layers)
        man, n = self.manifest, int(self._index.len[i])
        if out is None:
            width = man.num_layers if layer_list is None else len(layer_list)
            out = torch.empty((n, width, man.hidden_size), dtype=man.torch_dtype)
        else:
            self._check_out(out, layer_list, n, values_ok=False)
        ids, mask, scales = self._read_into(
            i, layer_list, out, False, threads=self.read_threads, columns=True
        )
        return Sample(
            sample_id=self.sample_ids[i],
            input_ids=torch.from_numpy(ids.astype(np.int64)),
            loss_mask=torch.from_numpy(mask.astype(np.int64)),
            hidden=out,
            scales=None if scales is None else torch.from_numpy(scales.copy()),
        )

    def _check_out(
        self, out: torch.Tensor, layers: list[int] | None, rows: int | None, *, values_ok: bool
    ) -> bool:
        """Check a caller's ``out`` for a read of these layers: [rows, layers, H] (``rows``
        None: any number, for a batch), contiguous on the CPU, of the dataset's dtype or, where
        ``values_ok`` and the dataset is fp8, of the dtype its values dequantize to. Returns
        whether ``out`` takes dequantized values."""
        man = self.manifest
        width = man.num_layers if layers is None else len(layers)
        shape = ("rows" if rows is None else rows, width, man.hidden_size)
        if (
            out.dim() != 3
            or tuple(out.shape[1:]) != shape[1:]
            or out.shape[0] != (rows or 0)
            and rows is not None
        ):
            shown = ", ".join(str(x) for x in shape)
            raise BadInputError(
                f"out must be [{shown}], got shape {tuple(out.shape)}", path=str(self.path)
            )
        values = values_ok and man.scaled and out.dtype == fp8.DEQUANTIZED_DTYPE
        if (
            not (values or out.dtype == man.torch_dtype)
            or not out.is_contiguous()
            or out.device.type != "cpu"
        ):
            raise BadInputError(
                f"out must be a contiguous CPU {man.dtype} tensor, got {out.dtype} on {out.device}",
                path=str(self.path),
            )
        return values

    def _read_into(
        self,
        i: int,
        layers: list[int] | None,
        out: torch.Tensor,
        values: bool,
        *,
        threads: int = 1,
        columns: bool = False,
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
        """Decode sample ``i`` into ``out``, checked by `_check_out`; for an ``out`` that takes
        ``values``, decode the fp8 states, then dequantize them into it."""
        target = torch.empty(out.shape, dtype=self.manifest.torch_dtype) if values else out
        ids, mask, scales = self._decode(
            i, layers, storage_view(target), columns=columns or values, threads=threads
        )
        scales = tiers.scales_for_layers(scales, layers)
        if values:
            assert scales is not None  # a dataset whose values dequantize has scales
            fp8.dequantize(target, torch.from_numpy(scales.copy()), out.dtype, out=out)
        return ids, mask, scales

    def _decode(
        self,
        i: int,
        layers: list[int] | None,
        np_out: np.ndarray,
        *,
        columns: bool = False,
        threads: int = 1,
        deferred: bool = False,
        runs_to: Callable[[PlannedRead], None] | None = None,
        stream: bool = False,
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
        """Decode sample ``i``'s states into ``np_out`` (its storage-dtype view) and verify the
        sample checksum when reads are verified and all layers are read, unless the caller
        checks it later (``deferred``: `hsstore.dataset.batch_reads.check_decoded`). Returns
        its token columns and scales, read only when ``columns`` or the checksum needs them
        (else empty). The read's strategy (`hsstore.segment.row_reads`) is chosen here, once:
        hashed as the rows land where the checksum is taken now, else each chunk checked
        against its crc32c (not where a deferred checksum covers the decoded bytes); in
        ``threads`` shares for one large sample, handed to ``runs_to`` for a loader's pipeline,
        or (``stream``, a batch) written around the caches."""
        reader = self._readers[self._index.segment[i]]
        row, n = int(self._index.row[i]), int(self._index.len[i])
        checked = self.verify_reads and layers is None
        hasher = xxhash.xxh3_64() if checked and not deferred else None
        cols: tuple[np.ndarray, np.ndarray, np.ndarray | None] = (_NO_ROWS, _NO_ROWS, None)
        where = (self.storage, reader, self.sample_ids[i])
        how: RowRead
        if hasher is not None:
            how = InShares(threads, hasher) if threads > 1 else Hashed(hasher)
        else:
            crc = not checked
            if runs_to is not None:
                how = HandedOff(functools.partial(hand_off_as_sample, runs_to, where), crc, stream)
            elif threads > 1:
                how = InShares(threads, crc=crc)
            elif stream:
                how = STREAMED if crc else STREAMED_UNCHECKED
            else:
                how = CHUNK_CHECKED if crc else CHUNKS_UNCHECKED
        try:  # not a context manager: on small samples this runs once per sample of a batch
            reader.read_rows(row, row + n, layers, np_out, how)
            if columns or hasher is not None:
                cols = token_columns(reader, row, n)
            if hasher is not None:
                check_sample(hasher, cols, int(self._index.checksum[i]), *where)
        except (HsstoreError, OSError) as exc:
            raise_as_sample_error(exc, *where)
        return cols

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
        self.refresh()
        if self.rebuilt is not None:
            require_whole(self.storage)
        return ViewWriter(
            self,
            segment_bytes=segment_bytes,
            encode_threads=encode_threads,
            lease_ttl_s=lease_ttl_s,
        )

    def close(self) -> None:
        self.storage.close()


_NO_ROWS = np.empty(0, np.int64)
