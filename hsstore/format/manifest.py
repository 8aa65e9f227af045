"""The manifest: one committed version of a dataset, as typed objects.

Every manifest hsstore writes or reads is validated against ``manifest.schema.json``, read as
package data from ``hsstore/schemas/`` (so an installed wheel finds it too).
A manifest from a newer format version is refused instead of misread.
"""

from __future__ import annotations

import datetime as _dt
import json
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from functools import lru_cache
from typing import Any

import numpy as np
import torch

from hsstore import schemas
from hsstore.codecs import CodecConfig
from hsstore.errors import (
    FormatError,
    IncompatibleDatasetError,
    SchemaError,
    UnsupportedVersionError,
)
from hsstore.format.layers import MAX_DEPTH, LayerSpec

FORMAT_NAME = "hsstore"
FORMAT_VERSION = 1

# logical dtype -> (torch dtype, storage numpy dtype). bf16 is stored as uint16 bit patterns:
# zarr-python 3.1 has no bfloat16 data type, and uint16 keeps the bits exact.
DTYPES: dict[str, tuple[torch.dtype, np.dtype]] = {
    "bfloat16": (torch.bfloat16, np.dtype("<u2")),
    "float16": (torch.float16, np.dtype("<f2")),
    "float32": (torch.float32, np.dtype("<f4")),
}
STORAGE_DTYPE_NAMES = {"bfloat16": "uint16", "float16": "float16", "float32": "float32"}
COLUMN_DTYPES = {"input_ids": "int32", "loss_mask": "uint8"}


def dtype_name(dtype: torch.dtype | str) -> str:
    """Normalise a torch dtype or name to one of the logical dtype names."""
    if isinstance(dtype, str):
        name = dtype.removeprefix("torch.")
        name = {"bf16": "bfloat16", "fp16": "float16", "half": "float16", "fp32": "float32",
                "float": "float32"}.get(name, name)  # fmt: skip
    else:
        name = str(dtype).removeprefix("torch.")
    if name not in DTYPES:
        raise FormatError(f"unsupported dtype {dtype!r}; expected one of {sorted(DTYPES)}")
    return name


def storage_view(t: torch.Tensor) -> np.ndarray:
    """The storage-dtype numpy view of a CPU tensor (bf16 -> its uint16 bit patterns)."""
    if t.dtype == torch.bfloat16:
        return t.view(torch.int16).numpy().view("<u2")
    return t.numpy()


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
class Layout:
    """How the [tokens, layers, hidden] state array of a segment is cut into chunks and shards."""

    rows_per_chunk: int
    chunks_per_shard: int
    layers_per_chunk: int

    @property
    def rows_per_shard(self) -> int:
        return self.rows_per_chunk * self.chunks_per_shard

    def to_json(self) -> dict[str, int]:
        return {
            "rows_per_chunk": self.rows_per_chunk,
            "chunks_per_shard": self.chunks_per_shard,
            "layers_per_chunk": self.layers_per_chunk,
        }

    @classmethod
    def choose(
        cls,
        *,
        num_layers: int,
        hidden_size: int,
        itemsize: int,
        layers_per_chunk: int | None = None,
        chunk_bytes: int = 1 << 20,
        shard_bytes: int = 64 << 20,
    ) -> Layout:
        """Rows per chunk: a power of two giving ~1 MiB chunks; ~64 MiB shards."""
        sizes = {"num_layers": num_layers, "hidden_size": hidden_size, "itemsize": itemsize}
        sizes |= {"chunk_bytes": chunk_bytes, "shard_bytes": shard_bytes}
        for what, n in sizes.items():  # a zero or negative size would never end the loop below
            if isinstance(n, bool) or not isinstance(n, int) or n < 1:
                raise FormatError(f"{what} must be a positive integer, got {n!r}")
        lpc = num_layers if layers_per_chunk is None else layers_per_chunk
        if lpc < 1 or num_layers % lpc:
            raise FormatError(f"layers_per_chunk={lpc} must divide the layer count {num_layers}")
        row_bytes = lpc * hidden_size * itemsize
        rows = 1
        while rows * 2 * row_bytes <= chunk_bytes:
            rows *= 2
        chunk = rows * row_bytes * (num_layers // lpc)
        chunks = max(1, min(1024, shard_bytes // max(chunk, 1)))
        return cls(rows_per_chunk=rows, chunks_per_shard=int(chunks), layers_per_chunk=lpc)


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

    def to_json(self) -> dict[str, Any]:
        return {
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

    @classmethod
    def from_json(cls, obj: dict[str, Any]) -> SegmentInfo:
        return cls(
            id=obj["id"],
            num_samples=obj["num_samples"],
            num_tokens=obj["num_tokens"],
            num_shards=obj["num_shards"],
            committed_at=obj["committed_at"],
            files={k: FileInfo(v["size"], v.get("crc32c")) for k, v in obj["files"].items()},
        )


@dataclass(frozen=True)
class Manifest:
    """One committed version of a dataset."""

    version: int
    dataset_id: str
    created_at: str
    committed_at: str
    model: ModelInfo
    tokenizer: dict[str, Any] | None
    hidden_size: int
    dtype: str
    layers: tuple[LayerSpec, ...]
    codec: CodecConfig
    layout: Layout
    segments: tuple[SegmentInfo, ...] = ()
    provenance: dict[str, Any] = field(default_factory=dict)
    columns: dict[str, str] = field(default_factory=lambda: dict(COLUMN_DTYPES))
    format_version: int = FORMAT_VERSION

    @property
    def num_samples(self) -> int:
        return sum(s.num_samples for s in self.segments)

    @property
    def num_tokens(self) -> int:
        return sum(s.num_tokens for s in self.segments)

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype][0]

    @property
    def storage_dtype(self) -> np.dtype:
        return DTYPES[self.dtype][1]

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    def check_compatible(
        self,
        layers: Sequence[LayerSpec],
        *,
        hidden_size: int,
        dtype: torch.dtype | str,
        num_hidden_layers: int | None = None,
        path: str | None = None,
    ) -> None:
        """The one rule for "can these samples go into this dataset", used by every writer path
        (``create(exist_ok=True)``, convert into an existing dataset, extract reruns).

        Layers compare by canonical meaning only, (depth, final_norm): the same state named in
        another convention, or with no source id recorded at all, is the same state. The model
        depth is compared only when both sides know it. Raises IncompatibleDatasetError listing
        every difference.
        """

        def meaning(specs: Sequence[LayerSpec]) -> list[tuple[int, bool]]:
            return [(s.depth, s.final_norm) for s in specs]

        problems = []
        if meaning(self.layers) != meaning(layers):
            have = ", ".join(s.label for s in self.layers)
            want = ", ".join(s.label for s in layers)
            problems.append(f"layers [{have}] (asked for [{want}])")
        if self.hidden_size != hidden_size:
            problems.append(f"hidden_size {self.hidden_size} (asked for {hidden_size})")
        if self.dtype != dtype_name(dtype):
            problems.append(f"dtype {self.dtype} (asked for {dtype_name(dtype)})")
        recorded = self.model.num_hidden_layers
        if None not in (recorded, num_hidden_layers) and recorded != num_hidden_layers:
            problems.append(
                f"states of a model with {recorded} decoder layers (asked for {num_hidden_layers})"
            )
        if problems:
            raise IncompatibleDatasetError(
                "existing dataset does not match: it has " + "; ".join(problems), path=path
            )

    def with_segments(
        self, segments: tuple[SegmentInfo, ...], provenance: dict[str, Any], version: int
    ) -> Manifest:
        return replace(
            self, segments=segments, provenance=provenance, version=version, committed_at=now_iso()
        )

    def to_json(self) -> dict[str, Any]:
        return {
            "format": FORMAT_NAME,
            "format_version": self.format_version,
            "version": self.version,
            "dataset_id": self.dataset_id,
            "created_at": self.created_at,
            "committed_at": self.committed_at,
            "model": self.model.to_json(),
            "tokenizer": self.tokenizer,
            "hidden_size": self.hidden_size,
            "dtype": self.dtype,
            "storage_dtype": STORAGE_DTYPE_NAMES[self.dtype],
            "layers": [layer.to_json() for layer in self.layers],
            "codec": self.codec.to_json(),
            "layout": self.layout.to_json(),
            "columns": dict(self.columns),
            "segments": [s.to_json() for s in self.segments],
            "num_samples": self.num_samples,
            "num_tokens": self.num_tokens,
            "provenance": self.provenance,
        }

    def to_bytes(self) -> bytes:
        obj = self.to_json()
        validate(obj, where=f"manifest version {self.version}")
        return (json.dumps(obj, indent=1) + "\n").encode()

    @classmethod
    def from_bytes(cls, data: bytes, *, where: str) -> Manifest:
        try:
            obj = json.loads(data)
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise FormatError(f"manifest is not valid JSON ({exc})", path=where) from exc
        if not isinstance(obj, dict) or obj.get("format") != FORMAT_NAME:
            raise FormatError('not an hsstore manifest (missing "format": "hsstore")', path=where)
        version = obj.get("format_version")
        if isinstance(version, int) and version > FORMAT_VERSION:
            raise UnsupportedVersionError(
                f"written by format version {version}; this hsstore reads up to "
                f"{FORMAT_VERSION}. Upgrade hsstore to read it.",
                path=where,
            )
        validate(obj, where=where)
        deepest = max((x["depth"] for x in obj["layers"]), default=0)
        if deepest > MAX_DEPTH:  # the schema allows it; LayerSpec would raise a bare ValueError
            raise FormatError(f"a layer depth of {deepest} is past {MAX_DEPTH}", path=where)
        man = cls(
            format_version=obj["format_version"],
            version=obj["version"],
            dataset_id=obj["dataset_id"],
            created_at=obj["created_at"],
            committed_at=obj["committed_at"],
            model=ModelInfo.from_json(obj["model"]),
            tokenizer=obj.get("tokenizer"),
            hidden_size=obj["hidden_size"],
            dtype=obj["dtype"],
            layers=tuple(LayerSpec.from_json(x) for x in obj["layers"]),
            codec=CodecConfig.from_json(obj["codec"]),
            layout=Layout(**obj["layout"]),
            segments=tuple(SegmentInfo.from_json(s) for s in obj["segments"]),
            provenance=obj["provenance"],
            columns=obj["columns"],
        )
        if obj["storage_dtype"] != STORAGE_DTYPE_NAMES[man.dtype]:
            raise FormatError(
                f"storage_dtype {obj['storage_dtype']} does not match dtype {man.dtype}", path=where
            )
        if obj["num_samples"] != man.num_samples or obj["num_tokens"] != man.num_tokens:
            raise FormatError("num_samples/num_tokens disagree with the segment list", path=where)
        if (
            man.layout.layers_per_chunk > man.num_layers
            or man.num_layers % man.layout.layers_per_chunk
        ):
            raise FormatError("layout.layers_per_chunk must divide the layer count", path=where)
        return man


@lru_cache(maxsize=1)
def schema() -> dict[str, Any]:
    return schemas.load(schemas.MANIFEST)


@lru_cache(maxsize=1)
def _validator() -> Any:
    import jsonschema

    return jsonschema.Draft202012Validator(schema())


def validate(obj: Any, *, where: str) -> None:
    """Raise SchemaError naming the first violation (JSON path and message)."""
    errors = sorted(_validator().iter_errors(obj), key=lambda e: list(e.absolute_path))
    if errors:
        err = errors[0]
        loc = "/".join(str(p) for p in err.absolute_path) or "(top level)"
        more = f" (+{len(errors) - 1} more)" if len(errors) > 1 else ""
        raise SchemaError(f"schema violation at {loc}: {err.message}{more}", path=where)
