"""Versions of a dataset: reading the latest manifest, publishing the next one, and gc.

A commit is optimistic: read the latest version N, build N+1 from it, and create
``manifests/v{N+1}.json`` with put-if-absent. If another writer got there first, re-read and
try again. Published manifests are never rewritten, so a reader holding version N keeps a
consistent view, and a writer killed at any point leaves at most unreferenced files (debris),
which readers never look at and `gc` removes.
"""

from __future__ import annotations

import fcntl
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from hsstore.errors import FormatError, NotADatasetError
from hsstore.format import paths
from hsstore.format.manifest import Manifest
from hsstore.format.store import LocalStorage, Storage


def list_versions(storage: Storage) -> list[int]:
    versions = [paths.manifest_version(n) for n in storage.list(paths.MANIFESTS)]
    return sorted(v for v in versions if v is not None)


def load_manifest(storage: Storage, version: int | None = None) -> Manifest:
    """The given version, or the latest. Raises NotADatasetError when there is none."""
    if version is None:
        versions = list_versions(storage)
        if not versions:
            raise NotADatasetError(
                "not an hsstore dataset (no manifests/ with a committed version)",
                path=storage.root,
            )
        version = versions[-1]
    key = paths.manifest_key(version)
    try:
        data = storage.read_bytes(key)
    except FileNotFoundError as exc:
        raise NotADatasetError(f"no manifest version {version}", path=storage.root) from exc
    man = Manifest.from_bytes(data, where=storage.path_of(key))
    if man.version != version:
        raise FormatError(
            f"manifest says version {man.version} but is named for {version}",
            path=storage.path_of(key),
        )
    return man


def publish(
    storage: Storage,
    build_next: Callable[[Manifest], Manifest],
    *,
    max_attempts: int = 1000,
) -> Manifest:
    """Publish ``build_next(latest)`` as the next version; retried when a writer races us.

    ``build_next`` must be a pure function of the latest manifest (it is called again after a
    lost race) and may raise to abort the commit.
    """
    for attempt in range(max_attempts):
        latest = load_manifest(storage)
        nxt = build_next(latest)
        if nxt.version != latest.version + 1:
            raise FormatError("build_next must produce the next version number")
        if storage.put_if_absent(paths.manifest_key(nxt.version), nxt.to_bytes()):
            return nxt
        time.sleep(min(0.05, 0.001 * (attempt + 1)))
    raise FormatError(f"could not publish after {max_attempts} attempts", path=storage.root)


class SegmentLock:
    """Held by a live writer on each segment it is filling, until that segment is committed.

    gc treats an unreferenced segment as debris only when it can take this lock, i.e. when
    the writer that made it is gone (the kernel drops flock locks of a killed process).
    """

    def __init__(self, storage: LocalStorage, segment_id: str):
        folder = os.path.join(storage.root, paths.segment_dir(segment_id))
        os.makedirs(folder, exist_ok=False)
        self._fd = os.open(os.path.join(folder, paths.WRITING_LOCK), os.O_CREAT | os.O_RDWR, 0o644)
        fcntl.flock(self._fd, fcntl.LOCK_EX)

    def release(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1


def _segment_is_live(storage: LocalStorage, segment_id: str, *, grace_s: float) -> bool:
    folder = os.path.join(storage.root, paths.segment_dir(segment_id))
    lock = os.path.join(folder, paths.WRITING_LOCK)
    try:
        fd = os.open(lock, os.O_RDWR)
    except FileNotFoundError:
        # A writer creates the lock right after the folder; give a just-born folder time.
        try:
            return time.time() - os.stat(folder).st_mtime < grace_s
        except FileNotFoundError:
            return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    finally:
        os.close(fd)
    return False


@dataclass
class GcReport:
    removed_segments: list[str] = field(default_factory=list)
    removed_files: list[str] = field(default_factory=list)
    live_segments: list[str] = field(default_factory=list)
    pruned_manifests: list[int] = field(default_factory=list)


def gc(
    storage: LocalStorage, *, keep_versions: int | None = None, grace_s: float = 60.0
) -> GcReport:
    """Remove what no committed version references and no live writer holds.

    keep_versions: also delete manifest versions older than the newest ``keep_versions``
    (None keeps every version; their segments are kept either way, since segments are only
    ever added).
    """
    report = GcReport()
    versions = list_versions(storage)
    if not versions:
        raise NotADatasetError("not an hsstore dataset", path=storage.root)
    latest = load_manifest(storage, versions[-1])
    referenced = {s.id for s in latest.segments}
    dead = []
    for name in storage.list(paths.SEGMENTS):
        if name == "zarr.json" or name in referenced:
            continue
        if _segment_is_live(storage, name, grace_s=grace_s):
            report.live_segments.append(name)
        else:
            dead.append(name)
    # A writer publishes its manifest before it drops its lock: re-reading the latest version
    # after the lock checks sees every segment whose lock we found free but was committed.
    referenced = {s.id for s in load_manifest(storage).segments}
    for name in dead:
        if name not in referenced:
            storage.delete_tree(paths.segment_dir(name))
            report.removed_segments.append(name)
    for name in storage.list(paths.MANIFESTS):
        if name.startswith(".tmp-"):
            storage.delete(f"{paths.MANIFESTS}/{name}")
            report.removed_files.append(f"{paths.MANIFESTS}/{name}")
    if keep_versions is not None and keep_versions >= 1:
        for v in versions[:-keep_versions]:
            storage.delete(paths.manifest_key(v))
            report.pruned_manifests.append(v)
    return report
