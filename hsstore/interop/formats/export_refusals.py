"""Refusals of an export whose layers the target format cannot hold, each naming the
``hsstore extract --layers`` that would have stored a dataset it can (docs/CONVERT.md)."""

from __future__ import annotations

from collections.abc import Sequence

from hsstore.errors import BadInputError
from hsstore.spec.layers import LayerSpec, prenorm_final_option


def export_refusal(
    fmt: str,
    why: str,
    layers: Sequence[LayerSpec],
    num_hidden_layers: int,
    path: str,
    *,
    min_depth: int = 0,
) -> BadInputError:
    """One line: why ``fmt`` cannot hold a dataset's layers, and the ``--layers`` of an
    extraction whose dataset it could have held (speculators' layout: aux depths ascending, the
    final state before the norm last)."""
    hint = prenorm_final_option(layers, num_hidden_layers, min_depth)
    return BadInputError(
        f"cannot export to {fmt}: {why}; extracting with --layers {hint} would have made it "
        "exportable",
        path=path,
    )


def require_prenorm_final(
    fmt: str,
    layers: Sequence[LayerSpec],
    num_hidden_layers: int,
    path: str,
    *,
    min_depth: int = 0,
) -> None:
    """speculators' trainers (v1 files and Arrow) apply the target's final norm to the last
    stored layer themselves, so it must be the final state before the norm. A normed state
    cannot be turned back: RMSNorm discards each token's scale."""
    last, n = layers[-1], num_hidden_layers
    if last.final_norm:
        why = (
            "its trainer applies the target's final norm to the last stored layer itself, so "
            "that layer must be the final state before the final norm, but this dataset stores "
            f"it after the norm ({last.label}), which cannot be undone"
        )
    elif last.depth != n:
        why = (
            "its trainer takes the last stored layer as the target's final state before the "
            f"norm (after {n}), but this dataset's last layer is {last.label}"
        )
    else:
        return
    raise export_refusal(fmt, why, layers, n, path, min_depth=min_depth)
