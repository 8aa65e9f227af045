"""Integrity: a full re-read of a dataset (`verify`) and debris removal (`gc`).

verify checks, in order: the root and segments/ Zarr group documents; the hint; the version
history (no gaps, no lost newest version: hint, hash chain and commit marks) and the files that
make the latest version (their checksums, schema and consistency), or with ``full`` every
version file and checkpoint; every committed file is present with the recorded size
(and crc32c for small files); every shard's index and every chunk's crc32c and decoded size;
then every sample is decoded and compared with its checksum. Each problem names the file and,
where rows are involved, the sample ids affected.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np
import pyarrow as pa

from hsstore.commits import commit, history
from hsstore.commits.rebuild import rebuild
from hsstore.dataset.sample_pass import sample_pass
from hsstore.errors import HsstoreError, IntegrityError, NotADatasetError, UnsupportedVersionError
from hsstore.segment.check import check_shard
from hsstore.segment.reader import SegmentReader
from hsstore.spec import paths
from hsstore.spec.manifest import Delta, Manifest
from hsstore.storage.locations import open_storage
from hsstore.storage.store import Storage


@dataclass
class Problem:
    kind: str  # "manifest" | "file" | "chunk" | "sample"
    where: str
    reason: str
    sample_ids: list[str] = field(default_factory=list)


@dataclass
class VerifyReport:
    path: str
    version: int | None
    problems: list[Problem] = field(default_factory=list)
    samples_checked: int = 0
    files_checked: int = 0
    bytes_read: int = 0
    seconds: float = 0.0
    # Which manifest files were read: the latest version's chain, or (``full``) every one.
    history: str = ""
    # Findings that are not damage (a missing hint, say): reported, never failing verify.
    notes: list[str] = field(default_factory=list)
    # Segments none of whose samples can be read (their index is unusable), with why.
    unreadable_segments: dict[str, str] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return not self.problems

    @property
    def bad_samples(self) -> dict[str, str]:
        """Each affected sample id with the first reason found for it."""
        out: dict[str, str] = {}
        for p in self.problems:
            for sid in p.sample_ids:
                out.setdefault(sid, f"{p.reason} ({p.where})")
        return out

    @property
    def gb_per_s(self) -> float:
        return self.bytes_read / self.seconds / 1e9 if self.seconds else 0.0

    def to_json(self) -> dict[str, Any]:
        return {
            "path": self.path,
            "version": self.version,
            "ok": self.ok,
            "samples_checked": self.samples_checked,
            "files_checked": self.files_checked,
            "bytes_read": self.bytes_read,
            "seconds": round(self.seconds, 3),
            "gb_per_s": round(self.gb_per_s, 3),
            "history": self.history,
            "notes": list(self.notes),
            "unreadable_segments": dict(self.unreadable_segments),
            "problems": [asdict(p) for p in self.problems],
            "bad_samples": self.bad_samples,
        }


Progress = Callable[[int, int], None]  # (bytes done, bytes total)


def verify(
    path: str | os.PathLike[str] | Storage,
    *,
    workers: int | None = None,
    progress: Progress | None = None,
    full: bool = False,
) -> VerifyReport:
    """Re-read everything committed; never raises for data problems, returns them instead.

    The manifests read are those that make the latest version (its checkpoint and the deltas
    after it); ``full`` also reads every older version file and checkpoint and checks the
    hash chain that links them.
    """
    t0 = time.perf_counter()
    storage = open_storage(path)
    report = VerifyReport(path=storage.root, version=None)
    manifest = _check_manifests(storage, report, full=full)
    if manifest is not None:
        report.version = manifest.version
        check_segments(storage, manifest, report, workers=workers, progress=progress)
    report.seconds = time.perf_counter() - t0
    return report


def check_segments(
    storage: Storage,
    manifest: Manifest,
    report: VerifyReport,
    *,
    workers: int | None = None,
    progress: Progress | None = None,
) -> None:
    """Every committed file, shard and sample of ``manifest``'s segments, into ``report``."""
    total = sum(f.size for s in manifest.segments for f in s.files.values())
    done = [0]

    def tick(n: int) -> None:
        done[0] += n
        report.bytes_read += n
        if progress is not None:
            progress(done[0], total * 2)

    def checked(samples: int, nbytes: int) -> None:
        report.samples_checked += samples
        tick(nbytes)

    bad_samples: list[Problem] = []

    def failed(sample_id: str, exc: HsstoreError | OSError) -> None:
        if isinstance(exc, HsstoreError):
            bad_samples.append(
                Problem("sample", exc.path or storage.root, exc.message, [sample_id])
            )
        else:
            where = str(exc.filename or storage.root)
            bad_samples.append(Problem("sample", where, f"cannot read ({exc})", [sample_id]))

    # Files first, segment by segment, while the samples of the segments before are checked: a
    # segment whose index is damaged cannot be read sample by sample, so it is reported whole
    # and left out of the sample pass; any other damage is found sample by sample, naming
    # exactly the samples it affects.
    threads = workers or os.cpu_count() or 1
    with sample_pass(storage, manifest, workers=threads, checked=checked, failed=failed) as samples:
        for seg in manifest.segments:
            reader = SegmentReader(storage, manifest, seg)
            index, unusable = _check_segment_files(reader, report, tick)
            if index is not None:
                samples.add(reader, index)
            else:
                report.unreadable_segments[seg.id] = unusable or ""
    reported = {sid for p in report.problems for sid in p.sample_ids}
    report.problems += [p for p in bad_samples if p.sample_ids[0] not in reported]


def _check_manifests(storage: Storage, report: VerifyReport, *, full: bool) -> Manifest | None:
    """The dataset's own metadata: group documents, the hint, the version history and the
    latest manifest, with the evidence of lost versions. Reads the files that make the latest
    version (a checkpoint and the deltas after it) or, with ``full``, every version file and
    checkpoint; returns the latest manifest, or None when there is none to check."""

    def problem(where: str, reason: str) -> None:
        report.problems.append(Problem("manifest", where, reason))

    for key in (paths.ROOT_ZARR_JSON, paths.SEGMENTS_ZARR_JSON):
        reason = _group_document_problem(storage, key)
        if reason:
            problem(storage.path_of(key), reason)
    try:
        names = storage.list(paths.MANIFESTS)
    except (HsstoreError, OSError) as exc:
        problem(storage.root, f"cannot list manifests ({exc})")
        return None
    versions = sorted(v for v in map(paths.manifest_version, names) if v is not None)
    checkpoints = sorted(v for v in map(paths.checkpoint_version, names) if v is not None)
    if not versions:
        problem(storage.root, "not an hsstore dataset (no committed manifest)")
        return None
    for v in sorted(set(range(versions[0], versions[-1] + 1)) - set(versions)):
        where = storage.path_of(paths.manifest_key(v))
        if v in checkpoints:  # its state is whole in the checkpoint (a repair bridged it)
            report.notes.append(f"{where}: manifest version {v} is missing; checkpoint {v} "
                                f"holds its state")  # fmt: skip
        else:
            problem(where, f"manifest version {v} is missing")
    hint = history.read_hint(storage)
    if hint.problem is not None:
        problem(storage.path_of(paths.LATEST_HINT), hint.problem)
    elif hint.version is None and versions[-1] > 1:
        report.notes.append(
            f"{storage.path_of(paths.LATEST_HINT)}: no version hint (a rollback of the newest "
            f"versions can then be told only from the segments they committed)"
        )
    try:
        history.check_not_rolled_back(storage, versions[-1])
    except HsstoreError as exc:
        problem(exc.path or storage.root, exc.message)
    try:
        manifest = history.fold(storage, versions[-1], checkpoints)
    except HsstoreError as exc:
        if (exc.path or storage.root) not in {p.where for p in report.problems}:
            problem(exc.path or storage.root, exc.message)  # (a missing one is reported above)
        if isinstance(exc, UnsupportedVersionError):
            return None
        manifest = _rebuilt(storage, report, problem)
        if manifest is None:
            return None
    except OSError as exc:
        problem(storage.root, f"cannot read manifest ({exc.strerror or exc})")
        return None
    for check in (history.check_hint_matches, history.check_no_lost_commits):
        try:
            check(storage, manifest)
        except HsstoreError as exc:
            problem(exc.path or storage.root, exc.message)
    base = max((c for c in checkpoints if c <= versions[-1]), default=versions[0])
    report.history = (
        f"latest version {versions[-1]}: read checkpoint {base} and the deltas after it, not "
        f"the {len(versions)} version files of the history (verify --full reads them all)"
        if base > versions[0] and not full
        else f"every version file ({versions[0]}..{versions[-1]}) and checkpoint read"
    )
    for c in checkpoints:  # the newest two; older ones are pruned
        reason = _checkpoint_problem(storage, c, manifest)
        if reason:
            problem(storage.path_of(paths.checkpoint_key(c)), reason)
    if full:
        _check_every_version(storage, versions, checkpoints, manifest, problem)
    elif _written_by_format_1(storage, versions[0]):
        _check_format_1_versions(storage, versions, manifest, problem)
    return manifest


def _rebuilt(
    storage: Storage, report: VerifyReport, problem: Callable[[str, str], None]
) -> Manifest | None:
    """The latest version rebuilt around lost or damaged files (each reported), so the
    segments are still checked; None when it cannot be rebuilt."""
    try:
        found = rebuild(storage)
    except HsstoreError as exc:
        problem(exc.path or storage.root, exc.message)
        return None
    if not found.unusable:  # no file to set aside (a replaced one): the fold's problem stands
        return None
    seen = {p.where for p in report.problems}
    for v, why in sorted(found.unusable.items()):
        where = storage.path_of(paths.manifest_key(v))
        if where not in seen and why != "missing":
            problem(where, why)
    report.notes.append(found.describe(storage))
    return found.manifest


def _check_format_1_versions(
    storage: Storage, versions: list[int], manifest: Manifest, problem: Callable[[str, str], None]
) -> None:
    """Format 1 versions are full manifests: each older one must list only segments the latest
    still lists (segments are only removed by a recorded repair), or it points at lost data."""
    latest_ids = {s.id for s in manifest.segments}
    latest_ids |= {r.get("segment") for r in manifest.provenance.get("repairs", [])}
    for v in versions[:-1]:
        try:
            older = commit.read_version(storage, v)
        except HsstoreError as exc:
            problem(exc.path or storage.root, exc.message)
            continue
        if isinstance(older, Manifest):
            lost = [s.id for s in older.segments if s.id not in latest_ids]
            if lost:
                problem(
                    storage.path_of(paths.manifest_key(v)),
                    f"lists {len(lost)} segment(s) the latest version does not "
                    f"(first: {lost[0]}): committed data was removed",
                )


def _check_every_version(
    storage: Storage,
    versions: list[int],
    checkpoints: list[int],
    latest: Manifest,
    problem: Callable[[str, str], None],
) -> None:
    """verify --full: read every version file, check each link of the hash chain, and fold the
    whole history, which must end in the latest version."""

    def every_version() -> Iterator[tuple[int, Manifest | Delta | None]]:
        for v in range(versions[0], versions[-1] + 1):
            try:
                yield v, commit.read_version(storage, v)
            except (HsstoreError, OSError) as exc:
                if not isinstance(exc, NotADatasetError):  # a gap is reported with the listing
                    where = getattr(exc, "path", None) or storage.path_of(paths.manifest_key(v))
                    problem(where, getattr(exc, "message", str(exc)))
                yield v, None

    state = history.replay(storage, every_version(), checkpoints=checkpoints, problem=problem)
    if state is None:
        problem(storage.root, "the history cannot be folded up to the latest version")
    elif state.segments != latest.segments:
        problem(storage.root, "the history does not fold to the latest version")


def _checkpoint_problem(storage: Storage, version: int, latest: Manifest) -> str | None:
    """A checkpoint is redundant (readers pass a bad one over): it must load and be a prefix
    of the latest version."""
    try:
        folded = commit.read_checkpoint(storage, version)
    except HsstoreError as exc:
        return f"{exc.message} (readers fold from an older base instead)"
    if version > latest.version:
        return f"checkpoint of version {version} is newer than the latest version"
    same_fixed = (folded.dataset_id, folded.layers, folded.layout, folded.hidden_size,
                  folded.dtype, folded.codec) == (latest.dataset_id, latest.layers, latest.layout,
                  latest.hidden_size, latest.dtype, latest.codec)  # fmt: skip
    # What a later repair removed (on record) is no longer in the latest version.
    removed = {r.get("segment") for r in latest.provenance.get("repairs", [])}
    kept = tuple(s for s in folded.segments if s.id not in removed)
    if (
        not same_fixed
        or kept != tuple(s for s in latest.segments if s.id not in removed)[: len(kept)]
    ):
        return "checkpoint disagrees with the versions it folds"
    return None


def _written_by_format_1(storage: Storage, oldest: int) -> bool:
    try:
        first = commit.read_version(storage, oldest)
    except HsstoreError:
        return False  # reported with the latest version's chain, or harmless below it
    return isinstance(first, Manifest) and first.format_version == 1


def _group_document_problem(storage: Storage, key: str) -> str | None:
    try:
        doc = json.loads(storage.read_bytes(key))
    except FileNotFoundError:
        return "Zarr group document is missing"
    except (OSError, ValueError, RecursionError) as exc:
        return f"Zarr group document is not valid JSON ({type(exc).__name__})"
    if not isinstance(doc, dict) or doc.get("zarr_format") != 3 or doc.get("node_type") != "group":
        return 'not a Zarr v3 group document (expected zarr_format 3, node_type "group")'
    return None


def _check_segment_files(
    reader: SegmentReader, report: VerifyReport, tick: Callable[[int], None]
) -> tuple[pa.Table | None, str | None]:
    """Check every file of one segment; its sample index, or None and why it is unusable (then
    no sample of it can be read, so there is no sample pass)."""
    rows_to_ids, index, index_error = _row_mapper(reader)
    index_file_bad = False
    for relpath, info in reader.info.files.items():
        report.files_checked += 1
        shard = paths.shard_of(relpath)
        if shard is not None:
            found = check_shard(reader, shard)
            tick(found.nbytes)
            where = reader.where(relpath)
            if found.error is not None:
                report.problems.append(
                    Problem("file", where, found.error, rows_to_ids(*found.rows))
                )
            for bad in found.chunks:
                report.problems.append(
                    Problem(
                        "chunk", f"{where} chunk {bad.chunk}", bad.reason, rows_to_ids(*bad.rows)
                    )
                )
            continue
        try:
            reader.read_small(relpath, copy=False)  # the file itself, not its copy
            tick(info.size)
        except (HsstoreError, OSError) as exc:
            sample_ids: list[str] = []
            reason = exc.message if isinstance(exc, HsstoreError) else f"cannot read ({exc})"
            if relpath == paths.INDEX and index_error is None and _copy_serves(reader):
                reason += " (its copy is intact: every sample reads; hsstore repair writes it back)"
            elif relpath == paths.INDEX:
                index_file_bad = True
                sample_ids = reader.salvage_sample_ids()
                reason += (
                    f" (index of {reader.info.num_samples} samples: "
                    + (f"{len(sample_ids)} named from what still decodes)" if sample_ids
                       else "none can be named)")
                )  # fmt: skip
            report.problems.append(Problem("file", reader.where(relpath), reason, sample_ids))
    if index_error is not None and not index_file_bad:
        # Intact bytes that do not make a usable index (a schema or rows that do not fit the
        # segment): the file check passed, so this is the only report of it.
        reason = (
            index_error.message
            if isinstance(index_error, HsstoreError)
            else f"cannot read ({index_error})"
        )
        report.problems.append(
            Problem("file", reader.where(paths.INDEX), reason, reader.salvage_sample_ids())
        )
    if index_error is None:
        return index, None
    return None, (
        str(index_error)
        if isinstance(index_error, HsstoreError)
        else (f"{reader.where(paths.INDEX)}: cannot read ({index_error})")
    )


def _copy_serves(reader: SegmentReader) -> bool:
    try:
        reader.read_small(paths.INDEX)  # the copy, when the index itself is damaged
    except (HsstoreError, OSError):
        return False
    return True


def _row_mapper(
    reader: SegmentReader,
) -> tuple[Callable[[int, int], list[str]], pa.Table | None, HsstoreError | OSError | None]:
    """Sample ids of one segment whose rows overlap [lo, hi), its sample index, and why that
    does not read (None when it does)."""
    try:
        index = reader.index()
        if index.num_rows != reader.info.num_samples:
            raise IntegrityError(
                f"index has {index.num_rows} rows, manifest says {reader.info.num_samples}",
                path=reader.where(paths.INDEX),
            )
    except (HsstoreError, OSError) as exc:
        return (lambda lo, hi: []), None, exc
    starts = index.column("row_offset").to_numpy()
    ends = starts + index.column("num_tokens").to_numpy()
    ids = index.column("sample_id")

    def overlap(lo: int, hi: int) -> list[str]:
        return ids.take(np.flatnonzero((starts < hi) & (ends > lo))).to_pylist()

    return overlap, index, None


def gc(
    path: str | os.PathLike[str] | Storage,
    *,
    keep_versions: int | None = None,
    grace_s: float = 60.0,
) -> commit.GcReport:
    """Remove debris left by crashed writers (never anything a committed version references)."""
    storage = open_storage(path)
    storage.check_root()  # a missing path is said as everywhere else
    return commit.gc(storage, keep_versions=keep_versions, grace_s=grace_s)
