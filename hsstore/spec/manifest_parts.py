"""The parts of a manifest that describe what it lists: the model, and each committed segment
with its files."""

from __future__ import annotations

import datetime as _dt
from dataclasses import dataclass
from typing import Any

from hsstore.errors import FormatError
from hsstore.spec import paths


def now_iso() -> str:
    return _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="milliseconds")


@dataclass(frozen=True)
class ModelInfo:
    name: str | None = None
    revision: str | None = None
    num_hidden_layers: int | None = None
    hidden_size: int | None = None
    vocab_size: int | None = None

    def to_json(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "revision": self.revision,
            "num_hidden_layers": self.num_hidden_layers,
            "hidden_size": self.hidden_size,
            "vocab_size": self.vocab_size,
        }

    @classmethod
    def from_json(cls, obj: dict[str, Any] | None) -> ModelInfo:
        obj = obj or {}
        unknown = set(obj) - {"name", "revision", "num_hidden_layers", "hidden_size", "vocab_size"}
        if unknown:
            raise FormatError(f"unknown model fields {sorted(unknown)}")
        return cls(**obj)


@dataclass(frozen=True)
class FileInfo:
    size: int
    crc32c: int | None = None


@dataclass(frozen=True)
class SegmentInfo:
    """One committed, immutable segment."""

    id: str
    num_samples: int
    num_tokens: int
    num_shards: int
    files: dict[str, FileInfo]
    committed_at: str
    # Rows of the segment's per-token arrays: num_tokens plus the padding of a sample-aligned
    # layout (None: no padding, the arrays have num_tokens rows).
    padded_rows: int | None = None

    @property
    def num_rows(self) -> int:
        return self.num_tokens if self.padded_rows is None else self.padded_rows

    def to_json(self) -> dict[str, Any]:
        obj: dict[str, Any] = {
            "id": self.id,
            "num_samples": self.num_samples,
            "num_tokens": self.num_tokens,
            "num_shards": self.num_shards,
            "committed_at": self.committed_at,
            "files": {
                k: {"size": v.size, "crc32c": v.crc32c}
                if v.crc32c is not None
                else {"size": v.size}
                for k, v in sorted(self.files.items())
            },
        }
        if self.padded_rows is not None:
            obj["num_rows"] = self.padded_rows
        return obj

    @classmethod
    def from_json(cls, obj: dict[str, Any], *, where: str) -> SegmentInfo:
        for relpath in obj["files"]:
            shard = paths.shard_of(relpath)
            if shard is None and relpath not in paths.SEGMENT_SMALL_FILES:
                raise FormatError(
                    f"segment {obj['id']} lists an unknown file {relpath!r}", path=where
                )
            if shard is not None and shard >= obj["num_shards"]:
                raise FormatError(
                    f"segment {obj['id']} lists shard {shard} but has {obj['num_shards']} shards",
                    path=where,
                )
        padded_rows = obj.get("num_rows")
        if padded_rows is not None and padded_rows < obj["num_tokens"]:
            raise FormatError(
                f"segment {obj['id']} has {padded_rows} rows for {obj['num_tokens']} tokens",
                path=where,
            )
        return cls(
            id=obj["id"],
            num_samples=obj["num_samples"],
            num_tokens=obj["num_tokens"],
            num_shards=obj["num_shards"],
            committed_at=obj["committed_at"],
            files={k: FileInfo(v["size"], v.get("crc32c")) for k, v in obj["files"].items()},
            padded_rows=padded_rows,
        )


def check_unique_segments(
    have: tuple[SegmentInfo, ...], new: tuple[SegmentInfo, ...], *, where: str
) -> None:
    seen = {s.id for s in have}
    for seg in new:
        if seg.id in seen:
            raise FormatError(f"segment {seg.id} is listed twice", path=where)
        seen.add(seg.id)
