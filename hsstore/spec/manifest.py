"""The manifest: one committed version of a dataset, as typed objects.

A version file is either a full manifest (``Manifest``: version 1 and every checkpoint) or a
delta (``Delta``: the segments one commit adds). Every one hsstore writes or reads is validated
against the manifest JSON Schema (`hsstore.spec.schema`) and carries an XXH3-64 checksum of
its canonical JSON, checked on every load, so an edited byte is refused instead of decoded into
wrong numbers; a manifest from a newer format version is refused instead of misread.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np
import torch

from hsstore.codec.codecs import CodecConfig
from hsstore.codec.tiers import Tier, check_matches
from hsstore.errors import (
    FormatError,
    IncompatibleDatasetError,
    IntegrityError,
    UnsupportedVersionError,
)
from hsstore.spec.delta import Delta
from hsstore.spec.dtypes import (
    COLUMN_DTYPES,
    DTYPES,
    SCALED_DTYPES,
    SCALES_COLUMN,
    STORAGE_DTYPE_NAMES,
    columns_for,
    dtype_name,
)
from hsstore.spec.layers import LayerSpec
from hsstore.spec.layout import MAX_CHUNK_BYTES, Layout
from hsstore.spec.manifest_parts import (  # noqa: F401 - the parts a manifest is made of
    FileInfo,
    ModelInfo,
    SegmentInfo,
    check_unique_segments,
    now_iso,
)
from hsstore.spec.schema import check_nesting, validate
from hsstore.spec.sealing import FORMAT_NAME, FORMAT_VERSION, checksum_matches, seal_checked

# Provenance lists a commit may append to (and nothing else of the provenance may change): inputs
# a converter left out, the start and end records of extraction runs, what a repair changed.
APPENDED_PROVENANCE = ("skipped", "runs", "repairs")


@dataclass(frozen=True)
class Manifest:
    """One committed version of a dataset: the full state."""

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
    tier: Tier | None = None  # a lossy tier (hsstore.codec.tiers); None: lossless
    # The checksum of this version's own file (``manifests/v{version}.json``): the link the
    # next delta's ``prev`` names (None where it is not known, e.g. folded from a checkpoint).
    head_checksum: str | None = field(default=None, compare=False)
    head_delta: Delta | None = field(default=None, compare=False, repr=False)  # its delta, if read

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

    @property
    def scaled(self) -> bool:
        """Do the states carry a per-token scale (column `SCALES_COLUMN`)?"""
        return self.dtype in SCALED_DTYPES

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

    @property
    def chunk_nbytes(self) -> int:
        """Decoded size of one inner chunk: what every chunk of every segment must decode to."""
        layout = self.layout
        return (
            layout.rows_per_chunk
            * layout.layers_per_chunk
            * self.hidden_size
            * self.storage_dtype.itemsize
        )

    def with_segments(
        self, segments: tuple[SegmentInfo, ...], provenance: dict[str, Any], version: int
    ) -> Manifest:
        return replace(
            self,
            segments=segments,
            provenance=provenance,
            version=version,
            committed_at=now_iso(),
            format_version=FORMAT_VERSION,
            head_checksum=None,
            head_delta=None,
        )

    def delta_to(self, nxt: Manifest) -> Delta:
        """The delta that turns this version into ``nxt``, which adds segments and skipped
        inputs and may remove segments (a repair), recording each removal in ``repairs``."""
        new_ids = {s.id for s in nxt.segments}
        kept = tuple(s for s in self.segments if s.id in new_ids)
        removed = tuple(s.id for s in self.segments if s.id not in new_ids)
        n = len(kept)
        appended = {}
        for key in APPENDED_PROVENANCE:
            old, new = self.provenance.get(key, []), nxt.provenance.get(key, [])
            if new[: len(old)] != old:
                raise FormatError(f"a commit may only append to provenance.{key}")
            appended[key] = tuple(new[len(old) :])
        if (
            nxt.version != self.version + 1
            or nxt.segments[:n] != kept
            or (removed and len(appended["repairs"]) == 0)
            or _unappended(nxt.provenance) != _unappended(self.provenance)
            or _fixed_part(nxt) != _fixed_part(self)
        ):
            raise FormatError(
                "a commit may only add segments, skipped inputs and run records, or remove "
                "segments it records as dropped"
            )
        return Delta(
            version=nxt.version,
            dataset_id=self.dataset_id,
            committed_at=nxt.committed_at,
            add_segments=nxt.segments[n:],
            add_skipped=appended["skipped"],
            add_runs=appended["runs"],
            prev=self.head_checksum,
            remove_segments=removed,
            add_repairs=appended["repairs"],
        )

    def apply(self, delta: Delta, *, where: str) -> Manifest:
        """The next version: this one plus ``delta``."""
        if delta.dataset_id != self.dataset_id:
            raise FormatError(
                f"delta belongs to dataset {delta.dataset_id}, not {self.dataset_id}", path=where
            )
        if delta.version != self.version + 1:
            raise FormatError(
                f"delta is version {delta.version}, expected {self.version + 1}", path=where
            )
        delta.check_follows(self.version, self.head_checksum, where=where)
        segments = self.segments
        if delta.remove_segments:
            gone = set(delta.remove_segments)
            unknown = gone - {s.id for s in segments}
            if unknown:
                raise FormatError(
                    f"delta removes segment {sorted(unknown)[0]}, which is not listed", path=where
                )
            segments = tuple(s for s in segments if s.id not in gone)
        check_unique_segments(segments, delta.add_segments, where=where)
        provenance = self.provenance
        for key, added in (
            ("skipped", delta.add_skipped),
            ("runs", delta.add_runs),
            ("repairs", delta.add_repairs),
        ):
            if added:
                provenance = dict(provenance)
                provenance[key] = list(provenance.get(key, [])) + list(added)
        return replace(
            self,
            version=delta.version,
            committed_at=delta.committed_at,
            segments=segments + delta.add_segments,
            provenance=provenance,
            format_version=FORMAT_VERSION,
            head_checksum=delta.checksum,
            head_delta=delta,
        )

    def to_json(self) -> dict[str, Any]:
        obj = {
            "format": FORMAT_NAME,
            "format_version": self.format_version,
            "kind": "full",
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
        if self.format_version < 2:
            del obj["kind"]
        if self.tier is not None:
            obj["tier"] = self.tier.to_json()
        return obj

    def to_bytes(self) -> bytes:
        if self.format_version != FORMAT_VERSION:
            raise FormatError(f"hsstore writes format version {FORMAT_VERSION} only")
        return seal_checked(self.to_json(), where=f"manifest version {self.version}")

    @classmethod
    def from_bytes(cls, data: bytes, *, where: str) -> Manifest:
        doc = load_document(data, where=where)
        if not isinstance(doc, Manifest):
            raise FormatError("expected a full manifest, found a delta", path=where)
        return doc

    @classmethod
    def from_json(cls, obj: dict[str, Any], *, where: str) -> Manifest:
        try:
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
                segments=tuple(SegmentInfo.from_json(s, where=where) for s in obj["segments"]),
                provenance=obj["provenance"],
                columns=obj["columns"],
                tier=Tier.from_json(obj["tier"], where=where) if "tier" in obj else None,
            )
        except ValueError as exc:  # a LayerSpec or codec the dataclasses refuse
            raise FormatError(str(exc), path=where) from exc
        check_unique_segments((), man.segments, where=where)
        check_matches(man.tier, man.dtype, where=where)
        if obj["storage_dtype"] != STORAGE_DTYPE_NAMES[man.dtype]:
            raise FormatError(
                f"storage_dtype {obj['storage_dtype']} does not match dtype {man.dtype}", path=where
            )
        if man.columns.get(SCALES_COLUMN) != columns_for(man.dtype).get(SCALES_COLUMN):
            raise FormatError(
                f"columns {sorted(man.columns)} do not match dtype {man.dtype} (a per-token "
                f"{SCALES_COLUMN!r} float32 column goes with {sorted(SCALED_DTYPES)} only)",
                path=where,
            )
        if obj["num_samples"] != man.num_samples or obj["num_tokens"] != man.num_tokens:
            raise FormatError("num_samples/num_tokens disagree with the segment list", path=where)
        if (
            man.layout.layers_per_chunk > man.num_layers
            or man.num_layers % man.layout.layers_per_chunk
        ):
            raise FormatError("layout.layers_per_chunk must divide the layer count", path=where)
        if man.chunk_nbytes > MAX_CHUNK_BYTES:
            raise FormatError(
                f"layout makes {man.chunk_nbytes}-byte chunks (at most {MAX_CHUNK_BYTES})",
                path=where,
            )
        if man.model.hidden_size is not None and man.model.hidden_size != man.hidden_size:
            raise FormatError(
                f"model.hidden_size {man.model.hidden_size} != hidden_size {man.hidden_size}",
                path=where,
            )
        top = man.model.num_hidden_layers
        for k, layer in enumerate(man.layers):
            if top is not None and layer.depth > top:
                raise FormatError(
                    f"layers[{k}].depth {layer.depth} exceeds model.num_hidden_layers {top}",
                    path=where,
                )
        return man


def _unappended(provenance: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in provenance.items() if k not in APPENDED_PROVENANCE}


def _fixed_part(man: Manifest) -> Manifest:
    """What no commit may change: everything but segments, provenance and the version stamp."""
    return replace(man, segments=(), provenance={}, version=0, committed_at="", format_version=0)


def load_document(data: bytes, *, where: str) -> Manifest | Delta:
    """Parse one version (or checkpoint) file: a full manifest or a delta, checked whole."""
    try:
        obj = json.loads(data)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise FormatError(f"manifest is not valid JSON ({exc})", path=where) from exc
    except RecursionError as exc:
        raise FormatError("manifest is nested too deeply", path=where) from exc
    if not isinstance(obj, dict) or obj.get("format") != FORMAT_NAME:
        raise FormatError('not an hsstore manifest (missing "format": "hsstore")', path=where)
    version = obj.get("format_version")
    if isinstance(version, int) and version > FORMAT_VERSION:
        raise UnsupportedVersionError(
            f"written by format version {version}; this hsstore reads up to "
            f"{FORMAT_VERSION}. Upgrade hsstore to read it.",
            path=where,
        )
    for free_form in ("provenance", "tokenizer"):  # the schema bounds the depth of the rest
        check_nesting(obj.get(free_form), where=where)
    stored = obj.get("checksum")
    # The checksum first: a damaged byte is reported as damage, not as whatever rule it broke.
    if isinstance(stored, str) and not checksum_matches(data, stored):
        raise IntegrityError(
            "manifest checksum mismatch: the file was edited or damaged after it was written",
            path=where,
        )
    try:
        validate(obj, where=where)
    except RecursionError as exc:  # a deep value quoted in a schema message
        raise FormatError("manifest is nested too deeply", path=where) from exc
    if obj["format_version"] >= 2 and stored is None:
        raise FormatError("manifest has no checksum (format 2 requires one)", path=where)
    if obj.get("kind") == "delta":
        return Delta.from_json(obj, where=where)
    return replace(Manifest.from_json(obj, where=where), head_checksum=stored)
