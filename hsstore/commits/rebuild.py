"""Rebuilding a version from what survives when files of its history are lost or damaged.

The facts of a version are held more than once (docs/DESIGN.md, "Recovery"): a delta's in the
commit mark of every segment it added, which keeps a copy of the version file; the state at a
version in its checkpoint; the dataset's description in version 1 and every checkpoint. So a
missing or damaged version file (a delta) is rebuilt exactly from a mark's copy, checked by its
own checksum and by the hash chain; without a copy, the segments it added are still known from
their marks, and only what else it recorded (skipped inputs, run records, removals) is lost.

`open_manifest` is the readers' way in: the strict fold of `history.load_manifest` when the
history is whole, else the rebuilt state when it is safe to serve (every commit mark accounted
for, and the newest version known exactly), reported in a `Rebuilt` so a reader can say what
it did. Writers and gc keep the strict fold: they refuse a damaged history until `hsstore
repair` has written it back.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field, replace

from hsstore.commits.history import (
    check_hint_matches,
    load_manifest,
    mark_copy,
    mark_key,
    read_checkpoint,
    read_hint,
    read_mark,
    read_version,
)
from hsstore.errors import (
    FormatError,
    HsstoreError,
    IntegrityError,
    NotADatasetError,
    UnsupportedVersionError,
)
from hsstore.spec import paths
from hsstore.spec.manifest import (
    APPENDED_PROVENANCE,
    Delta,
    Manifest,
    SegmentInfo,
    load_document,
)
from hsstore.spec.sealing import checksum_matches
from hsstore.storage.store import Storage


@dataclass
class Rebuilt:
    """A state folded across lost or damaged files, and what it took."""

    manifest: Manifest
    # Each version file that could not be used, with why (missing, or the damage found).
    unusable: dict[int, str] = field(default_factory=dict)
    # Of those, the exact bytes of the file, from a copy in a commit mark.
    copies: dict[int, bytes] = field(default_factory=dict)
    # Versions known only from the segments their commit marks name (no copy survives).
    partial: list[int] = field(default_factory=list)
    # Checkpoints that could not be read (passed over for an older base).
    bad_checkpoints: dict[int, str] = field(default_factory=dict)
    # (segment, version) of commit marks the rebuilt history does not account for.
    unlisted: list[tuple[str, int]] = field(default_factory=list)
    # The version each listed segment was added by (for marks written again by repair).
    added_by: dict[str, int] = field(default_factory=dict)

    @property
    def exact(self) -> bool:
        return not self.partial

    def describe(self, storage: Storage) -> str:
        """One line: which files were lost and how the state was rebuilt without them."""
        first = min(self.unusable)
        names = f"{storage.path_of(paths.manifest_key(first))}: {self.unusable[first]}" + (
            f"; and {len(self.unusable) - 1} more" if len(self.unusable) > 1 else ""
        )
        how = (
            "rebuilt exactly from the copies in the segments' commit marks"
            if self.exact
            else f"version(s) {', '.join(map(str, self.partial))} rebuilt from the segments "
            f"their commit marks name (what else they recorded is lost)"
        )
        return (
            f"{len(self.unusable)} manifest file(s) missing or damaged ({names}): version "
            f"{self.manifest.version} was {how}; run `hsstore repair {storage.root}` to write "
            f"the history back"
        )


def open_manifest(storage: Storage, version: int | None = None) -> tuple[Manifest, Rebuilt | None]:
    """The state a reader serves: the strict fold when the history is whole (None beside it),
    else the rebuilt state when every commit mark is accounted for and the newest version is
    known exactly; otherwise the strict fold's error is raised."""
    try:
        return load_manifest(storage, version), None
    except UnsupportedVersionError:
        raise
    except (NotADatasetError, IntegrityError, FormatError) as exc:
        strict = exc
    try:
        rebuilt = rebuild(storage, version)
    except UnsupportedVersionError:
        raise
    except HsstoreError:
        raise strict from None
    newest_partial = version is None and rebuilt.manifest.version in rebuilt.partial
    if not rebuilt.unusable or rebuilt.unlisted or newest_partial:
        raise strict
    return rebuilt.manifest, rebuilt


def require_whole(storage: Storage) -> None:
    """Raise, naming `hsstore repair`, unless the latest version folds from intact files (what
    a writer needs: a commit on a history with a hole could fill the hole with another file)."""
    try:
        load_manifest(storage)
    except HsstoreError as exc:
        raise type(exc)(
            f"{exc.message}; writers need the whole history: run `hsstore repair "
            f"{storage.root}` first",
            path=exc.path,
        ) from None


def rebuild(storage: Storage, version: int | None = None) -> Rebuilt:
    """The state at ``version`` (None: the newest one any evidence names: a version file, the
    hint or a commit mark), folded from the newest readable base across every unusable version
    file. Raises when no full manifest (version 1 or a checkpoint) survives to describe the
    dataset, or when intact files contradict each other (a replaced version)."""
    names = storage.list(paths.MANIFESTS)
    versions = sorted(v for v in map(paths.manifest_version, names) if v is not None)
    checkpoints = sorted(v for v in map(paths.checkpoint_version, names) if v is not None)
    hint = read_hint(storage)
    top = version if version is not None else max([*versions, hint.version or 0])
    if top < 1:
        raise NotADatasetError("not an hsstore dataset (no committed manifest)", path=storage.root)
    marks = _read_marks(storage)
    copies: dict[int, bytes] = {}
    for mark in marks.values():
        data = mark_copy(mark)
        if data is not None:
            copies.setdefault(mark["version"], data)
    out = Rebuilt(manifest=None)  # type: ignore[arg-type]
    items, base = _walk_down(storage, top, set(checkpoints), copies, out)
    if base is None:
        raise IntegrityError(
            "no full manifest survives (manifests/v00000001.json and every checkpoint are "
            "lost or damaged), so the dataset's layers and layout are unknown: restore one",
            path=storage.root,
        )
    state = base
    for v, doc in reversed(items):
        state = _next_state(storage, state, v, doc, marks, out)
    if version is None:  # newer versions that only commit marks tell of
        newest = max((m["version"] for m in marks.values() if _ours(m, state)), default=0)
        for v in range(state.version + 1, newest + 1):
            doc = _read(storage, v, copies, out)
            state = _next_state(storage, state, v, doc, marks, out)
    check_hint_matches(storage, state)
    decided = {r.get("segment") for r in state.provenance.get("repairs", [])}
    listed = {s.id for s in state.segments}
    out.unlisted = sorted(
        (sid, m["version"])
        for sid, m in marks.items()
        if _ours(m, state) and sid not in listed | decided and m["version"] <= state.version
    )
    out.added_by = {sid: v for sid, v in out.added_by.items() if sid in listed}
    out.manifest = state
    return out


def _walk_down(
    storage: Storage, top: int, checkpoints: set[int], copies: dict[int, bytes], out: Rebuilt
) -> tuple[list[tuple[int, Delta | None]], Manifest | None]:
    """The deltas from ``top`` down to the newest readable base (a checkpoint or a full
    version file), newest first; an unusable one without a copy is None."""
    items: list[tuple[int, Delta | None]] = []
    for v in range(top, 0, -1):
        if v in checkpoints:
            try:
                base = read_checkpoint(storage, v)
            except HsstoreError as exc:
                out.bad_checkpoints[v] = exc.message
            else:
                if v == 1:  # checkpoint 1 is version 1's copy: its very bytes
                    copies.setdefault(1, storage.read_bytes(paths.checkpoint_key(1)))
                doc = _read(
                    storage,
                    v,
                    copies,
                    out,
                    note=v in (1, top) or storage.exists(paths.manifest_key(v)),
                )
                checksum = doc.checksum if isinstance(doc, Delta) else None
                return items, replace(base, head_checksum=checksum)
        doc = _read(storage, v, copies, out)
        if isinstance(doc, Manifest):
            return items, doc
        items.append((v, doc))
    return items, _first_from_checkpoint(storage, top, checkpoints, items)


def _first_from_checkpoint(
    storage: Storage, top: int, checkpoints: set[int], items: list[tuple[int, Delta | None]]
) -> Manifest | None:
    """Version 1 (no samples, the dataset's description) from a checkpoint above ``top`` when
    version 1 is lost: what no commit can change is the same in every full manifest."""
    if not items or items[-1] != (1, None):
        return None
    for c in sorted((c for c in checkpoints if c > top), reverse=True):
        try:
            later = read_checkpoint(storage, c)
        except HsstoreError:
            continue
        items.pop()
        fixed = {k: v for k, v in later.provenance.items() if k not in APPENDED_PROVENANCE}
        return replace(later, version=1, segments=(), provenance=fixed, head_checksum=None)
    return None


def _read(
    storage: Storage, v: int, copies: dict[int, bytes], out: Rebuilt, *, note: bool = True
) -> Manifest | Delta | None:
    """Version ``v``'s file, or the copy of it a commit mark keeps, or None (why noted)."""
    try:
        return read_version(storage, v)
    except UnsupportedVersionError:
        raise
    except NotADatasetError:
        why = "missing"
    except (IntegrityError, FormatError) as exc:
        if not isinstance(exc, IntegrityError) and _intact(storage, v):
            raise  # intact bytes a reader must refuse (a schema violation): not damage
        why = exc.message
    if not note:
        return None
    out.unusable[v] = why
    data = copies.get(v)
    if data is None:
        return None
    out.copies[v] = data
    return load_document(data, where=storage.path_of(paths.manifest_key(v)))


def _intact(storage: Storage, v: int) -> bool:
    """Whether version ``v``'s file holds the bytes its own checksum seals."""
    try:
        data = storage.read_bytes(paths.manifest_key(v))
        stored = json.loads(data).get("checksum")
    except (HsstoreError, OSError, ValueError, AttributeError, RecursionError):
        return False
    return isinstance(stored, str) and checksum_matches(data, stored)


def _next_state(
    storage: Storage,
    state: Manifest,
    v: int,
    doc: Manifest | Delta | None,
    marks: dict[str, dict],
    out: Rebuilt,
) -> Manifest:
    where = storage.path_of(paths.manifest_key(v))
    if isinstance(doc, Manifest):  # a format 1 history: every version is full
        out.added_by.update({s.id: v for s in doc.segments if s.id not in out.added_by})
        return doc
    if doc is None:
        doc = _from_marks(storage, state, v, marks)
        out.partial.append(v)
    elif out.partial:
        # After a version known only in part, a later delta may name segments that version
        # removed or added without a surviving mark: keep what can be known.
        listed = {s.id for s in state.segments}
        doc = replace(
            doc,
            remove_segments=tuple(x for x in doc.remove_segments if x in listed),
            add_segments=tuple(s for s in doc.add_segments if s.id not in listed),
        )
    out.added_by.update({s.id: v for s in doc.add_segments})
    nxt = state.apply(doc, where=where)
    return replace(nxt, head_checksum=None) if v in out.partial else nxt


def _from_marks(storage: Storage, state: Manifest, v: int, marks: dict[str, dict]) -> Delta:
    """Version ``v`` as far as commit marks tell it: the segments it added."""
    listed = {s.id for s in state.segments}
    entries = []
    for sid, mark in marks.items():
        if mark["version"] != v or not _ours(mark, state) or sid in listed:
            continue
        try:
            entries.append(
                SegmentInfo.from_json(mark["segment"], where=storage.path_of(mark_key(sid)))
            )
        except (HsstoreError, KeyError, TypeError):
            continue  # a mark that does not parse names nothing
    entries.sort(key=lambda s: (s.committed_at, s.id))
    return Delta(
        version=v,
        dataset_id=state.dataset_id,
        committed_at=max((s.committed_at for s in entries), default=state.committed_at),
        add_segments=tuple(entries),
    )


def _ours(mark: dict, state: Manifest) -> bool:
    return mark.get("dataset_id") == state.dataset_id


def _read_marks(storage: Storage) -> dict[str, dict]:
    """Every segment's commit mark that parses, by segment id."""
    marks = {}
    for name in storage.list(paths.SEGMENTS):
        if not paths.is_segment_id(name):
            continue
        mark = read_mark(storage, name)
        if mark is not None:
            marks[name] = mark
    return marks
