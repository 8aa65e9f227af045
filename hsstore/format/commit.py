"""Versions of a dataset: reading the latest manifest, publishing the next one, and gc.

A commit is optimistic: read the latest version N, build N+1 from it, and create
``manifests/v{N+1}.json`` with put-if-absent. If another writer got there first, re-read and
try again. Published manifests are never rewritten, so a reader holding version N keeps a
consistent view, and a writer killed at any point leaves at most unreferenced files (debris),
which readers never look at and `gc` removes.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

from hsstore.errors import FormatError, NotADatasetError
from hsstore.format import paths
from hsstore.format.lease import lease_is_live, lease_key
from hsstore.format.manifest import Manifest
from hsstore.format.store import TEMP_PREFIX, Storage


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


@dataclass
class GcReport:
    removed_segments: list[str] = field(default_factory=list)
    removed_files: list[str] = field(default_factory=list)
    live_segments: list[str] = field(default_factory=list)
    pruned_manifests: list[int] = field(default_factory=list)


def gc(
    storage: Storage,
    *,
    keep_versions: int | None = None,
    grace_s: float = 60.0,
    pause: Callable[[str], None] | None = None,
) -> GcReport:
    """Remove what no committed version references and no live writer may still publish.

    An unreferenced segment is debris only when its lease (``.writing``) has lapsed or is gone
    AND its newest object is older than ``grace_s``, both on the storage's clock; a temporary
    file only when it is older than ``grace_s``. The latest version is re-read after those
    checks and just before deleting, so a segment whose writer committed meanwhile is kept (a
    writer publishes before it drops its lease). See docs/FORMAT.md, "Commits, leases and gc".

    keep_versions: also delete manifest versions older than the newest ``keep_versions``
    (None keeps every version; their segments are kept either way, since segments are only
    ever added). pause: a test hook, called with "listed" after the first manifest read and
    "checked" after the liveness checks, to run a writer step exactly there.
    """
    report = GcReport()
    versions = list_versions(storage)
    if not versions:
        raise NotADatasetError("not an hsstore dataset", path=storage.root)
    now = storage.now()
    latest = load_manifest(storage, versions[-1])
    referenced = {s.id for s in latest.segments}
    if pause is not None:
        pause("listed")
    dead = []
    for name in storage.list(paths.SEGMENTS):
        if name == "zarr.json" or name in referenced:
            continue
        if _segment_is_live(storage, name, now=now, grace_s=grace_s):
            report.live_segments.append(name)
        else:
            dead.append(name)
    if pause is not None:
        pause("checked")
    referenced = {s.id for s in load_manifest(storage).segments}
    for name in dead:
        if name not in referenced:
            storage.delete_tree(paths.segment_dir(name))
            report.removed_segments.append(name)
    for name in storage.list(paths.MANIFESTS):
        if not name.startswith(TEMP_PREFIX):
            continue
        key = f"{paths.MANIFESTS}/{name}"
        try:
            age = now - storage.stat(key).modified
        except FileNotFoundError:
            continue  # its writer finished with it
        if age > grace_s + storage.clock_resolution_s:  # a writer's temp file lives for ms
            storage.delete(key)
            report.removed_files.append(key)
    if keep_versions is not None and keep_versions >= 1:
        for v in versions[:-keep_versions]:
            storage.delete(paths.manifest_key(v))
            report.pruned_manifests.append(v)
    return report


def _segment_is_live(storage: Storage, segment_id: str, *, now: float, grace_s: float) -> bool:
    objects = list(storage.walk(paths.segment_dir(segment_id)))
    if not objects:
        return False
    lease = [o for o in objects if o.key == lease_key(segment_id)]
    if lease and lease_is_live(storage, lease[0], now):
        return True
    return now - max(o.modified for o in objects) < grace_s + storage.clock_resolution_s
