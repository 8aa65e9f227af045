"""Writer: appends samples to a dataset in segments of its own, published by atomic commits."""

from __future__ import annotations

import contextlib
import os
import uuid
import weakref
from collections.abc import Iterable, Sequence
from types import TracebackType
from typing import TYPE_CHECKING, Any

import numpy as np
import pyarrow as pa
import torch

from hsstore.codec import tiers
from hsstore.commits import history
from hsstore.commits.group import GroupCommit, proposal
from hsstore.commits.lease import LeaseKeeper
from hsstore.dataset.sample_input import check_names, check_sample, check_scales
from hsstore.errors import (
    CommitUnknownError,
    ConflictError,
    DuplicateSampleError,
    HsstoreError,
    SegmentRemovedError,
)
from hsstore.segment.reader import SegmentReader
from hsstore.segment.writer import SegmentWriter, ShardFlusher
from hsstore.spec import paths
from hsstore.spec.dtypes import storage_view
from hsstore.spec.layers import verifier_position
from hsstore.spec.manifest import Delta, Manifest, SegmentInfo
from hsstore.spec.sample_digest import id_hashes
from hsstore.storage.store import Storage

if TYPE_CHECKING:
    from hsstore.dataset.dataset import Dataset


class Writer:
    """Appends samples to a dataset; ``commit()`` publishes them atomically and returns the
    version it published. Works on the dataset's ``storage`` from ``manifest`` (the version it
    appends to), refusing the ``committed_ids`` already in it; `Dataset.writer` makes one for a
    view and moves the view to each version it publishes.

    Used as a context manager it commits on a clean exit and publishes nothing when the block
    raises. Several writers (threads or processes) may append to one dataset at once; each owns
    its segments, and commits are serialised by the manifest's put-if-absent (racing writers'
    commits go in groups, one version for several: hsstore.commits.group). A sample id that
    is already committed, or added twice, raises DuplicateSampleError.
    """

    def __init__(
        self,
        storage: Storage,
        manifest: Manifest,
        committed_ids: Iterable[str],
        *,
        segment_bytes: int = 2 << 30,
        encode_threads: int | None = None,
        lease_ttl_s: float | None = None,
    ):
        self.storage = storage
        self.manifest = manifest
        self.segment_bytes = segment_bytes
        self._final_position = verifier_position(manifest.layers)  # where a tier may round apart
        self._flusher = ShardFlusher(
            (
                self.manifest.layout.rows_per_shard,
                self.manifest.num_layers,
                self.manifest.hidden_size,
            ),
            self.manifest.storage_dtype,
            encode_threads or os.cpu_count() or 1,
        )
        self._known_segments = {s.id for s in manifest.segments}
        # The index of each segment other writers published that this writer read to check
        # for duplicate ids, until `take_indexes_read` hands them on (a view then need not
        # read them again).
        self._indexes_read: dict[str, tuple[SegmentReader, pa.Table]] = {}
        # The id hashes of segments other writers published, from their versions' sample
        # digests, until this writer's next commit checks its own ids against them; then in
        # `_seen` (hash -> segment), as `_committed_ids` holds the ids it read.
        self._foreign: dict[str, np.ndarray] = {}
        self._seen: dict[int, str] = {}
        self._group = GroupCommit(storage)
        self._committed_ids = set(committed_ids)
        self._new_ids: set[str] = set()
        self._segment: SegmentWriter | None = None
        # A lease per segment this writer is filling, refreshed until it is committed; gc never
        # removes a leased segment (see hsstore.commits.lease).
        self.leases = LeaseKeeper(self.storage, ttl_s=lease_ttl_s)
        self._held: list[str] = []
        self._finished: list[SegmentInfo] = []
        self._skipped: list[dict[str, str]] = []
        self._runs: list[dict[str, Any]] = []
        self._bytes_committed = 0
        self._ids_of: dict[str, list[str]] = {}  # finished segment -> its sample ids
        # The commit in progress whose outcome is unknown (segments, ids, skipped), and the
        # attempt number in this writer's commit token.
        self._unresolved: (
            tuple[list[SegmentInfo], set[str], list[dict[str, str]], list[dict[str, Any]]] | None
        ) = None
        self._attempt = 0
        # The segments of a commit() an interrupt (Ctrl-C, SIGTERM) may have cut short: it can
        # land after the version was created, so abort leaves them to gc, which judges them by
        # the manifests (a published segment is never debris).
        self._interrupted: set[str] = set()
        self._closed = False
        # A writer dropped without close() must not keep its segments leased until exit.
        self._release_at_gc = weakref.finalize(self, self.leases.release_all)

    # -- adding ----------------------------------------------------------------------------
    def add(
        self,
        sample_id: str,
        input_ids: torch.Tensor | np.ndarray | Sequence[int],
        loss_mask: torch.Tensor | np.ndarray | Sequence[int],
        hidden: torch.Tensor,
        *,
        source: str | None = None,
        scales: torch.Tensor | np.ndarray | None = None,
    ) -> None:
        """Append one sample: ``hidden`` [T, L, H] in the dataset's dtype. A dataset of a scaled
        dtype (``float8_e4m3fn``) also takes ``scales``: the float32 scale of each token row
        ([T], or [T, 1, 1] as hs-connectors writes it); other datasets refuse them. A dataset of
        a lossy tier takes states of any float dtype and stores them in its tier."""
        if self._closed:
            raise ConflictError("writer is closed", path=self.storage.root)
        where = self.storage.root
        check_names(where, sample_id, source)
        if (
            sample_id in self._committed_ids
            or sample_id in self._new_ids
            or self._committed_elsewhere(sample_id)
        ):
            raise DuplicateSampleError(
                "sample id is already in the dataset", path=self.storage.root, sample_id=sample_id
            )
        hidden, scales = tiers.prepare(
            self.manifest.tier,
            hidden,
            scales,
            final_position=self._final_position,
            where=source or where,
            sample_id=sample_id,
        )
        hid, ids, mask = check_sample(
            self.manifest, where, sample_id, input_ids, loss_mask, hidden, source
        )
        scale_column = check_scales(self.manifest, where, sample_id, scales, hid.shape[0], source)
        if self._unresolved is not None:
            raise ConflictError(
                "the last commit's outcome is not known yet: call commit() again first",
                path=where,
                sample_id=sample_id,
            )
        if self._segment is None:
            self._segment = self._new_segment()
        try:
            self._segment.add(sample_id, ids, mask, storage_view(hid), source, scale_column)
        except FileNotFoundError as exc:
            raise self._segment_gone(exc) from None
        self._new_ids.add(sample_id)
        if self._segment.raw_bytes() >= self.segment_bytes:
            self.flush()

    @property
    def bytes_written(self) -> int:
        """Bytes this writer has put on disk so far (compressed), committed or not."""
        done = sum(f.size for seg in self._finished for f in seg.files.values())
        return self._bytes_committed + done + (self._segment.bytes_written if self._segment else 0)

    def record_skipped(self, name: str, reason: str) -> None:
        """Note an input that was not added; it is written to the manifest's provenance."""
        self._skipped.append({"name": str(name), "reason": str(reason)})

    def record_run(self, record: dict[str, Any]) -> None:
        """Note a job's start or finish (``hsstore.commits.runs``); the next commit appends it
        to the manifest's ``provenance.runs``, with or without new samples."""
        self._runs.append(dict(record))

    # -- segments ----------------------------------------------------------------------------
    def _new_segment(self) -> SegmentWriter:
        seg_id = uuid.uuid4().hex
        self.leases.acquire(seg_id)  # before any file of the segment exists
        self._held.append(seg_id)
        return SegmentWriter(self.storage, self.manifest, seg_id, self._flusher)

    def flush(self) -> SegmentInfo | None:
        """Write out the segment being filled: its files all written and durable, not yet
        published (the next `commit` publishes it). Returns it; None when none was open."""
        if self._segment is None:
            return None
        try:
            info = self._segment.finalize()
        except FileNotFoundError as exc:
            raise self._segment_gone(exc) from None
        self._ids_of[info.id] = self._segment.sample_ids()
        self._finished.append(info)
        self._segment = None
        return info

    # -- committing --------------------------------------------------------------------------
    def commit(self) -> Manifest | None:
        """Publish everything added so far as a new version; returns it (None if nothing new).

        Exactly one of two outcomes: it returns the version that holds these samples, or it
        raises and nothing of this commit was published. The one exception is
        `CommitUnknownError` (the storage never answered whether the version was created):
        nothing is lost, and calling ``commit()`` again learns the outcome.
        """
        self._indexes_read.clear()  # ones no view took: they are read again where needed
        if self._unresolved is None:
            self.flush()
            if not self._finished and not self._skipped and not self._runs:
                return None
            self._unresolved = (
                list(self._finished),
                set(self._new_ids),
                list(self._skipped),
                list(self._runs),
            )
            self._attempt += 1
        mine, my_ids, skipped, runs = self._unresolved
        token = f"{self.leases.owner}.{self._attempt}"
        claimed = {seg.id for seg in mine}
        self._interrupted = claimed  # until this commit's bookkeeping is done
        my_hashes = id_hashes(i for seg in mine for i in self._ids_of[seg.id])

        def refuse_condemned(delta: Delta) -> None:
            hit = claimed.intersection(delta.condemn)
            if hit:
                raise self._removed(hit, mine, None, lapsed=self.leases.lapsed(sorted(hit)))
            self._note_ids(delta)

        def check_own(latest: Manifest) -> None:
            self._check_ids(latest, my_ids, my_hashes)
            # Last step before the conditional create: fresh leases keep gc from condemning
            # these segments while the put is in flight.
            self.leases.refresh_now([seg.id for seg in mine])

        try:
            published = self._group.commit(
                proposal(token, self.manifest.dataset_id, tuple(mine), tuple(skipped),
                         tuple(runs), my_hashes),
                self.manifest,
                check_own=check_own,
                claims=refuse_condemned,
            )  # fmt: skip
        except CommitUnknownError:
            raise  # everything is kept as it is: the next commit() resolves it
        except BaseException as exc:
            # Raised: certainly nothing of this commit was published, unless an interrupt
            # came from outside (then gc decides, see _interrupted).
            self._unresolved = None
            if isinstance(exc, Exception):
                self._interrupted = set()
            if isinstance(exc, ConflictError):
                self.abort()  # a duplicate id or a condemned segment: these cannot go in
            raise
        if published.head_delta is not None:
            self._note_ids(published.head_delta)
        self._unresolved = None
        damaged = self._damaged(mine)
        # Evidence of this version in its segments, should its manifest file be lost (read by
        # open, verify and gc; see hsstore.commits.history). Only in intact segments (a mark
        # would re-create a removed folder); best effort: the commit stands.
        with contextlib.suppress(HsstoreError, OSError):
            history.mark_committed(
                self.storage, published, [seg for seg in mine if seg.id not in damaged]
            )
        for seg in mine:
            self._bytes_committed += sum(f.size for f in seg.files.values())
            # After the publish (gc condemns only what no version references). A failed delete
            # only leaves the lease to lapse: the commit itself succeeded.
            with contextlib.suppress(HsstoreError, OSError):
                self.leases.drop(seg.id)
            self._held.remove(seg.id)
            self._known_segments.add(seg.id)
            self._foreign.pop(seg.id, None)
        self._committed_ids |= my_ids
        self._new_ids -= my_ids
        self._finished = [seg for seg in self._finished if seg.id not in claimed]
        self._skipped = self._skipped[len(skipped) :]
        self._runs = self._runs[len(runs) :]
        self.manifest = published
        self._interrupted = set()
        if damaged:
            raise self._removed(damaged, mine, published.version, lapsed=False)
        return published

    def _note_ids(self, delta: Delta) -> None:
        """Keep the id hashes of segments a version adds (its sample digest), for the next
        commit's check; a version without a digest leaves its segments' indexes to read."""
        hashes = delta.segment_hashes
        if hashes is None:
            # Read now, while catching up, so that the step from the last read of the log to
            # the create is short; the check reads again any that failed to read now.
            for seg in delta.add_segments:
                if seg.id not in self._known_segments and seg.id not in self._indexes_read:
                    with contextlib.suppress(HsstoreError, OSError):
                        self._read_index(seg)
            return
        for seg_id, h in hashes.items():
            if seg_id not in self._known_segments:
                self._foreign[seg_id] = h

    def _check_ids(self, latest: Manifest, my_ids: set[str], my_hashes: np.ndarray) -> None:
        """Refuse when a segment published since this writer last looked holds one of its
        ids. A segment whose ids its version recorded (the sample digest) is learnt by hash
        (`_seen`), and its index read only to confirm a match; another's index is read."""
        for seg in latest.segments:  # by id, not position: a repair removes segments
            if seg.id in self._known_segments:
                continue
            hashes = self._foreign.pop(seg.id, None)
            if hashes is None:
                _, table = self._indexes_read.get(seg.id) or self._read_index(seg)
                theirs = set(table.column("sample_id").to_pylist())
                self._refuse_clash(theirs & my_ids)
                self._committed_ids |= theirs
            else:
                self._seen.update(dict.fromkeys(hashes.tolist(), seg.id))
            self._known_segments.add(seg.id)
        hits = {self._seen[h] for h in my_hashes.tolist() if h in self._seen}
        for seg in latest.segments if hits else ():
            if seg.id in hits:
                _, table = self._indexes_read.get(seg.id) or self._read_index(seg)
                self._refuse_clash(set(table.column("sample_id").to_pylist()) & my_ids)

    def _refuse_clash(self, clash: set[str]) -> None:
        if clash:
            raise DuplicateSampleError(
                f"{len(clash)} sample id(s) were committed by another writer meanwhile "
                f"(first: {sorted(clash)[0]!r}); nothing from this commit was published",
                path=self.storage.root,
                sample_id=sorted(clash)[0],
            )

    def _committed_elsewhere(self, sample_id: str) -> bool:
        """Whether another writer's segment this writer learnt by hash holds ``sample_id``
        (its index is read to confirm a hash match)."""
        if not self._seen:
            return False
        seg_id = self._seen.get(int(id_hashes([sample_id])[0]))
        if seg_id is None:
            return False
        seg = next((s for s in self.manifest.segments if s.id == seg_id), None)
        if seg is None:
            return False
        _, table = self._indexes_read.get(seg.id) or self._read_index(seg)
        return sample_id in set(table.column("sample_id").to_pylist())

    def _read_index(self, seg: SegmentInfo) -> tuple[SegmentReader, pa.Table]:
        reader = SegmentReader(self.storage, self.manifest, seg)
        self._indexes_read[seg.id] = (reader, reader.index())
        return self._indexes_read[seg.id]

    def take_indexes_read(self) -> dict[str, tuple[SegmentReader, pa.Table]]:
        """The reader and index of each segment of other writers this writer has read since
        the last call (checked as a view checks them), by segment id."""
        taken, self._indexes_read = self._indexes_read, {}
        return taken

    def _damaged(self, mine: list[SegmentInfo]) -> set[str]:
        """Segments of a just-published commit whose files are not all there at their sizes
        (removed by something that ignores the protocol, or a gc run by hand with no regard
        for leases): one listing per segment."""
        damaged = set()
        for seg in mine:
            try:
                found = {
                    o.key.rsplit(f"{seg.id}/", 1)[-1]: o.size
                    for o in self.storage.walk(paths.segment_dir(seg.id))
                }
            except (HsstoreError, OSError):
                continue  # cannot tell now; verify can
            if any(found.get(name) != f.size for name, f in seg.files.items()):
                damaged.add(seg.id)
        return damaged

    def _removed(
        self, segment_ids: set[str], mine: list[SegmentInfo], published: int | None, *, lapsed: bool
    ) -> SegmentRemovedError:
        ids = tuple(i for seg in mine if seg.id in segment_ids for i in self._ids_of[seg.id])
        names = ", ".join(sorted(segment_ids))
        why = (
            " (this writer's lease lapsed: it paused or stalled longer than the ttl)"
            if lapsed
            else ""
        )
        if published is None:
            what = f"gc condemned segment(s) {names} as debris{why}; nothing was published"
        else:
            what = f"version {published} was published, but segment(s) {names} were removed"
        shown = ", ".join(repr(i) for i in ids[:5]) + (", ..." if len(ids) > 5 else "")
        return SegmentRemovedError(
            f"{what}: {len(ids)} sample(s) must be written again ({shown})",
            path=self.storage.root,
            sample_ids=ids,
            published=published,
        )

    def _segment_gone(self, exc: FileNotFoundError) -> SegmentRemovedError:
        """A write into this writer's open segment found its folder removed (by gc): that
        segment is dropped, the finished ones stay for the next commit."""
        segment, self._segment = self._segment, None
        with contextlib.suppress(Exception):
            self._flusher.wait()
        ids = tuple(segment.sample_ids()) if segment is not None else ()
        seg_id = segment.segment_id if segment is not None else "?"
        if segment is not None:
            with contextlib.suppress(HsstoreError, OSError):
                self.storage.delete_tree(paths.segment_dir(seg_id))
            self.leases.drop(seg_id, delete=False)
            self._held.remove(seg_id)
            self._new_ids -= set(ids)
        return SegmentRemovedError(
            f"segment {seg_id} was removed while this writer was filling it (gc judged it "
            f"debris: a pause longer than the lease ttl, or gc with a short --grace): "
            f"{len(ids)} sample(s) not committed ({exc.filename})",
            path=self.storage.root,
            sample_ids=ids,
        )

    def abort(self) -> None:
        """Drop every segment not yet committed (its files are deleted).

        Segments of a commit whose outcome is unknown (`CommitUnknownError`, or a commit an
        interrupt cut short) are left for gc, which decides from the manifests; every other
        held segment is certainly unpublished.
        """
        with contextlib.suppress(Exception):
            self._flusher.wait()  # a shard still being written would re-create the folder
        maybe = {seg.id for seg in self._unresolved[0]} if self._unresolved else set()
        maybe |= self._interrupted
        self._unresolved, self._interrupted = None, set()
        self._segment = None
        self._finished.clear()
        for seg_id in self._held:
            if seg_id not in maybe:
                self.storage.delete_tree(paths.segment_dir(seg_id))  # the lease goes with it
            self.leases.drop(seg_id, delete=False)
        self._held.clear()
        self._new_ids.clear()
        self._skipped.clear()
        self._runs.clear()

    def close(self) -> None:
        """End the writer. Segments not committed by now stay on disk, unleased, for gc to sweep.

        They are not deleted here: after a commit that raised, whether they were published is
        for gc to decide from the manifest, not for this writer to guess.
        """
        if not self._closed:
            self._closed = True
            try:
                self._flusher.close()
                self._group.close()
            finally:
                self._release_at_gc()

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


class ViewWriter(Writer):
    """A writer whose commits move the view it was made from to the version they publish."""

    def __init__(self, ds: Dataset, **options: Any):
        super().__init__(ds.storage, ds.manifest, ds.sample_ids, **options)
        self._view = ds

    def commit(self) -> Manifest | None:
        published = super().commit()
        if published is not None and published.version > self._view.manifest.version:
            # The view takes the version at once but reads its new segments' indexes only when
            # something needs them (most writers never read their view again), then not those
            # the writer read (other writers' segments). Nothing is read here, so nothing can
            # turn the published commit into an error.
            self._view._move_to(published, self.take_indexes_read())
        return published
