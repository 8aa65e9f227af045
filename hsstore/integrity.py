"""Integrity: a full re-read of a dataset (`verify`) and debris removal (`gc`).

verify checks, in order: every manifest version against the schema; every committed file is
present with the recorded size (and crc32c for small files); every shard's index and every
chunk's crc32c; then every sample is decoded and compared with its checksum. Each problem names
the file and, where rows are involved, the sample ids affected.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field, replace
from typing import Any

import numpy as np

from hsstore.codecs import check_crc
from hsstore.errors import FormatError, HsstoreError, IntegrityError
from hsstore.format import commit, paths, zarr_meta
from hsstore.format.store import Storage, open_storage
from hsstore.segment import SegmentReader


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
            "problems": [asdict(p) for p in self.problems],
            "bad_samples": self.bad_samples,
        }


Progress = Callable[[int, int], None]  # (bytes done, bytes total)


def verify(
    path: str | os.PathLike[str] | Storage,
    *,
    workers: int | None = None,
    progress: Progress | None = None,
) -> VerifyReport:
    """Re-read everything committed; never raises for data problems, returns them instead."""
    from hsstore.dataset import Dataset

    t0 = time.perf_counter()
    storage = open_storage(path)
    path = storage.root
    report = VerifyReport(path=path, version=None)
    versions = commit.list_versions(storage)
    if not versions:
        report.problems.append(
            Problem("manifest", str(path), "not an hsstore dataset (no committed manifest)")
        )
        return report
    for v in versions:
        try:
            commit.load_manifest(storage, v)
        except HsstoreError as exc:
            report.problems.append(
                Problem("manifest", storage.path_of(paths.manifest_key(v)), exc.message)
            )
    try:
        manifest = commit.load_manifest(storage)
    except HsstoreError as exc:
        if not report.problems:
            report.problems.append(Problem("manifest", exc.path or str(path), exc.message))
        report.seconds = time.perf_counter() - t0
        return report
    report.version = manifest.version

    total = sum(f.size for s in manifest.segments for f in s.files.values())
    done = [0]

    def tick(n: int) -> None:
        done[0] += n
        report.bytes_read += n
        if progress is not None:
            progress(done[0], total * 2)

    # Files first: a segment whose index or columns are damaged cannot be read sample by
    # sample, so it is reported whole and left out of the sample pass.
    good_segments = []
    for seg in manifest.segments:
        reader = SegmentReader(storage, manifest, seg)
        rows_to_ids = _row_mapper(reader)
        segment_ok = True
        for relpath, info in seg.files.items():
            report.files_checked += 1
            problems = _check_file(reader, relpath, info.size, info.crc32c, rows_to_ids, tick)
            if problems:
                report.problems.extend(problems)
                segment_ok = segment_ok and relpath.startswith(f"{paths.STATES}/c/")
        if segment_ok:
            good_segments.append(seg)
    ds = Dataset(
        storage, verify_reads=True, manifest=replace(manifest, segments=tuple(good_segments))
    )

    reported = {sid for p in report.problems for sid in p.sample_ids}
    todo = list(range(len(ds)))
    sample_bytes = ds.manifest.num_layers * ds.hidden_size * ds.manifest.storage_dtype.itemsize

    def check(i: int) -> Problem | None:
        try:
            ds.read(i)
        except HsstoreError as exc:
            return Problem("sample", exc.path or str(path), exc.message, [ds.sample_ids[i]])
        finally:
            tick(int(ds._len[i]) * sample_bytes)
        return None

    with ThreadPoolExecutor(max_workers=workers or os.cpu_count() or 1) as pool:
        for problem in pool.map(check, todo):
            report.samples_checked += 1
            if problem is not None and problem.sample_ids[0] not in reported:
                report.problems.append(problem)
    report.seconds = time.perf_counter() - t0
    return report


def _row_mapper(reader: SegmentReader) -> Callable[[int, int], list[str]]:
    """Sample ids of one segment whose rows overlap [lo, hi); none if its index is unreadable."""
    try:
        index = reader.index()
    except HsstoreError:
        return lambda lo, hi: []
    starts = index.column("row_offset").to_numpy()
    ends = starts + index.column("num_tokens").to_numpy()
    ids = index.column("sample_id").to_pylist()

    def overlap(lo: int, hi: int) -> list[str]:
        return [ids[i] for i in np.flatnonzero((starts < hi) & (ends > lo))]

    return overlap


def _check_file(
    reader: SegmentReader,
    relpath: str,
    size: int,
    crc: int | None,
    rows_to_ids: Callable[[int, int], list[str]],
    tick: Callable[[int], None],
) -> list[Problem] | None:
    where = reader.where(relpath)
    is_shard = relpath.startswith(f"{paths.STATES}/c/")
    everyone = rows_to_ids(0, 2**62)
    if not is_shard:
        try:
            reader.read_small(relpath)
            tick(size)
        except (IntegrityError, FormatError) as exc:
            reason = exc.message
            if relpath == paths.INDEX:
                reason += f" (index of {reader.info.num_samples} samples: none can be located)"
            return [Problem("file", where, reason, everyone)]
        return None
    shard = int(relpath.split("/")[2])
    layout = reader.manifest.layout
    shard_rows = (shard * layout.rows_per_shard, (shard + 1) * layout.rows_per_shard)
    try:
        data = reader.storage.read_bytes(paths.segment_file(reader.info.id, relpath))
    except FileNotFoundError:
        return [Problem("file", where, "committed shard file is missing", rows_to_ids(*shard_rows))]
    tick(len(data))
    if len(data) != size:
        return [Problem("file", where, f"shard has {len(data)} bytes, manifest says {size} (truncated?)",
                        rows_to_ids(*shard_rows))]  # fmt: skip
    n_lc = reader.manifest.num_layers // layout.layers_per_chunk
    n_index = zarr_meta.shard_index_nbytes(layout.chunks_per_shard * n_lc)
    try:
        body = check_crc(memoryview(data)[-n_index:], what=where)
    except IntegrityError:
        return [Problem("file", where, "shard index crc32c mismatch", rows_to_ids(*shard_rows))]
    idx = np.frombuffer(body, dtype="<u8").reshape(layout.chunks_per_shard, n_lc, 2)
    problems = []
    for c in range(layout.chunks_per_shard):
        for j in range(n_lc):
            off, nb = (int(v) for v in idx[c, j])
            if off == zarr_meta.EMPTY:
                continue
            rows = (
                shard_rows[0] + c * layout.rows_per_chunk,
                shard_rows[0] + (c + 1) * layout.rows_per_chunk,
            )
            try:
                if off + nb > len(data) - n_index:
                    raise IntegrityError("chunk extends past the shard data", path=where)
                check_crc(memoryview(data)[off : off + nb], what=where)
            except IntegrityError as exc:
                problems.append(
                    Problem("chunk", f"{where} chunk ({c}, {j})", exc.message, rows_to_ids(*rows))
                )
    return problems or None


def gc(
    path: str | os.PathLike[str] | Storage,
    *,
    keep_versions: int | None = None,
    grace_s: float = 60.0,
) -> commit.GcReport:
    """Remove debris left by crashed writers (never anything a committed version references)."""
    return commit.gc(open_storage(path), keep_versions=keep_versions, grace_s=grace_s)
