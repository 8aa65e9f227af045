"""Canonical layer semantics.

A stored state is described by how many decoder layers had been applied to the residual stream
(0 = the embeddings, N = every layer) and whether the model's final norm was applied on top.
Conventions of other frameworks map to and from this form in :mod:`hsstore.spec.conventions`.
"""

from __future__ import annotations

import numbers
from collections.abc import Sequence
from dataclasses import dataclass

# No released model has more than a few hundred decoder layers: a depth (or a layer count) past
# this is a typo or an overflow, such as a layer id of 999999999999, refused before it sizes
# anything.
MAX_DEPTH = 1 << 16


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
        if isinstance(self.depth, bool) or not isinstance(self.depth, numbers.Integral):
            raise ValueError(f"layer depth must be an integer, got {self.depth!r}")
        if not 0 <= self.depth <= MAX_DEPTH:
            raise ValueError(f"layer depth must be in 0..{MAX_DEPTH}, got {self.depth}")

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


def verifier_position(layers: Sequence[LayerSpec]) -> int:
    """Position in ``layers`` of the verifier's state: the deepest stored one, the normed one
    when both the pre-norm and the normed final state are stored (the state the target's head
    reads). The loader, the trainer and the audit all ask this one function."""
    if not layers:
        raise ValueError("a dataset needs at least one layer")
    return max(range(len(layers)), key=lambda i: (layers[i].depth, layers[i].final_norm))


def check_layer_list(layers: Sequence[LayerSpec], num_hidden_layers: int | None) -> None:
    """The rule every stored layer list follows: non-empty, no state twice, inside the model.

    Raises ValueError saying which layer breaks it.
    """
    if not layers:
        raise ValueError("a dataset needs at least one layer")
    first: dict[tuple[int, bool], int] = {}
    for i, spec in enumerate(layers):
        key = (spec.depth, spec.final_norm)
        if key in first:
            raise ValueError(f"layers {first[key]} and {i} are the same state ({spec.label})")
        first[key] = i
        if num_hidden_layers is not None and spec.depth > num_hidden_layers:
            raise ValueError(
                f"layer {i} has depth {spec.depth}, but the model has {num_hidden_layers} "
                "decoder layers"
            )


def layers_option(layers: Sequence[LayerSpec], num_hidden_layers: int) -> str:
    """The ``hsstore extract --layers`` value that stores exactly ``layers``, in this order."""

    def token(spec: LayerSpec) -> str:
        if spec.depth == num_hidden_layers:
            return "final" if spec.final_norm else "final-prenorm"
        return str(spec.depth)

    return ",".join(token(s) for s in layers)


def prenorm_final_option(
    layers: Sequence[LayerSpec], num_hidden_layers: int, min_depth: int = 0
) -> str:
    """``--layers`` for ``layers``' aux depths (ascending, from ``min_depth``) followed by the
    final state before the norm: the layout speculators' trainers read. With no aux depth to
    keep, the default EAGLE-3 choice."""
    n = num_hidden_layers
    aux = sorted({s.depth for s in layers if min_depth <= s.depth < n})
    if not aux:
        return "eagle3,final-prenorm"
    return layers_option([LayerSpec(d) for d in aux] + [LayerSpec(n)], n)
