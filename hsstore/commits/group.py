"""Group commit: writers that race for the same version publish together.

A writer first creates the next version alone (`commit.publish`), unless other writers
published since it last looked. One that loses that race, or sees others racing, leaves its
delta as an intent (`hsstore.commits.intents`) and waits: the writer whose waiting intent
arrived first leads, publishing every intent it can in one version whose ``group`` lists their
tokens, and the others recognise their token there. So versions, and every writer's reads of
them, grow with the number of groups rather than of commits. Leading is only an optimisation:
any writer may lead at any time (the next in arrival order does when no version has come for
a while: see PATIENCE_S), since the conditional create orders leaders as it orders writers.

A leader publishes another writer's intent only as that writer would have: no version after
the intent's base carries its token already, condemns or removes one of its segments, or adds
one of its sample ids (by the sample digest: a hash match is enough to leave an intent out,
its writer confirming in the index when it leads), and no intent chosen before it in the
group shares an id hash. Its own commit the leader checks exactly (``check_own``). So an intent
is published at most once, in the first version carrying its token, and a writer refuses only
for a conflict no later version can undo; until then an error while its intent waits is
`CommitUnknownError`, never a failure, since a leader may still publish it.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np

from hsstore import settings
from hsstore.commits import intents
from hsstore.commits.commit import catch_up, publish
from hsstore.errors import (
    CommitUnknownError,
    ConflictError,
    HsstoreError,
    IntegrityError,
    StorageError,
)
from hsstore.spec import paths, sample_digest
from hsstore.spec.manifest import Delta, Manifest, load_document, now_iso
from hsstore.storage.store import Storage

# A waiting writer leads when no version has come for PATIENCE_S plus PATIENCE_PER_INTENT_S
# for each intent waiting (the time a leader takes grows with its group), times one more than
# its place among the waiting tokens: if the writer whose turn it is stalls, the next takes
# over, and not all of them at once.
PATIENCE_S = 0.25
PATIENCE_PER_INTENT_S = 0.01
# How often a waiting writer looks for the next version: a doubling wait, capped. The first
# wait is also at least POLL_SHARE of how long this writer's recent commits waited for another
# writer's group: when many writers wait a second for each group, looks after 4, 8, 16 and
# 32 ms find nothing, and on an object store each is a request the server spends CPU on.
POLL_FIRST_S = 0.004
POLL_CAP_S = 0.128
POLL_SHARE = 1 / 8
# Requests a leader has in flight at once when it reads or deletes a group's intents.
IO_THREADS = 8
# Deltas a writer keeps to judge intents built on versions older than its own view.
KEPT_DELTAS = 4096


class _Contended(Exception):
    """The direct create lost its race, or others published since this writer's last commit;
    ``latest`` is what the commit was checked against."""

    def __init__(self, latest: Manifest):
        super().__init__()
        self.latest = latest


def proposal(
    token: str, dataset_id: str, segments: tuple, skipped: tuple, runs: tuple, hashes: np.ndarray
) -> Delta:
    """What a commit adds, as a delta whose version `GroupCommit.commit` fills in."""
    return Delta(
        version=2,
        dataset_id=dataset_id,
        committed_at=now_iso(),
        add_segments=tuple(segments),
        add_skipped=tuple(skipped),
        add_runs=tuple(runs),
        commit=token,
        sample_digest=sample_digest.encode(hashes),
    )


@dataclass
class GroupCommit:
    """One writer's side of group commit, kept across its commits (the versions and intents
    it has read)."""

    storage: Storage
    resolve_s: float | None = None
    # Whether commits are racing: then the next one joins a group at once rather than first
    # losing a create of its own.
    _contended: bool = False
    # Whether the versions read during this commit hold other writers' commits.
    _others_seen: bool = False
    _token: str | None = None
    _deltas: dict[int, Delta] = field(default_factory=dict)
    _intents: dict[str, Delta] = field(default_factory=dict)
    # The id hashes each kept version added (None: it added segments without a digest).
    _added: dict[int, set[int] | None] = field(default_factory=dict)
    _published: set[str] = field(default_factory=set)  # the tokens of the kept versions
    _waiting: dict[str, Delta] = field(default_factory=dict)  # this writer's, by token
    _keys: dict[str, str] = field(default_factory=dict)  # intents' keys, by token
    _pool: ThreadPoolExecutor | None = None
    # How long this writer's recent commits waited for another's group (a running mean).
    _waited_s: float = 0.0
    _check_own: Callable[[Manifest], None] | None = None
    _writer_claims: Callable[[Delta], None] | None = None

    def commit(
        self,
        mine: Delta,
        base: Manifest,
        *,
        check_own: Callable[[Manifest], None],
        claims: Callable[[Delta], None],
    ) -> Manifest:
        """Publish ``mine`` (`proposal`) and return the version holding it. Raises
        ConflictError when it can never be published, CommitUnknownError when its intent
        waits and the storage stopped answering (call again with the same ``mine``).

        ``check_own(latest)``: the writer's exact checks of its commit against ``latest``,
        run right before each create (raises ConflictError to refuse); ``claims(delta)``:
        sees every version read on the way (raises ConflictError to refuse: a segment of its
        own condemned). Held for this call only (a writer need not outlive its helpers).
        """
        self._check_own, self._writer_claims = check_own, claims
        self._token, self._others_seen = mine.commit, False
        try:
            return self._commit(mine, base)
        finally:
            self._check_own = self._writer_claims = None

    def _commit(self, mine: Delta, base: Manifest) -> Manifest:
        token = mine.commit
        assert token is not None
        intent = self._waiting.get(token)
        if intent is None:
            if not self._contended:
                try:
                    return self._publish(replace(mine, version=base.version + 1), base, group=False)
                except _Contended as lost:
                    latest = lost.latest
            else:  # commits race: join a group at once
                latest, landed = self._catch_up(base, token, check_newest=False)
                if landed:  # an earlier call's create whose outcome was not known
                    return latest
            # The intent's base is the version its ids were checked through: a leader checks
            # only the versions after it.
            assert self._check_own is not None
            self._check_own(latest)
            intent = replace(mine, version=latest.version + 1)
            self._keys[token] = intents.write(self.storage, intent)
            self._waiting[token] = intent
        else:
            latest = base
        try:
            published = self._wait_or_lead(intent, latest)
        except ConflictError:
            del self._waiting[token]
            self._drop(token)  # refused for good: no leader will take it
            raise
        except (CommitUnknownError, IntegrityError):
            raise  # kept to resolve; or versions deleted or pruned, which every leader refuses
        except HsstoreError as exc:
            raise CommitUnknownError(
                f"this commit's intent ({token}) is waiting and may still be published: {exc}; "
                f"nothing was deleted, commit again to learn the outcome",
                path=self.storage.root,
            ) from exc
        del self._waiting[token]
        self._keys.pop(token, None)
        return published

    # -- waiting --------------------------------------------------------------------------
    def _wait_or_lead(self, intent: Delta, latest: Manifest) -> Manifest:
        token = intent.commit
        assert token is not None
        wait = settings.current().resolve_timeout_s if self.resolve_s is None else self.resolve_s
        failing_since: float | None = None
        my_turn: bool | None = None
        started = time.monotonic()
        patience = started + PATIENCE_S
        poll = min(POLL_CAP_S, max(POLL_FIRST_S, POLL_SHARE * self._waited_s))
        while True:
            try:
                moved, landed = self._catch_up(latest, token, check_newest=False)
                if landed:
                    self._contended = True  # published in another writer's group
                    self._note_wait(started)
                    return moved
                if my_turn is None or moved.version != latest.version:
                    # First look, or a group came without us (listed before our intent). The
                    # next version comes a leader's cycle later, not at once, so the polls go
                    # on at the pace they had reached.
                    place, waiting = self._place(token, self._listing())
                    my_turn = place == 0
                    patience = time.monotonic() + (place + 1) * (
                        PATIENCE_S + PATIENCE_PER_INTENT_S * waiting
                    )
                latest = moved
                if my_turn or time.monotonic() > patience:
                    return self._publish(intent, latest, group=True)
                failing_since = None
            except (StorageError, OSError) as exc:
                if isinstance(exc, HsstoreError) and not isinstance(exc, StorageError):
                    raise
                now = time.monotonic()
                failing_since = now if failing_since is None else failing_since
                if now - failing_since > wait:
                    raise CommitUnknownError(
                        f"could not learn whether this commit's intent ({token}) was "
                        f"published: {exc}; nothing was deleted, commit again to learn the "
                        f"outcome",
                        path=self.storage.root,
                    ) from exc
            time.sleep(poll)
            poll = min(POLL_CAP_S, poll * 2)

    def _note_wait(self, started: float) -> None:
        waited = time.monotonic() - started
        self._waited_s = waited if not self._waited_s else (self._waited_s + waited) / 2

    def _place(self, token: str, listed: list[str]) -> tuple[int, int]:
        """``token``'s place among the listed tokens not known to be published, earliest left
        first (0: it leads now; a token not listed, e.g. an intent a leader dropped, also
        leads), and how many those are. By arrival, so that a writer arriving while a leader
        builds its group finds itself behind that leader and waits, rather than leading a
        second group that races the first for the same version."""
        waiting = [t for t in listed if t not in self._published]
        return (waiting.index(token) if token in waiting else 0), len(waiting)

    # -- publishing -----------------------------------------------------------------------
    def _publish(self, mine: Delta, base: Manifest, *, group: bool) -> Manifest:
        token = mine.commit
        assert token is not None
        chosen: list[Delta] = []

        def build_next(latest: Manifest) -> Manifest:
            if not group and (chosen or self._others_seen):
                # The direct create lost, or others published since this writer last looked:
                # writers race, and a version of one commit each would only delay the group.
                raise _Contended(latest)
            assert self._check_own is not None
            self._check_own(latest)
            chosen[:] = [mine, *self._others(mine, latest)] if group else [mine]
            provenance = dict(latest.provenance)
            for key, attr in (("skipped", "add_skipped"), ("runs", "add_runs")):
                added = [x for d in chosen for x in getattr(d, attr)]
                if added:
                    provenance[key] = list(provenance.get(key, [])) + added
            segments = tuple(s for d in chosen for s in d.add_segments)
            return latest.with_segments(latest.segments + segments, provenance, latest.version + 1)

        def fields(_: Manifest) -> dict[str, Any]:
            return {
                "group": tuple(d.commit for d in chosen[1:] if d.commit),
                "sample_digest": sample_digest.encode(np.concatenate([_hashes(d) for d in chosen])),
            }

        published = publish(
            self.storage,
            build_next,
            token=token,
            base=base,
            claims=self._claims,
            delta_fields=fields,
            resolve_s=self.resolve_s,
        )
        head = published.head_delta
        if head is not None:
            self._keep(head)
            # Commits race when this version is a group or others published since this
            # writer's last commit; a lone writer's group of one leaves this again.
            self._contended = bool(head.group) or self._others_seen
            if head.commit == token and group:
                # Done with: best effort (gc removes any left, and a writer that has not read
                # this version drops them when it judges them published).
                self._io(self._drop, [token, *head.group])
        return published

    def _others(self, mine: Delta, latest: Manifest) -> list[Delta]:
        """The waiting intents that may go into the version after ``latest`` beside ``mine``,
        in arrival order."""
        taken = set(_hashes(mine).tolist())
        chosen = []
        # An intent a version this writer has read carries is its leader's to delete; reading
        # and judging it again would cost two requests and decide nothing.
        waiting = [t for t in self._listing() if t != mine.commit and t not in self._published]
        unread = [t for t in waiting if t not in self._intents]
        for token, intent in zip(unread, self._io(lambda t: intents.read(
            self.storage, self._keys[t], dataset_id=latest.dataset_id), unread)):  # fmt: skip
            if intent is None:
                # Unreadable or damaged: passed over, and dropped so that the writers taking
                # turns do not wait for it (its writer holds a copy to publish).
                self._drop(token)
            else:
                self._intents[token] = intent
        for token in waiting:
            intent = self._intents.get(token)
            if intent is None:
                continue
            ids = set(_hashes(intent).tolist())
            verdict = self._judge(intent, ids, latest, taken)
            if verdict == "ok":
                chosen.append(intent)
                taken |= ids
            elif verdict != "later":
                # Published already, or it cannot go in after ``latest``: its writer (which
                # holds a copy) learns which when it reads the versions or leads.
                self._drop(token)
                self._intents.pop(token, None)
        return chosen

    def _judge(self, intent: Delta, ids: set[int], latest: Manifest, taken: set[int]) -> str:
        """ "ok" to publish ``intent`` (whose id hashes are ``ids``) after ``latest``;
        "published" when a version did already; "no" when it may not go in after ``latest``
        (its writer, leading, learns why); "later" when it was built on a newer version."""
        assert intent.commit is not None
        if intent.version - 1 > latest.version:
            return "later"
        if not ids.isdisjoint(taken):
            return "no"
        segments = {s.id for s in intent.add_segments}
        for version in range(intent.version, latest.version + 1):
            delta = self._delta(version, latest)
            if delta is None:
                return "no"  # unreadable or pruned: its writer decides
            if delta.carries(intent.commit):
                return "published"
            if not segments.isdisjoint(delta.condemn) or not segments.isdisjoint(
                delta.remove_segments
            ):
                return "no"
            added = self._added[version]
            if added is None or not ids.isdisjoint(added):
                return "no"  # an id hash published, or ids not recorded: its writer checks
        return "ok"

    def _listing(self) -> list[str]:
        """The tokens of the intents waiting now, earliest left first (their keys kept)."""
        listed = intents.waiting(self.storage)
        # This writer's own keys, and the others' as listed now: one not listed is gone.
        own = {t: k for t, k in self._keys.items() if t in self._waiting}
        self._keys = {**listed, **own}
        return list(listed)

    def _drop(self, token: str) -> None:
        """Delete ``token``'s intent (best effort), if this writer knows its key."""
        key = self._keys.pop(token, None)
        if key is not None:
            intents.drop(self.storage, key)

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False)
            self._pool = None

    def _io(self, call: Callable[[str], Any], tokens: list[str]) -> list[Any]:
        """``call`` on each token, several at once: a leader's reads and deletes of the
        group's intents are independent requests, and on an object store each waits a round
        trip."""
        if len(tokens) <= 1:
            return [call(t) for t in tokens]
        if self._pool is None:
            self._pool = ThreadPoolExecutor(IO_THREADS, thread_name_prefix="hsstore-group")
        return list(self._pool.map(call, tokens))

    # -- what this writer knows of the versions ---------------------------------------------
    def _catch_up(
        self, latest: Manifest, token: str, *, check_newest: bool = True
    ) -> tuple[Manifest, bool]:
        """``latest`` moved over the versions after it; True when one carries ``token``."""
        return catch_up(self.storage, latest, token, self._claims, check_newest=check_newest)

    def _claims(self, delta: Delta) -> None:
        if self._token is None or not delta.carries(self._token):
            self._others_seen = True
        if self._writer_claims is not None:
            self._writer_claims(delta)
        self._keep(delta)

    def _keep(self, delta: Delta) -> None:
        if delta.version not in self._deltas:
            if delta.sample_hashes is not None:
                self._added[delta.version] = set(delta.sample_hashes.tolist())
            else:
                self._added[delta.version] = None if delta.add_segments else set()
        self._deltas[delta.version] = delta
        self._published.update(t for t in (delta.commit, *delta.group) if t)
        if len(self._deltas) > KEPT_DELTAS:
            oldest = self._deltas.pop(min(self._deltas))
            del self._added[oldest.version]
            self._published.difference_update((oldest.commit, *oldest.group))
        for token in (delta.commit, *delta.group):
            self._intents.pop(token or "", None)

    def _delta(self, version: int, latest: Manifest) -> Delta | None:
        """The delta of ``version`` (read once), or None when it cannot be read."""
        if version == latest.version and latest.head_delta is not None:
            self._keep(latest.head_delta)
        if version not in self._deltas:
            key = paths.manifest_key(version)
            try:
                doc = load_document(self.storage.read_bytes(key), where=self.storage.path_of(key))
            except (FileNotFoundError, HsstoreError, OSError):
                return None
            if not isinstance(doc, Delta):
                return None
            self._keep(doc)
        return self._deltas[version]


def _hashes(intent: Delta) -> np.ndarray:
    """An intent's id hashes (`intents.read` and `proposal` give every intent a digest)."""
    assert intent.sample_hashes is not None
    return intent.sample_hashes
