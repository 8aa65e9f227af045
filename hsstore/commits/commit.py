"""Versions of a dataset: reading the latest manifest, publishing the next one, and gc.

A commit is optimistic: read the latest version N, build N+1 from it, and create
``manifests/v{N+1}.json`` (a delta: the segments it adds) with put-if-absent. If another
writer got there first, read its delta and try again. Every CHECKPOINT_EVERY versions the
folded state is also written as a checkpoint, and a hint names the newest version announced.
Published manifests are never rewritten, so a reader holding version N keeps a consistent
view, and a writer killed at any point leaves at most unreferenced files (debris), which
readers never look at and `gc` removes.
"""

from __future__ import annotations

import contextlib
import random
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

from hsstore import settings
from hsstore.commits import intents
from hsstore.commits.history import (  # noqa: F401 - the reading side, re-exported for callers
    announced_version,
    check_no_lost_commits,
    check_not_rolled_back,
    encode_hint,
    list_checkpoints,
    list_versions,
    load_manifest,
    mark_key,
    read_checkpoint,
    read_version,
)
from hsstore.commits.lease import lease_is_live, lease_key
from hsstore.errors import (
    CommitUnknownError,
    FormatError,
    HsstoreError,
    IntegrityError,
    NotADatasetError,
    StorageError,
)
from hsstore.spec import paths
from hsstore.spec.manifest import FORMAT_VERSION, Delta, Manifest, load_document
from hsstore.storage.store import TEMP_PREFIX, Storage

# Every CHECKPOINT_EVERY versions the committer also writes the folded state, so loading any
# version reads one checkpoint and at most CHECKPOINT_EVERY - 1 deltas.
CHECKPOINT_EVERY = 64


def _announce(storage: Storage, published: Manifest, *, hint_behind: bool = False) -> None:
    """Move the hint forward and write a due checkpoint; both are redundant (listing and the
    deltas hold the same facts), so a failure here never turns a published commit into an
    error: the next commit or a later `write_checkpoint` catches up. ``hint_behind``: the
    caller knows the hint names an older version (it read it on the way to this one)."""
    with contextlib.suppress(StorageError, OSError, FormatError):
        _move_hint(storage, published, hint_behind=hint_behind)


def _move_hint(storage: Storage, published: Manifest, *, hint_behind: bool) -> None:
    """Never back past what the hint names when it is read. Racing writers, or a stalled
    write landing late, can still leave the hint behind the truth, which is always safe: it
    only tells readers where to start looking."""
    if hint_behind or (announced_version(storage) or 0) < published.version:
        storage.put(paths.LATEST_HINT, encode_hint(published.version, published.head_checksum))
    if published.version % CHECKPOINT_EVERY == 0:
        write_checkpoint(storage, published)
        # Checkpoints are redundant (the deltas hold the same facts): keep the newest two, so
        # manifests stay O(segments) on disk; an older version folds from an older base.
        storage.delete(paths.checkpoint_key(published.version - 2 * CHECKPOINT_EVERY))


def write_checkpoint(storage: Storage, man: Manifest) -> None:
    """Fold ``man`` into a checkpoint (idempotent: the state of a version never changes)."""
    folded = replace(man, format_version=FORMAT_VERSION)  # a format 1 version, re-sealed
    storage.put_if_absent(paths.checkpoint_key(man.version), folded.to_bytes())


# After a create that did not win, a writer waits a random share (full jitter) of a window
# that doubles with each such attempt of one commit, up to RETRY_CAP_S. Racing writers then
# spread their next attempts over the window instead of all creating the next version at once
# (when all do, one wins and the rest only repeat the work), and no wait grows without bound.
RETRY_BASE_S = 0.002
RETRY_CAP_S = 0.1
_jitter = random.SystemRandom()  # not a seeded generator, which forked writers would share


def lost_race_wait(losses: int) -> float:
    """Seconds to wait before the next attempt, after ``losses`` attempts that did not win."""
    return _jitter.uniform(0.0, min(RETRY_CAP_S, RETRY_BASE_S * 2 ** min(losses, 16)))


def new_token() -> str:
    """A commit token's writer part; `publish` callers add ``.<attempt>``."""
    return uuid.uuid4().hex


def publish(
    storage: Storage,
    build_next: Callable[[Manifest], Manifest],
    *,
    token: str,
    base: Manifest | None = None,
    claims: Callable[[Delta], None] | None = None,
    condemn: Callable[[Manifest], tuple[str, ...]] | None = None,
    delta_fields: Callable[[Manifest], dict[str, Any]] | None = None,
    resolve_s: float | None = None,
    max_attempts: int = 1000,
) -> Manifest:
    """Publish ``build_next(latest)`` as the next version, as a delta carrying ``token``;
    retried when a writer races us. Returns the version published; raises when nothing was.

    Every outcome is certain but one: after a create whose outcome is unknown (an error, a
    timeout, a refusal of a resent request), the version is read back until it answers: our
    token there means published; another's means that attempt lost; absent, the same bytes are
    created again (so a stalled first copy can never land later unseen). If the storage does
    not answer within ``resolve_s``, CommitUnknownError: call again with the same token and it
    resolves (any version carrying the token is recognised while catching up).

    ``base``: a version the caller already holds; the versions published since are read one
    delta at a time, so a commit costs what changed, not the length of the history.
    ``build_next`` must be a pure function of the latest manifest (it is called again after a
    lost race) and may raise to abort the commit. ``claims`` sees every delta published by
    published on the way (ours included: a group's version holds other writers' segments too)
    and may raise to refuse (e.g. a segment of ours gc condemned). ``condemn``: segments gc
    removes after this version (gc's own versions). ``delta_fields``: more members of the
    delta built for ``build_next``'s manifest (a group's tokens, the sample digest).
    """
    latest = base if base is not None else load_manifest(storage)
    # How long to keep asking, after a request whose outcome was never learned, whether the
    # version was created (HSSTORE_RESOLVE_TIMEOUT); past that, CommitUnknownError.
    wait = settings.current().resolve_timeout_s if resolve_s is None else resolve_s
    pending: tuple[int, bytes] | None = None  # a create whose outcome is not known yet
    deadline = 0.0
    losses = 0
    for attempt in range(max_attempts):
        try:
            latest, mine = catch_up(storage, latest, token, claims)
        except (StorageError, OSError) as exc:
            if isinstance(exc, HsstoreError) and not isinstance(exc, StorageError):
                raise  # a format problem, not a storage that failed to answer
            if pending is None:
                raise  # nothing of ours in flight: certainly not published
            if time.monotonic() > deadline:
                raise CommitUnknownError(
                    f"could not learn whether version {pending[0]} (this commit) was created: "
                    f"{exc}; nothing was deleted, commit again to learn the outcome",
                    path=storage.root,
                ) from exc
            time.sleep(min(1.0, 0.01 * 2 ** min(attempt, 7)))
            continue
        if mine:
            _announce(storage, latest)
            return latest
        if pending is not None and latest.version >= pending[0]:
            pending = None  # that version is another writer's: our create certainly lost
        if pending is not None:
            version, data = pending  # absent still: create the very same bytes again
        else:
            nxt = build_next(latest)
            if nxt.version != latest.version + 1:
                raise FormatError("build_next must produce the next version number")
            delta = replace(
                latest.delta_to(nxt),
                commit=token,
                condemn=condemn(latest) if condemn is not None else (),
                **(delta_fields(nxt) if delta_fields is not None else {}),
            )
            version, data = nxt.version, delta.to_bytes()
        try:
            created = storage.put_if_absent(paths.manifest_key(version), data)
        except (StorageError, OSError):
            created = False  # unknown: the next catch-up reads the version back
        if created:
            published = load_document(data, where=storage.path_of(paths.manifest_key(version)))
            assert isinstance(published, Delta)
            man = latest.apply(published, where=storage.path_of(paths.manifest_key(version)))
            # The catch-up that let this create happen found the hint at or below ``latest``
            # (above it, with the next version absent, it refuses).
            _announce(storage, man, hint_behind=True)
            return man
        if pending is None:
            deadline = time.monotonic() + wait
        pending = (version, data)
        losses += 1
        time.sleep(lost_race_wait(losses))
    raise FormatError(f"could not publish after {max_attempts} attempts", path=storage.root)


def catch_up(
    storage: Storage,
    latest: Manifest,
    token: str | None,
    claims: Callable[[Delta], None] | None,
    *,
    check_newest: bool = True,
) -> tuple[Manifest, bool]:
    """``latest`` moved forward over every version published after it, up to and including
    one carrying ``token`` (then True: it is ours). ``check_newest``: where the versions end,
    make sure none after it was deleted (a commit must, before it creates the next; a writer
    only watching for the next version need not, each time it looks)."""
    while True:
        key = paths.manifest_key(latest.version + 1)
        try:
            data = storage.read_bytes(key)
        except FileNotFoundError:
            if not check_newest:
                return latest, False
            # The hint is written only after its version, and versions are contiguous: a hint
            # above us with our successor absent means published versions were deleted.
            try:
                check_not_rolled_back(storage, latest.version)
            except IntegrityError:
                _refuse_if_pruned(storage, latest.version)
                raise
            if not storage.exists(paths.manifest_key(latest.version)):
                _refuse_if_pruned(storage, latest.version)
                raise IntegrityError(
                    f"version {latest.version}, which this commit extends, was deleted: the "
                    f"newest versions were deleted or rolled back (restore them)",
                    path=storage.root,
                ) from None
            return latest, False
        doc = load_document(data, where=storage.path_of(key))
        if isinstance(doc, Manifest):  # a full manifest, e.g. from a format 1 writer
            if doc.version != latest.version + 1 or doc.dataset_id != latest.dataset_id:
                raise FormatError("manifest does not follow its predecessor", path=key)
            latest = doc
            continue
        ours = token is not None and doc.carries(token)
        if claims is not None:
            claims(doc)
        latest = latest.apply(doc, where=storage.path_of(key))
        if ours:
            return latest, True


def _refuse_if_pruned(storage: Storage, base: int) -> None:
    """Raise when ``base`` and its successor are gone because `gc --keep-versions` pruned them
    (newer versions are there): what was published since cannot be checked any more."""
    versions = list_versions(storage)
    if versions and versions[0] > base + 1:
        raise IntegrityError(
            f"versions up to {versions[0] - 1} were pruned (gc --keep-versions) after this "
            f"commit read version {base}, so it cannot check what was published since; nothing "
            f"was published: add its samples again with a new writer",
            path=storage.root,
        )


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
) -> GcReport:
    """Remove what no committed version references and no live writer may still publish.

    An unreferenced segment is debris only when its lease (``.writing``) has lapsed or is gone
    AND its newest object is older than ``grace_s``, both on the storage's clock; a temporary
    file only when it is older than ``grace_s``. Debris is first condemned in a version of its
    own (`_condemn`), then deleted: a writer that published it first keeps it, and one that
    comes later refuses to publish it. See docs/DESIGN.md, "Leases and gc".

    keep_versions: also delete manifest versions older than the newest ``keep_versions``
    (None keeps every version; pruning never removes a segment: only a version gc published
    to condemn it, or a recorded repair, does).
    """
    report = GcReport()
    versions = list_versions(storage)
    if not versions:
        raise NotADatasetError("not an hsstore dataset", path=storage.root)
    check_not_rolled_back(storage, versions[-1])  # a rolled-back commit's segment is not debris
    now = storage.now()
    latest = load_manifest(storage, versions[-1])
    check_no_lost_commits(storage, latest)  # nor is a segment a lost version committed
    referenced = {s.id for s in latest.segments}
    dead = []
    for name in storage.list(paths.SEGMENTS):
        if not paths.is_segment_id(name) or name in referenced:
            continue  # never anything but a segment folder (a dataset nested here, say)
        if _segment_is_live(storage, name, now=now, grace_s=grace_s):
            report.live_segments.append(name)
        else:
            dead.append(name)
    for name in _condemn(storage, dead, base=latest):
        storage.delete_tree(paths.segment_dir(name))
        report.removed_segments.append(name)
    report.removed_files += _sweep_intents(
        storage, latest, now=now, grace_s=grace_s, removed=set(report.removed_segments)
    )
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
    if keep_versions is not None and keep_versions >= 1 and len(versions) > keep_versions:
        # Deltas below the oldest kept version are only needed to fold it: write that version
        # as a checkpoint first, then older version files and checkpoints can go.
        oldest = versions[-keep_versions]
        write_checkpoint(storage, load_manifest(storage, oldest))
        for v in versions[:-keep_versions]:
            storage.delete(paths.manifest_key(v))
            report.pruned_manifests.append(v)
        for c in list_checkpoints(storage):
            if 1 < c < oldest:  # checkpoint 1 stays: the dataset's description, should the
                storage.delete(paths.checkpoint_key(c))  # kept checkpoint be lost
    return report


def _sweep_intents(
    storage: Storage, latest: Manifest, *, now: float, grace_s: float, removed: set[str]
) -> list[str]:
    """Delete the group-commit intents (hsstore.commits.group) older than ``grace_s`` that no
    version can publish any more: every segment they name is published, or was removed, or
    they cannot be read. A waiting writer holds a copy of its own, so an intent removed is
    never a commit lost."""
    referenced = {s.id for s in latest.segments}
    swept = []
    for key in intents.waiting(storage).values():
        try:
            age = now - storage.stat(key).modified
        except FileNotFoundError:
            continue
        if age <= grace_s + storage.clock_resolution_s:
            continue
        intent = intents.read(storage, key, dataset_id=latest.dataset_id)
        if intent is not None and any(
            s.id not in referenced
            and s.id not in removed
            and storage.exists(paths.segment_file(s.id, paths.WRITING_LOCK))
            for s in intent.add_segments
        ):
            continue  # its writer may still be waiting for a group
        storage.delete(key)
        swept.append(key)
    return swept


def _condemn(storage: Storage, dead: list[str], *, base: Manifest) -> list[str]:
    """Publish a version condemning the ``dead`` segments no version references; returns them.

    This is gc's fence: the conditional create orders it against every writer's publish. A
    writer that published first references its segment, so it is not condemned here; a writer
    that publishes later reads this version while catching up and refuses to publish a
    segment of its own named in it, however long it paused and whatever its clock says. Only
    then are the files deleted.
    """
    chosen: list[str] = []

    def unreferenced(latest: Manifest) -> tuple[str, ...]:
        have = {s.id for s in latest.segments}
        chosen[:] = [name for name in dead if name not in have]
        if not chosen:
            raise _NothingToCondemn
        return tuple(chosen)

    def same(latest: Manifest) -> Manifest:
        return latest.with_segments(latest.segments, latest.provenance, latest.version + 1)

    if not dead:
        return []
    try:
        publish(storage, same, token=f"{new_token()}.0", base=base, condemn=unreferenced)
    except _NothingToCondemn:
        return []
    return chosen


class _NothingToCondemn(Exception):
    """Every segment gc judged dead was published meanwhile."""


def _segment_is_live(storage: Storage, segment_id: str, *, now: float, grace_s: float) -> bool:
    objects = list(storage.walk(paths.segment_dir(segment_id)))
    if not objects:
        # A folder a writer has just made, before its lease is in (a filesystem shows it; an
        # object store has no empty folders): judged by the folder's own age.
        try:
            made = storage.stat(paths.segment_dir(segment_id)).modified
        except FileNotFoundError:
            return True  # gone meanwhile: nothing to remove
        return now - made < grace_s + storage.clock_resolution_s
    if any(_foreign(o.key, segment_id) for o in objects):
        return True  # holds a dataset of its own, or was committed: never debris
    lease = [o for o in objects if o.key == lease_key(segment_id)]
    if lease and lease_is_live(storage, lease[0], now):
        return True
    return now - max(o.modified for o in objects) < grace_s + storage.clock_resolution_s


def _foreign(key: str, segment_id: str) -> bool:
    """Whether an object under a segment folder shows it is not debris: a commit mark (a lost
    version's segment, kept until a repair decides) or a dataset nested there."""
    rel = key[len(paths.segment_dir(segment_id)) + 1 :]
    if key == mark_key(segment_id):
        return True
    parts = rel.split("/")
    return paths.MANIFESTS in parts[:-1] and (
        paths.manifest_version(parts[-1]) is not None or parts[-1] == "_latest"
    )
