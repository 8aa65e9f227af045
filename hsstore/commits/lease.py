"""Writer leases: how gc tells a segment a live writer is filling from debris of a dead one.

A writer creates ``segments/<id>/.writing`` (a small JSON object: owner, host, pid, ttl)
before it writes any file of segment ``<id>``, and a heartbeat thread rewrites it every
``ttl/3`` seconds until the segment is committed or dropped. Liveness is judged on the
storage's own clock: the lease is live while ``storage.now() - lease.modified < ttl``, so the
clocks of writer and gc machines never need to agree. The same object works on a local disk
and on an object store (no ``flock``, which object stores lack and network filesystems fake).
The full argument is in docs/DESIGN.md, "Leases and gc".
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import threading
import time
import uuid
from dataclasses import dataclass

from hsstore import settings
from hsstore.errors import ConflictError, HsstoreError
from hsstore.spec import paths
from hsstore.storage.store import ObjectInfo, Storage

# A gap between refreshes this close to the ttl counts as a lapse (clock rates differ a little).
LAPSE_MARGIN = 0.8
# A lease written within this share of its ttl is not written again before a publish: it
# still has at least 5/6 of its ttl to run, more than the heartbeat alone ever leaves it (2/3),
# and for a small commit the write would be one of its twenty storage calls.
FRESH_SHARE = 1 / 6


def lease_key(segment_id: str) -> str:
    return paths.segment_file(segment_id, paths.WRITING_LOCK)


@dataclass
class Lease:
    """One live writer's claim on one segment."""

    storage: Storage
    segment_id: str
    owner: str
    ttl_s: float
    refreshed: float = 0.0  # time.monotonic() when the last successful write started
    # Whether gc may at some point have judged this lease dead. Informative only: whether gc
    # acted on it is decided by the manifest log (gc condemns a segment in a version before it
    # deletes it, and a writer refuses to publish a condemned one; hsstore.commits.commit).
    lapsed: bool = False
    # Set when its writer is done with it (committed, aborted, closed): the heartbeat writes it
    # no more, and one write still in flight then is followed by a delete when ``deleted``.
    dropped: bool = False
    deleted: bool = False

    def _doc(self) -> bytes:
        return json.dumps(
            {
                "owner": self.owner,
                "host": socket.gethostname(),
                "pid": os.getpid(),
                "ttl_s": self.ttl_s,
            }
        ).encode()

    def acquire(self) -> None:
        started = time.monotonic()
        # A create whose reply was lost and was resent finds our own document: acquired.
        if not self.storage.put_if_absent(lease_key(self.segment_id), self._doc()):
            raise ConflictError(
                "segment id already leased by another writer",
                path=self.storage.path_of(paths.segment_dir(self.segment_id)),
            )
        self.refreshed = started

    def refresh(self) -> None:
        started = time.monotonic()
        self.storage.put(lease_key(self.segment_id), self._doc())
        # The object gc judged was stamped no earlier than the last write's start, and the new
        # one no later than this write's end: a stall inside the write counts as a gap too.
        if time.monotonic() - self.refreshed >= self.ttl_s * LAPSE_MARGIN:
            self.lapsed = True
        self.refreshed = started

    def release(self) -> None:
        self.storage.delete(lease_key(self.segment_id))

    def drop(self, *, delete: bool) -> None:
        self.dropped, self.deleted = True, delete
        if delete:
            self.release()


class LeaseKeeper:
    """The heartbeat: refreshes every held lease each ``ttl/3`` seconds on a daemon thread."""

    def __init__(self, storage: Storage, *, ttl_s: float | None = None):
        self.storage = storage
        # How long a lease outlives its last heartbeat (default: HSSTORE_LEASE_TTL, or 60 s);
        # gc reads each lease's own ttl from the lease, so mixed settings are safe.
        self.ttl_s = settings.current().lease_ttl_s if ttl_s is None else ttl_s
        self.owner = uuid.uuid4().hex
        self._leases: dict[str, Lease] = {}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def acquire(self, segment_id: str) -> Lease:
        lease = Lease(self.storage, segment_id, self.owner, self.ttl_s)
        lease.acquire()
        with self._lock:
            self._leases[segment_id] = lease
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="hsstore-lease", daemon=True)
                self._thread.start()
        return lease

    def get(self, segment_id: str) -> Lease:
        return self._leases[segment_id]

    def refresh_now(self, segment_ids: list[str]) -> None:
        """Refresh these leases synchronously (before a publish), so gc sees them live while
        the manifest's conditional create is in flight. Best effort: a failed refresh only
        makes gc's liveness judgement pessimistic, and the log still decides (a segment gc
        condemned is never published). A lease written moments ago is left as it is."""
        fresh = time.monotonic() - self.ttl_s * FRESH_SHARE
        for seg_id in segment_ids:
            lease = self._leases[seg_id]
            if lease.refreshed > fresh and not lease.lapsed:
                continue
            with contextlib.suppress(HsstoreError, OSError):
                lease.refresh()

    def lapsed(self, segment_ids: list[str]) -> bool:
        """Whether gc may have judged any of these leases dead at some point (or now)."""
        late = time.monotonic() - self.ttl_s * LAPSE_MARGIN
        held = [self._leases[s] for s in segment_ids if s in self._leases]
        return any(lease.lapsed or lease.refreshed <= late for lease in held)

    def drop(self, segment_id: str, *, delete: bool = True) -> None:
        """Stop refreshing a lease; delete its object unless told to leave it to expire."""
        with self._lock:
            lease = self._leases.pop(segment_id, None)
        if lease is not None:
            lease.drop(delete=delete)

    def release_all(self) -> None:
        """Stop the heartbeat and delete every held lease (the writer is done: close, or dropped
        without close). Segments it never committed are then debris to gc, which re-reads the
        manifest before deleting, so one whose publish raised late is still kept."""
        self.close()
        with self._lock:
            held, self._leases = list(self._leases.values()), {}
        for lease in held:
            with contextlib.suppress(HsstoreError, OSError):
                lease.drop(delete=True)

    def _run(self) -> None:
        while not self._stop.wait(self.ttl_s / 3):
            with self._lock:
                held = list(self._leases.values())
            # Outside the lock: a write the storage stalls on (a slow object store) holds up
            # neither a new segment's lease nor the drop of a committed one.
            for lease in held:
                if lease.dropped:
                    continue
                try:
                    lease.refresh()
                except Exception:  # noqa: BLE001 - a failed beat is retried on the next one
                    continue
                if lease.dropped and lease.deleted:
                    # Dropped while this write was in flight, which may have landed after the
                    # drop's delete: delete again (a lease left behind would only lapse).
                    with contextlib.suppress(HsstoreError, OSError):
                        lease.release()

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=self.ttl_s)
        self._thread = None


def lease_is_live(storage: Storage, lease: ObjectInfo, now: float) -> bool:
    """Whether a lease object was refreshed within its ttl (on the storage's clock)."""
    ttl = settings.current().lease_ttl_s
    try:
        ttl = float(json.loads(storage.read_bytes(lease.key))["ttl_s"])
    except FileNotFoundError:
        return False  # released meanwhile
    except (ValueError, KeyError, TypeError):
        pass  # unreadable: judge it by the default ttl
    return now - lease.modified < ttl + storage.clock_resolution_s
