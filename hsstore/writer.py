"""Writer: appends samples to a dataset in segments of its own, published by atomic commits."""

from __future__ import annotations

import contextlib
import os
import uuid
from collections.abc import Sequence
from types import TracebackType
from typing import Any

import numpy as np
import torch

from hsstore.dataset import Dataset, storage_view
from hsstore.errors import BadInputError, ConflictError, DuplicateSampleError
from hsstore.format import commit, paths
from hsstore.format.manifest import Manifest, SegmentInfo
from hsstore.segment import SegmentReader
from hsstore.segment_writer import SegmentWriter, ShardFlusher


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
        self._segments_seen = len(ds.manifest.segments)
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
            # Segments are only ever appended: the ones this writer has not seen are at the end.
            for seg in latest.segments[self._segments_seen :]:
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
            published = commit.publish(self.storage, build_next, base=self.manifest)
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
        self._segments_seen = len(published.segments)
        self.ds.refresh(to=published)
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
