"""A delta: what one commit adds to the version before it (docs/FORMAT.md, "Versions").

Every version file after the first is one; `hsstore.spec.manifest` folds them into the full
state (`Manifest.apply`) and builds them (`Manifest.delta_to`), and an intent of group commit
(`hsstore.commits.intents`) is one waiting to be published.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property
from typing import Any

import numpy as np

from hsstore.errors import IntegrityError
from hsstore.spec import paths, sample_digest
from hsstore.spec.manifest_parts import SegmentInfo, check_unique_segments
from hsstore.spec.sealing import FORMAT_NAME, FORMAT_VERSION, seal_checked


@dataclass(frozen=True)
class Delta:
    """What one commit adds to the version before it (format 2)."""

    version: int
    dataset_id: str
    committed_at: str
    add_segments: tuple[SegmentInfo, ...]
    add_skipped: tuple[dict[str, str], ...] = ()
    add_runs: tuple[dict[str, Any], ...] = ()  # appended to provenance.runs (hsstore.commits.runs)
    # The committer's identity (writer and attempt): how a writer whose request's outcome is
    # unknown recognises its own version when it reads it back.
    commit: str | None = None
    # Unreferenced segments gc is about to remove (gc's own versions): a writer that finds one
    # of its segments here refuses to publish it (see hsstore.commits.commit).
    condemn: tuple[str, ...] = ()
    # The hash chain: the checksum of the previous version's file (None: not recorded).
    prev: str | None = None
    # A repair: segments this version no longer lists, each recorded in ``add_repairs``.
    remove_segments: tuple[str, ...] = ()
    add_repairs: tuple[dict[str, Any], ...] = ()
    # Group commit: the tokens of the other writers' intents this version publishes beside
    # ``commit``'s (hsstore.commits.group); each of them recognises its commit by its token.
    group: tuple[str, ...] = ()
    # The XXH3-64 of every added sample id (hsstore.spec.sample_digest), or None where the
    # committer did not record it (then the added segments' indexes hold the ids).
    sample_digest: str | None = None
    # This delta's own file checksum, once sealed or read (not part of its JSON).
    checksum: str | None = field(default=None, compare=False)

    def to_json(self) -> dict[str, Any]:
        obj: dict[str, Any] = {
            "format": FORMAT_NAME,
            "format_version": FORMAT_VERSION,
            "kind": "delta",
            "version": self.version,
            "dataset_id": self.dataset_id,
            "committed_at": self.committed_at,
            "add_segments": [s.to_json() for s in self.add_segments],
            "add_skipped": list(self.add_skipped),
        }
        if self.add_runs:  # written only when there are some: most commits add none
            obj["add_runs"] = list(self.add_runs)
        if self.commit is not None:
            obj["commit"] = self.commit
        if self.condemn:
            obj["condemn"] = list(self.condemn)
        if self.prev is not None:
            obj["prev"] = self.prev
        if self.remove_segments:
            obj["remove_segments"] = list(self.remove_segments)
        if self.add_repairs:
            obj["add_repairs"] = list(self.add_repairs)
        if self.group:
            obj["group"] = list(self.group)
        if self.sample_digest is not None:
            obj["sample_digest"] = self.sample_digest
        return obj

    def carries(self, token: str) -> bool:
        """Whether this version published the commit holding ``token``."""
        return self.commit == token or token in self.group

    @cached_property
    def sample_hashes(self) -> np.ndarray | None:
        """The id hashes ``sample_digest`` holds, in order (None: not recorded); decoded once."""
        if self.sample_digest is None:
            return None
        return sample_digest.decode(
            self.sample_digest,
            expected=sum(s.num_samples for s in self.add_segments),
            where=f"manifest version {self.version}",
        )

    @cached_property
    def segment_hashes(self) -> dict[str, np.ndarray] | None:
        """The id hashes of each added segment (None: not recorded)."""
        if self.sample_hashes is None:
            return None
        counts = [s.num_samples for s in self.add_segments]
        parts = sample_digest.split(self.sample_hashes, counts)
        return dict(zip((s.id for s in self.add_segments), parts))

    def check_follows(self, version: int, checksum: str | None, *, where: str) -> None:
        """Raise if this delta follows another file than ``checksum`` (None: not known)."""
        if self.prev is not None and checksum is not None and self.prev != checksum:
            raise IntegrityError(
                f"hash chain broken: this delta follows a version {version} whose file had "
                f"checksum {self.prev}, but {paths.manifest_key(version)} has {checksum} (a "
                f"version was replaced)",
                path=where,
            )

    def to_bytes(self) -> bytes:
        return seal_checked(self.to_json(), where=f"manifest version {self.version}")

    @classmethod
    def from_json(cls, obj: dict[str, Any], *, where: str) -> Delta:
        segments = tuple(SegmentInfo.from_json(s, where=where) for s in obj["add_segments"])
        check_unique_segments((), segments, where=where)
        digest = obj.get("sample_digest")
        if digest is not None:  # the one check the schema cannot make: its length
            sample_digest.decode(digest, expected=sum(s.num_samples for s in segments), where=where)
        return cls(
            version=obj["version"],
            dataset_id=obj["dataset_id"],
            committed_at=obj["committed_at"],
            add_segments=segments,
            add_skipped=tuple(obj["add_skipped"]),
            add_runs=tuple(obj.get("add_runs", ())),
            commit=obj.get("commit"),
            condemn=tuple(obj.get("condemn", ())),
            prev=obj.get("prev"),
            remove_segments=tuple(obj.get("remove_segments", ())),
            add_repairs=tuple(obj.get("add_repairs", ())),
            group=tuple(obj.get("group", ())),
            sample_digest=digest,
            checksum=obj.get("checksum"),
        )
