"""Reading the version history: which versions exist, the state at one of them, and whether
committed versions were lost.

The state at version N is the newest checkpoint (or full manifest) at or below N plus the
deltas after it. Three kinds of evidence tell a lost newest version from a history that simply
ends (docs/FORMAT.md, "Versions"; docs/DESIGN.md): the hint (``manifests/_latest``, self-checked, so a damaged
one is only ignored), the hash chain (every delta names its predecessor's checksum, and the
hint names the newest one's), and the commit marks that a writer leaves in each segment once
its version is published.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Callable, Collection, Iterable
from dataclasses import dataclass, replace

import xxhash

from hsstore.errors import FormatError, HsstoreError, IntegrityError, NotADatasetError
from hsstore.spec import paths
from hsstore.spec.manifest import Delta, Manifest, SegmentInfo, load_document
from hsstore.spec.sealing import checksum_matches, seal_document
from hsstore.storage.store import Storage

# How often an open re-reads the history when a commit mark names a version it has not seen
# (a writer publishing right then): after that, the version is taken for lost.
_RELIST_ATTEMPTS = 3


def list_versions(storage: Storage) -> list[int]:
    versions = [paths.manifest_version(n) for n in storage.list(paths.MANIFESTS)]
    return sorted(v for v in versions if v is not None)


def list_checkpoints(storage: Storage) -> list[int]:
    found = [paths.checkpoint_version(n) for n in storage.list(paths.MANIFESTS)]
    return sorted(v for v in found if v is not None)


def read_version(storage: Storage, version: int) -> Manifest | Delta:
    """One version file, parsed and checked (checksum, schema, name)."""
    key = paths.manifest_key(version)
    try:
        data = storage.read_bytes(key)
    except FileNotFoundError as exc:
        raise NotADatasetError(f"no manifest version {version}", path=storage.path_of(key)) from exc
    doc = load_document(data, where=storage.path_of(key))
    if doc.version != version:
        raise FormatError(
            f"manifest says version {doc.version} but is named for {version}",
            path=storage.path_of(key),
        )
    return doc


def read_checkpoint(storage: Storage, version: int) -> Manifest:
    key = paths.checkpoint_key(version)
    try:
        man = Manifest.from_bytes(storage.read_bytes(key), where=storage.path_of(key))
    except FileNotFoundError as exc:
        raise FormatError(f"checkpoint {version} is missing", path=storage.path_of(key)) from exc
    if man.version != version:
        raise FormatError(
            f"checkpoint says version {man.version} but is named for {version}",
            path=storage.path_of(key),
        )
    return replace(man, head_checksum=None)  # its own checksum is not the version file's


def fold(storage: Storage, version: int, checkpoints: list[int]) -> Manifest:
    """The state at ``version``: the newest usable base at or below it plus the deltas after.

    Checkpoints are redundant (the deltas hold the same facts): one that is damaged or was
    pruned meanwhile is passed over for an older base (verify reports it).
    """
    # Checkpoint 1 is version 1's copy, for recovery alone (`hsstore.commits.rebuild`): the
    # version file itself is read, so any edit of it is refused here.
    bases = [0, *(c for c in checkpoints if 1 < c <= version)]
    deltas: list[Delta] = []
    man: Manifest | None = None
    v = version
    while man is None:
        base = bases.pop()
        while v > base and man is None:
            try:
                doc = read_version(storage, v)
            except NotADatasetError as exc:
                if v == version:
                    raise
                raise IntegrityError(
                    f"manifest version {v} is missing, though version {version} exists: a file "
                    f"of the history was deleted (readers serve what survives; `hsstore repair` "
                    f"writes the history back)",
                    path=exc.path,
                ) from None
            if isinstance(doc, Manifest):
                man = doc
            else:
                deltas.append(doc)
                v -= 1
        if man is None:
            if not base:
                raise FormatError("version 1 is not a full manifest", path=storage.root)
            try:
                man = read_checkpoint(storage, base)
            except HsstoreError:
                continue
    man = replay(storage, ((d.version, d) for d in reversed(deltas)), state=man)
    if not deltas and man.version == version and v == base and base:
        # The version is a checkpoint's: the chain's link is its own file's checksum (a
        # damaged file is reported by verify; the state itself came from the checkpoint).
        with contextlib.suppress(HsstoreError):
            man = replace(man, head_checksum=_checksum_of(read_version(storage, version)))
    return man


def replay(
    storage: Storage,
    docs: Iterable[tuple[int, Manifest | Delta | None]],
    *,
    state: Manifest | None = None,
    checkpoints: Collection[int] = (),
    problem: Callable[[str, str], None] | None = None,
) -> Manifest | None:
    """Fold version files, in version order, onto ``state`` (the state just before the first):
    a full manifest replaces the state; a delta's link to the file before it is checked
    (`Delta.check_follows`), then it applies. None stands for a version file that could not be
    read.

    Without ``problem`` (a reader's fold) a broken link or a delta that does not apply raises. With it (verify
    --full, every version file), each is reported and the fold starts again from the next full
    manifest or from a checkpoint at or just below the next delta; None when it never does.
    """
    prev = state.head_checksum if state is not None else None
    for v, doc in docs:
        where = storage.path_of(paths.manifest_key(v))
        if doc is None or isinstance(doc, Manifest):
            state, prev = doc, None if doc is None else doc.head_checksum
            continue
        try:
            doc.check_follows(v - 1, prev, where=where)  # whatever the state came from
            if state is None and problem is not None:
                state = _checkpoint_below(storage, v, checkpoints)
            if state is not None and (state.version == v - 1 or problem is None):
                state = replace(state, head_checksum=None).apply(doc, where=where)
            elif state is not None and state.version == v:
                state = replace(state, head_checksum=doc.checksum)
        except HsstoreError as exc:
            if problem is None:
                raise
            problem(exc.path or where, exc.message)
            state = None
        prev = doc.checksum
    return state


def _checkpoint_below(storage: Storage, v: int, checkpoints: Collection[int]) -> Manifest | None:
    """The checkpoint of version ``v`` or ``v - 1``, where one is listed and loads."""
    base = v if v in checkpoints else v - 1 if v - 1 in checkpoints else None
    if base is None:
        return None
    with contextlib.suppress(HsstoreError, OSError):
        return read_checkpoint(storage, base)
    return None


def _checksum_of(doc: Manifest | Delta) -> str | None:
    return doc.checksum if isinstance(doc, Delta) else doc.head_checksum


def load_manifest(storage: Storage, version: int | None = None) -> Manifest:
    """The given version, or the latest. Raises NotADatasetError when there is none.

    Reads the newest checkpoint (or full manifest) at or below the version and the deltas
    after it: a bounded number of files, whatever the length of the history. The latest
    version is also checked against the evidence of lost versions (`check_history`).
    """
    for attempt in range(_RELIST_ATTEMPTS):
        names = storage.list(paths.MANIFESTS)
        versions = sorted(v for v in map(paths.manifest_version, names) if v is not None)
        checkpoints = sorted(v for v in map(paths.checkpoint_version, names) if v is not None)
        if not versions:
            raise NotADatasetError(
                "not an hsstore dataset (no manifests/ with a committed version)",
                path=storage.root,
            )
        if version is not None:
            return fold(storage, version, checkpoints)
        check_not_rolled_back(storage, versions[-1])
        man = fold(storage, versions[-1], checkpoints)
        check_hint_matches(storage, man)
        lost = lost_commits(storage, man)
        if not lost:
            return man
        if attempt + 1 < _RELIST_ATTEMPTS and max(v for _, v in lost) > man.version:
            continue  # a writer may have published meanwhile: its version is listed now
        raise _lost_error(storage, man, lost)
    raise AssertionError("unreachable")


# -- the hint --------------------------------------------------------------------------------


@dataclass(frozen=True)
class Hint:
    """What ``manifests/_latest`` says: a version and its file's checksum, or why it is unusable
    (``problem``; a missing hint has neither)."""

    version: int | None = None
    checksum: str | None = None
    problem: str | None = None


def _hint_tag(body: str) -> str:
    return xxhash.xxh3_64_hexdigest(f"hsstore-hint {body}".encode())[:8]


def encode_hint(version: int, checksum: str | None) -> bytes:
    """``"{version} {checksum of its file or -} {tag}\\n"``; the tag (8 hex digits of XXH3-64)
    lets a reader tell a damaged hint from a true one."""
    body = f"{version} {checksum or '-'}"
    return f"{body} {_hint_tag(body)}\n".encode()


def read_hint(storage: Storage) -> Hint:
    try:
        data = storage.read_bytes(paths.LATEST_HINT)
    except FileNotFoundError:
        return Hint()
    except (HsstoreError, OSError) as exc:  # a FIFO, a directory, an unreadable file
        return Hint(problem=f"version hint cannot be read ({exc})")
    text = data.decode("ascii", "replace").strip()
    parts = text.split(" ")
    if len(parts) == 1 and text.isdigit() and len(text) <= 16:
        return Hint(version=int(text))  # written before hints carried a tag
    if (
        len(parts) == 3
        and parts[0].isdigit()
        and len(parts[0]) <= 16
        and parts[2] == _hint_tag(f"{parts[0]} {parts[1]}")
    ):
        return Hint(version=int(parts[0]), checksum=None if parts[1] == "-" else parts[1])
    return Hint(problem=f"version hint is damaged ({text[:40]!r}); it is ignored")


def announced_version(storage: Storage) -> int | None:
    """The version the hint names (None when there is none, or it is damaged: a hint is only
    a hint, and the listing decides)."""
    return read_hint(storage).version


def check_not_rolled_back(storage: Storage, latest: int) -> None:
    """Raise if a version above ``latest`` was announced: the newest manifest was deleted."""
    hint = announced_version(storage)
    if hint is not None and hint > latest and not storage.exists(paths.manifest_key(latest + 1)):
        raise IntegrityError(
            f"version {hint} was published but {paths.manifest_key(latest + 1)} is missing: the "
            f"newest versions were deleted or rolled back (restore them, or run `hsstore "
            f"repair` to accept the loss)",
            path=storage.root,
        )


def check_hint_matches(storage: Storage, latest: Manifest) -> None:
    """Raise if the hint names the latest version with another file checksum: that version
    was replaced (deleted, then published again by someone else)."""
    hint = read_hint(storage)
    if (
        hint.version == latest.version
        and hint.checksum is not None
        and latest.head_checksum is not None
        and hint.checksum != latest.head_checksum
    ):
        raise IntegrityError(
            f"{paths.manifest_key(latest.version)} is not the version {latest.version} that was "
            f"announced (checksum {latest.head_checksum}, announced {hint.checksum}): it was "
            f"replaced (restore it, or run `hsstore repair` to accept the loss)",
            path=storage.root,
        )


# -- commit marks ----------------------------------------------------------------------------


def mark_key(segment_id: str) -> str:
    return paths.segment_file(segment_id, paths.COMMITTED_MARK)


def mark_committed(storage: Storage, published: Manifest, segments: list[SegmentInfo]) -> None:
    """Record in each segment that ``published`` added it (after the publish: positive
    evidence, never written for a version that did not land). The mark holds the segment's
    manifest entry and a copy of the version's file (``delta``, when it is the one published),
    so a lost or damaged version file can be rebuilt exactly (`hsstore.commits.rebuild`)."""
    if not segments:
        return
    copy = None
    delta = published.head_delta
    if delta is not None and delta.version == published.version and delta.checksum is not None:
        copy = {**delta.to_json(), "checksum": delta.checksum}
        if mark_copy({"version": published.version, "delta": copy}) is None:
            copy = None  # does not seal to the file's bytes: no copy rather than a wrong one
    for seg in segments:
        mark = {
            "version": published.version,
            "dataset_id": published.dataset_id,
            "segment": seg.to_json(),
        }
        if copy is not None:
            mark["delta"] = copy
        storage.put(mark_key(seg.id), json.dumps(mark, sort_keys=True).encode())


def mark_copy(mark: dict) -> bytes | None:
    """The exact bytes of the version file a commit mark copies, or None when it holds no
    copy or the copy fails its own checksum (a version file is its canonical JSON, sealed)."""
    doc = mark.get("delta")
    if not isinstance(doc, dict) or doc.get("version") != mark.get("version"):
        return None
    data = seal_document(doc)
    stored = doc.get("checksum")
    return data if isinstance(stored, str) and checksum_matches(data, stored) else None


def read_mark(storage: Storage, segment_id: str) -> dict | None:
    """A segment's commit mark (None when it has none or it does not parse)."""
    try:
        doc = json.loads(storage.read_bytes(mark_key(segment_id)))
    except FileNotFoundError:
        return None
    except (HsstoreError, OSError, ValueError):
        return None
    return doc if isinstance(doc, dict) and isinstance(doc.get("version"), int) else None


def lost_commits(storage: Storage, latest: Manifest) -> list[tuple[str, int]]:
    """(segment id, version) of every segment a published version added that ``latest`` does
    not list: evidence that committed versions were lost. One listing of segments/, plus one
    read per unreferenced segment (the folders of writers still at work, usually none)."""
    listed = {s.id for s in latest.segments}
    listed |= {r.get("segment") for r in latest.provenance.get("repairs", [])}  # decided
    lost = []
    for name in storage.list(paths.SEGMENTS):
        if name in listed or not paths.is_segment_id(name):
            continue
        if not storage.exists(mark_key(name)):
            continue
        mark = read_mark(storage, name)
        if mark is None or mark.get("dataset_id") != latest.dataset_id:
            continue
        if mark["version"] > latest.version and storage.exists(paths.manifest_key(mark["version"])):
            continue  # published after ``latest`` was read (a writer at work): not lost
        lost.append((name, mark["version"]))
    return lost


def _lost_error(storage: Storage, latest: Manifest, lost: list[tuple[str, int]]) -> IntegrityError:
    versions = sorted({v for _, v in lost})
    named = ", ".join(f"v{v}" for v in versions[:4]) + (" ..." if len(versions) > 4 else "")
    return IntegrityError(
        f"{len(lost)} segment(s) committed by version(s) {named} are not in the latest version "
        f"{latest.version} (first: {lost[0][0]}): committed versions were deleted or rolled "
        f"back (restore manifests/, or run `hsstore repair` to list them again)",
        path=storage.root,
    )


def check_no_lost_commits(storage: Storage, latest: Manifest) -> None:
    lost = lost_commits(storage, latest)
    if lost:
        raise _lost_error(storage, latest, lost)
