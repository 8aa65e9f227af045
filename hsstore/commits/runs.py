"""Extraction runs as data: a job's start and finish, recorded in the dataset's provenance.

``hsstore extract`` (every ``--shard I/N`` of it) commits a ``started`` record before its
workers run and a ``finished`` one, with what it covered, once all of them have succeeded.
Both go through the ordinary commit (``Writer.record_run``), so they are as atomic and as
append-only as the samples. A reader (the following loader, ``hsstore inspect``, the trainer)
asks ``completion(provenance)`` whether the extraction is over, from the records alone.

A job is identified by its input (name, size and SHA-256 of the prompt set, row limit, length
cap) and its shard count N. The extraction is complete when some job has finished every one
of its N shards and no shard of any job has started again without finishing since: a crashed
shard, or a second job appending to the dataset, keeps it incomplete until it finishes.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass, field
from typing import Any

from hsstore.spec.manifest import now_iso

RUNS_KEY = "runs"
_CHUNK = 1 << 20


def input_identity(path: str, *, limit: int | None, max_length: int | None) -> dict[str, Any]:
    """What a job reads: the prompt set's name, size and SHA-256 (a folder: of its file list
    and contents, in sorted order), and the options that cut it."""
    digest = hashlib.sha256()
    size = 0
    files = (
        [path]
        if os.path.isfile(path)
        else sorted(
            os.path.join(root, name) for root, _dirs, names in os.walk(path) for name in names
        )
    )
    for name in files:
        digest.update(os.path.relpath(name, path).encode() + b"\0")
        with open(name, "rb") as f:
            while chunk := f.read(_CHUNK):
                digest.update(chunk)
                size += len(chunk)
    return {
        "input": os.path.basename(os.path.normpath(path)),
        "input_bytes": size,
        "input_sha256": digest.hexdigest(),
        "limit": limit,
        "max_length": max_length,
    }


def run_record(
    event: str, job: dict[str, Any], shard: int, shards: int, **extra: Any
) -> dict[str, Any]:
    """One record: ``event`` ("started" or "finished") of shard ``shard`` of ``shards``."""
    if event not in ("started", "finished"):
        raise ValueError(f"event must be started or finished, got {event!r}")
    return {"event": event, "by": "extract", **job, "shard": f"{shard}/{shards}", "at": now_iso(),
            **extra}  # fmt: skip


@dataclass(frozen=True)
class Completion:
    """What the run records say: ``complete``, and the shards still open (``"I/N of INPUT"``)."""

    complete: bool
    finished_jobs: int = 0
    pending: list[str] = field(default_factory=list)
    records: int = 0


_JOB_FIELDS = ("input", "input_bytes", "input_sha256", "limit", "max_length")


def _job_key(record: dict[str, Any]) -> tuple[str, int]:
    job = {k: record.get(k) for k in _JOB_FIELDS}
    shards = int(str(record["shard"]).split("/")[1])
    return json.dumps(job, sort_keys=True), shards


def completion(provenance: dict[str, Any]) -> Completion:
    """Whether the dataset's extraction is over (see the module doc); malformed records are
    ignored, which can only keep a dataset incomplete or leave it as its other records say."""
    records = [r for r in provenance.get(RUNS_KEY, []) if isinstance(r, dict)]
    last: dict[tuple[tuple[str, int], int], str] = {}  # (job, shard index) -> last event
    for r in records:
        try:
            key = _job_key(r)
            index = int(str(r["shard"]).split("/")[0])
        except (KeyError, ValueError, IndexError):
            continue
        if r.get("event") in ("started", "finished"):
            last[(key, index)] = r["event"]
    pending, finished_jobs = [], 0
    for key in sorted({k for k, _ in last}):
        job, shards = key
        name = json.loads(job).get("input")
        done = [last.get((key, i)) == "finished" for i in range(shards)]
        finished_jobs += all(done)
        pending += [f"{i}/{shards} of {name}" for i in range(shards) if not done[i]]
    return Completion(
        complete=finished_jobs > 0 and not pending,
        finished_jobs=finished_jobs,
        pending=pending,
        records=len(records),
    )
