"""Writing back the redundant files of a dataset's history (`hsstore repair`'s first step).

A lost or damaged version file whose exact copy survives in a commit mark is written back
byte for byte; one known only in part is bridged by a checkpoint holding the rebuilt state at
that version (the decision is recorded by the repair's version). Then what keeps the facts
redundant is made whole again: version 1's checkpoint copy, each listed segment's commit mark
(with the copy of the version that added it) and its index copy, and the hint.
"""

from __future__ import annotations

import contextlib
import json
from dataclasses import dataclass, field
from typing import Any

from hsstore.codec.codecs import crc32c
from hsstore.commits.commit import list_checkpoints, list_versions, write_checkpoint
from hsstore.commits.history import mark_copy, mark_key, read_checkpoint, read_mark, read_version
from hsstore.commits.rebuild import Rebuilt, rebuild
from hsstore.errors import HsstoreError, IntegrityError
from hsstore.spec import paths, zarr_meta
from hsstore.spec.manifest import FORMAT_VERSION, Delta, FileInfo, Manifest, SegmentInfo
from hsstore.storage.store import Storage


@dataclass
class Restored:
    """What `restore_history` wrote back, and the decisions a repair's version must record."""

    files: list[str] = field(default_factory=list)
    repairs: list[dict[str, Any]] = field(default_factory=list)
    # Damaged version files bridged by a checkpoint: removed once the repair is published.
    damaged_bridged: list[int] = field(default_factory=list)


def restore_history(storage: Storage) -> tuple[Rebuilt, Restored]:
    """Write back every version file a commit mark keeps a copy of, bridge each one known only
    in part with a checkpoint, and return the state at the newest version file (the hint and
    commit marks may name newer ones: the repair lists their segments again)."""
    done = Restored()
    for v, data in sorted(rebuild(storage).copies.items()):
        key = paths.manifest_key(v)
        if storage.exists(key):
            storage.delete(key)  # damaged: its true bytes go back in its place
        storage.put_if_absent(key, data)
        done.files.append(storage.path_of(key))
    versions = list_versions(storage)
    if not versions:
        raise IntegrityError("no manifest version survives to rebuild", path=storage.root)
    found = rebuild(storage, versions[-1])
    for first, last in _runs(found.partial):
        # One checkpoint at the top of a run of versions known only in part bridges the run.
        at = rebuild(storage, last).manifest
        _write_checkpoint_again(storage, at)
        done.files.append(storage.path_of(paths.checkpoint_key(last)))
        segments = [s for s in at.segments if first <= found.added_by.get(s.id, 0) <= last]
        done.damaged_bridged += [
            v for v in range(first, last + 1) if found.unusable.get(v, "missing") != "missing"
        ]
        which = f"version {first}" if first == last else f"versions {first} to {last}"
        done.repairs.append(
            {
                "action": "accepted",
                "num_samples": sum(s.num_samples for s in segments),
                "sample_ids": [],
                "reason": f"the manifest file(s) of {which} are lost or damaged "
                f"({found.unusable.get(first, 'missing')}) and no copy survives: the "
                f"{len(segments)} segment(s) they added are listed from their commit marks "
                f"(checkpoint {last} holds that state); what else they recorded (skipped "
                f"inputs, run records, removals) is lost",
            }
        )
    return found, done


def _runs(versions: list[int]) -> list[tuple[int, int]]:
    """Maximal runs of consecutive numbers, as (first, last)."""
    runs: list[tuple[int, int]] = []
    for v in sorted(versions):
        if runs and runs[-1][1] == v - 1:
            runs[-1] = (runs[-1][0], v)
        else:
            runs.append((v, v))
    return runs


def _write_checkpoint_again(storage: Storage, man: Manifest) -> None:
    key = paths.checkpoint_key(man.version)
    if storage.exists(key):
        try:
            read_checkpoint(storage, man.version)
            return
        except HsstoreError:
            storage.delete(key)  # damaged: written again from the state it describes
    write_checkpoint(storage, man)


def remove_bridged(storage: Storage, done: Restored) -> None:
    """Delete the damaged version files a published repair recorded and a checkpoint bridges."""
    for v in done.damaged_bridged:
        with contextlib.suppress(HsstoreError, OSError):
            storage.delete(paths.manifest_key(v))


def restore_redundancy(
    storage: Storage, man: Manifest, added_by: dict[str, int], done: Restored
) -> None:
    """Write back what keeps the history's facts redundant: version 1's checkpoint copy,
    damaged checkpoints, and for each segment ``man`` lists its commit mark (with a copy of
    the version file that added it, ``added_by``) and its index copy."""
    for c in sorted({1, *list_checkpoints(storage)}):
        if c > man.version or _readable_checkpoint(storage, c):
            continue
        with contextlib.suppress(HsstoreError):
            _write_checkpoint_again(storage, rebuild(storage, c).manifest)
            done.files.append(storage.path_of(paths.checkpoint_key(c)))
    _restore_group_documents(storage, done)
    copies: dict[int, dict | None] = {}
    for seg in man.segments:
        if not _restore_index_copy(storage, seg, done):
            continue  # nothing of the segment to mark (a mark would make its folder again)
        version = added_by.get(seg.id)
        mark = read_mark(storage, seg.id)
        if version is None or (mark is not None and mark_copy(mark) is not None):
            continue
        if version not in copies:
            copies[version] = _version_doc(storage, version)
        if copies[version] is None and mark is not None:
            continue  # nothing to add to the mark there is
        doc = {"version": version, "dataset_id": man.dataset_id, "segment": seg.to_json()}
        if copies[version] is not None:
            doc["delta"] = copies[version]
        storage.put(mark_key(seg.id), json.dumps(doc, sort_keys=True).encode())
        done.files.append(storage.path_of(mark_key(seg.id)))


def _restore_group_documents(storage: Storage, done: Restored) -> None:
    """The root's and segments/'s Zarr group documents, written again when not a group's."""
    for key, attributes in (
        (paths.ROOT_ZARR_JSON, {"hsstore": {"format_version": FORMAT_VERSION}}),
        (paths.SEGMENTS_ZARR_JSON, None),
    ):
        with contextlib.suppress(HsstoreError, OSError, ValueError):
            doc = json.loads(storage.read_bytes(key))
            if isinstance(doc, dict) and (doc.get("zarr_format"), doc.get("node_type")) == (
                3,
                "group",
            ):
                continue
        with contextlib.suppress(FileNotFoundError):
            storage.delete(key)
        storage.put_if_absent(key, zarr_meta.group_json(attributes))
        done.files.append(storage.path_of(key))


def restore_index_copies(storage: Storage, man: Manifest, done: Restored) -> None:
    """Each segment's index written back from its copy, or its copy from it, where only one
    of them is intact (so a segment check finds the index whole)."""
    for seg in man.segments:
        _restore_index_copy(storage, seg, done)


def _readable_checkpoint(storage: Storage, version: int) -> bool:
    try:
        read_checkpoint(storage, version)
    except HsstoreError:
        return False
    return True


def _version_doc(storage: Storage, version: int) -> dict | None:
    """The parsed version file, when it is an intact delta (what a commit mark copies)."""
    try:
        doc = read_version(storage, version)
        data = storage.read_bytes(paths.manifest_key(version))
    except (HsstoreError, OSError):
        return None
    return json.loads(data) if isinstance(doc, Delta) else None


def _intact(storage: Storage, key: str, entry: FileInfo) -> bool:
    try:
        data = storage.read_bytes(key)
    except (HsstoreError, OSError):
        return False
    return len(data) == entry.size and (entry.crc32c is None or crc32c(data) == entry.crc32c)


def _restore_index_copy(storage: Storage, seg: SegmentInfo, done: Restored) -> bool:
    """Write the index, or its copy, from the other one when only one of them is intact;
    whether either was."""
    entry = seg.files[paths.INDEX]
    keys = [paths.segment_file(seg.id, rel) for rel in (paths.INDEX, paths.INDEX_COPY)]
    good = [_intact(storage, key, entry) for key in keys]
    if good[0] == good[1]:
        return good[0]  # both intact, or nothing intact to copy from
    source, target = (keys[0], keys[1]) if good[0] else (keys[1], keys[0])
    data = storage.read_bytes(source)
    with contextlib.suppress(FileNotFoundError):
        storage.delete(target)
    storage.put_if_absent(target, data)
    done.files.append(storage.path_of(target))
    return True
