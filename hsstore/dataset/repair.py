"""Repair: publish a version that keeps every sample that still reads and records the rest.

What a repair decides (each decision goes into ``provenance.repairs`` of the version it
publishes, with the segment, the sample ids and why):

- **restored**: a segment whose version was lost (its manifest file deleted, a rollback) but
  whose commit mark and files survive is listed again, so nothing committed is lost;
- **dropped**: a segment with damaged or missing files. Its samples that still read are written
  again into a new segment first, so only the samples that cannot be read leave the dataset;
  rerunning the extract or convert that wrote them adds them again (both skip ids already
  committed);
- **accepted**: a version announced by the hint but lost without a trace is given up
  explicitly (the hint is rewritten), instead of every reader refusing the dataset.

A damaged hint is rewritten. The repair is an ordinary commit: a concurrent writer is not
disturbed, and a crash leaves at most an uncommitted segment for gc.
"""

from __future__ import annotations

import contextlib
import os
import re
import uuid
from dataclasses import dataclass, field, replace
from typing import Any

from hsstore.commits import commit, history
from hsstore.commits.lease import LeaseKeeper
from hsstore.commits.restore import (
    remove_bridged,
    restore_history,
    restore_index_copies,
    restore_redundancy,
)
from hsstore.dataset.integrity import VerifyReport, check_segments
from hsstore.errors import ConflictError, HsstoreError
from hsstore.segment.reader import SegmentReader
from hsstore.segment.writer import SegmentWriter, ShardFlusher
from hsstore.spec import paths
from hsstore.spec.dtypes import storage_view
from hsstore.spec.manifest import Delta, Manifest, SegmentInfo
from hsstore.storage.damage import PERSISTENT_EIO
from hsstore.storage.locations import open_storage
from hsstore.storage.store import Storage

_SEGMENT_IN_PATH = re.compile(r"segments/([0-9a-f]{32})(?:/|$)")


@dataclass
class RepairReport:
    path: str
    version: int | None = None  # the version published (None: nothing needed repair)
    repairs: list[dict[str, Any]] = field(default_factory=list)
    samples_rewritten: int = 0
    hint_rewritten: bool = False
    # Files written back from a surviving copy, or to restore a copy (no version needed).
    files_restored: list[str] = field(default_factory=list)

    @property
    def dropped_samples(self) -> list[str]:
        return [s for r in self.repairs if r["action"] == "dropped" for s in r["sample_ids"]]


def repair(path: str | os.PathLike[str] | Storage, *, workers: int | None = None) -> RepairReport:
    """Make the latest version fully readable again (see the module docstring); returns what
    was decided. Raises when the history itself cannot be read (nothing is changed then)."""
    storage = open_storage(path)
    storage.check_root()  # a missing path is said as everywhere else
    # The hint before the listing: a hint is written after its version, so a writer that
    # publishes meanwhile can never make its version look announced but lost.
    hint = history.read_hint(storage)
    found, history_done = restore_history(storage)
    latest = found.manifest
    report = RepairReport(path=storage.root, files_restored=history_done.files)
    report.repairs.extend(history_done.repairs)
    restored = _lost_segments(storage, latest, report)
    lost_hint = hint.version is not None and hint.version > latest.version
    replaced = (
        hint.version == latest.version
        and None not in (hint.checksum, latest.head_checksum)
        and hint.checksum != latest.head_checksum
    )
    if (lost_hint or replaced) and not restored:
        report.repairs.append(
            {
                "action": "accepted",
                "num_samples": 0,
                "sample_ids": [],
                "reason": f"version {hint.version} was announced but its manifest file is "
                + ("missing" if lost_hint else "another one")
                + " and no segment of it survives: the loss is accepted",
            }
        )
    # The state to check: the latest version with the lost segments listed again.
    candidate = replace(latest, segments=latest.segments + tuple(restored))
    restore_index_copies(storage, candidate, history_done)  # before the check: no loss
    report.files_restored = history_done.files
    checked = VerifyReport(path=storage.root, version=latest.version)
    check_segments(storage, candidate, checked, workers=workers)
    damaged = _damaged_segments(checked)
    _keep_glitches(storage, candidate, damaged, workers)
    if hint.problem is not None or lost_hint or replaced or hint.version is None:
        # Explicitly decided above: from now on the listing is the truth the hint announces.
        storage.delete(paths.LATEST_HINT)
        storage.put_if_absent(
            paths.LATEST_HINT, history.encode_hint(latest.version, latest.head_checksum)
        )
        report.hint_rewritten = True
    final = latest
    if report.repairs or damaged:
        final = _publish_repair(storage, candidate, latest, restored, damaged, checked, report)
        remove_bridged(storage, history_done)
    restore_redundancy(storage, final, found.added_by, history_done)
    return report


def _lost_segments(storage: Storage, latest: Manifest, report: RepairReport) -> list[SegmentInfo]:
    """The segments lost versions committed (their commit marks), to be listed again."""
    restored = []
    for seg_id, version in sorted(history.lost_commits(storage, latest), key=lambda x: x[1]):
        mark = history.read_mark(storage, seg_id)
        if mark is None:
            continue
        info = SegmentInfo.from_json(
            mark["segment"], where=storage.path_of(history.mark_key(seg_id))
        )
        restored.append(info)
        report.repairs.append(
            {
                "action": "restored",
                "segment": seg_id,
                "num_samples": info.num_samples,
                "sample_ids": [],
                "reason": f"committed by version {version}, whose manifest file was lost",
            }
        )
    return restored


def _damaged_segments(found: VerifyReport) -> dict[str, list[tuple[str, str]]]:
    """Each segment with a problem: (sample id or "", reason) per problem found in it."""
    damaged: dict[str, list[tuple[str, str]]] = {}
    for seg_id, why in found.unreadable_segments.items():
        damaged.setdefault(seg_id, []).append(("", why))
    for p in found.problems:
        match = _SEGMENT_IN_PATH.search(p.where)
        if match is None:
            continue
        for sid in p.sample_ids or [""]:
            damaged.setdefault(match.group(1), []).append((sid, f"{p.reason} ({p.where})"))
    return damaged


def _keep_glitches(
    storage: Storage,
    candidate: Manifest,
    damaged: dict[str, list[tuple[str, str]]],
    workers: int | None,
) -> None:
    """Check once more each segment damaged by persistent I/O errors alone: one that reads
    now had a glitch, not damage, and is kept (a repair must never drop what a healthy disk
    would read; see hsstore.storage.damage)."""
    eio = [
        s
        for s in candidate.segments
        if s.id in damaged and all(PERSISTENT_EIO in why for _, why in damaged[s.id])
    ]
    if not eio:
        return
    again = VerifyReport(path=storage.root, version=candidate.version)
    check_segments(storage, replace(candidate, segments=tuple(eio)), again, workers=workers)
    still = _damaged_segments(again)
    for seg in eio:
        if seg.id not in still:
            del damaged[seg.id]


def _publish_repair(
    storage: Storage,
    candidate: Manifest,
    latest: Manifest,
    restored: list[SegmentInfo],
    damaged: dict[str, list[tuple[str, str]]],
    found: VerifyReport,
    report: RepairReport,
) -> Manifest:
    """Publish the repair's version; returns it."""
    from hsstore.dataset.dataset import Dataset

    keep = replace(candidate, segments=tuple(s for s in candidate.segments if s.id in damaged))
    ds = Dataset(storage, manifest=keep, verify_reads=True)
    keeper = LeaseKeeper(storage)
    new: list[SegmentInfo] = []
    try:
        rewritten = _rewrite(storage, candidate, ds, damaged, keeper, report)
        new = [rewritten] if rewritten is not None else []
        for seg in candidate.segments:
            if seg.id not in damaged:
                continue
            unreadable = seg.id in found.unreadable_segments
            lost_ids = sorted({sid for sid, _ in damaged[seg.id] if sid})
            if unreadable:
                lost_ids = sorted(set(lost_ids) | set(_salvaged_ids(storage, candidate, seg)))
            reasons = sorted({why for _, why in damaged[seg.id]})
            report.repairs.append(
                {
                    "action": "dropped",
                    "segment": seg.id,
                    "num_samples": seg.num_samples if unreadable else len(lost_ids),
                    "sample_ids": lost_ids,
                    "reason": "; ".join(reasons)[:2000],
                }
            )
        restored_ids = {s.id for s in restored}
        removed = {s for s in damaged if s not in restored_ids}

        def build_next(current: Manifest) -> Manifest:
            have = {s.id for s in current.segments}
            if not removed <= have:
                raise ConflictError("another repair changed the dataset meanwhile; rerun repair")
            kept = tuple(s for s in current.segments if s.id not in removed)
            added = tuple(s for s in restored if s.id not in damaged) + tuple(new)
            provenance = dict(current.provenance)
            provenance["repairs"] = list(provenance.get("repairs", [])) + report.repairs
            keeper.refresh_now([s.id for s in new])
            return current.with_segments(kept + added, provenance, current.version + 1)

        new_ids = {s.id for s in new}

        def refuse_condemned(delta: Delta) -> None:
            if new_ids.intersection(delta.condemn):
                raise ConflictError(
                    "gc condemned the segment this repair rewrote (it paused longer than the "
                    "lease ttl); nothing was published: rerun repair"
                )

        token = f"{commit.new_token()}.1"
        published = commit.publish(
            storage, build_next, token=token, base=latest, claims=refuse_condemned
        )
        kept_restored = [s for s in restored if s.id not in damaged]
        with contextlib.suppress(HsstoreError, OSError):
            history.mark_committed(storage, published, new + kept_restored)
        for seg_id in removed | (restored_ids & set(damaged)):
            storage.delete(history.mark_key(seg_id))  # decided: recorded in provenance
        report.version = published.version
        return published
    finally:
        for seg in new:
            with contextlib.suppress(HsstoreError, OSError):
                keeper.drop(seg.id)
        keeper.release_all()


def _rewrite(
    storage: Storage,
    man: Manifest,
    ds: Any,
    damaged: dict[str, list[tuple[str, str]]],
    keeper: LeaseKeeper,
    report: RepairReport,
) -> SegmentInfo | None:
    """Write the samples of the damaged segments that still read into one new segment (None
    when none does). A sample that fails to read here joins its segment's faults."""
    bad_ids = {sid for faults in damaged.values() for sid, _ in faults if sid}
    if all(sid in bad_ids for sid in ds.sample_ids):
        return None
    seg_id = uuid.uuid4().hex
    keeper.acquire(seg_id)
    layout = man.layout
    flusher = ShardFlusher(
        (layout.rows_per_shard, man.num_layers, man.hidden_size), man.storage_dtype, 1
    )
    index = ds.index
    sources = index.column("source").to_pylist()
    segment_of = index.column("segment").to_numpy()
    try:
        writer = SegmentWriter(storage, man, seg_id, flusher)
        for i, sid in enumerate(ds.sample_ids):
            if sid in bad_ids:
                continue
            try:
                sample = ds.read(i)
            except HsstoreError as exc:
                owner = ds.segment_reader(int(segment_of[i])).info.id
                damaged[owner].append((sid, str(exc)))
                continue
            writer.add(
                sid,
                sample.input_ids.numpy().astype("<i4"),
                sample.loss_mask.numpy().astype("<u1"),
                storage_view(sample.hidden),
                sources[i],
                None if sample.scales is None else sample.scales.numpy(),
            )
            report.samples_rewritten += 1
        if writer.num_samples:
            return writer.finalize()
    finally:
        flusher.close()
    keeper.drop(seg_id, delete=False)  # the heartbeat stops before the folder goes
    storage.delete_tree(paths.segment_dir(seg_id))
    return None


def _salvaged_ids(storage: Storage, man: Manifest, seg: SegmentInfo) -> list[str]:
    with contextlib.suppress(HsstoreError, OSError):
        return SegmentReader(storage, man, seg).salvage_sample_ids()
    return []
