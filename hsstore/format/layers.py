"""Canonical layer semantics.

A stored state is described by how many decoder layers had been applied to the residual stream
(0 = the embeddings, N = every layer) and whether the model's final norm was applied on top.
Conventions of other frameworks map to and from this form in :mod:`hsstore.format.conventions`.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class LayerSpec:
    """One stored hidden state, in canonical terms.

    depth: decoder layers applied (0 = embedding output, N = output of the last layer).
    final_norm: the model's final norm was applied (only meaningful when depth == N).
    source_convention / source_id: what the producer called this layer, kept as provenance.
    """

    depth: int
    final_norm: bool = False
    source_convention: str | None = None
    source_id: int | None = None

    def __post_init__(self) -> None:
        if self.depth < 0:
            raise ValueError(f"layer depth must be >= 0, got {self.depth}")

    @property
    def label(self) -> str:
        return f"after {self.depth}" + (" +final_norm" if self.final_norm else "")

    def to_json(self) -> dict:
        out: dict = {"depth": self.depth, "final_norm": self.final_norm}
        if self.source_convention is not None:
            out["source"] = {"convention": self.source_convention, "id": self.source_id}
        return out

    @classmethod
    def from_json(cls, obj: dict) -> LayerSpec:
        src = obj.get("source") or {}
        return cls(
            depth=int(obj["depth"]),
            final_norm=bool(obj.get("final_norm", False)),
            source_convention=src.get("convention"),
            source_id=src.get("id"),
        )
