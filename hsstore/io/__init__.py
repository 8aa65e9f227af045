"""Readers and writers for hidden-state formats other than hsstore's own (foreign formats).

``detect_format`` tells the formats apart by their files; ``open_foreign`` returns a
:class:`ForeignReader` for one of them. Each format lives in its own module.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path

from hsstore.errors import BadInputError, HsstoreError
from hsstore.io.base import ForeignReader, ForeignSample

HSSTORE = "hsstore"
SPECULATORS_V1 = "speculators-v1"
SPECFORGE = "specforge"
SPECULATORS_ARROW = "speculators-arrow"

FOREIGN_FORMATS: tuple[str, ...] = (SPECULATORS_V1, SPECFORGE, SPECULATORS_ARROW)
ALL_FORMATS: tuple[str, ...] = (HSSTORE, *FOREIGN_FORMATS)
# Formats an hsstore dataset can be exported to (each module's ForeignWriter).
EXPORT_FORMATS: tuple[str, ...] = (SPECULATORS_V1, SPECULATORS_ARROW, SPECFORGE)

__all__ = [
    "ALL_FORMATS",
    "EXPORT_FORMATS",
    "FOREIGN_FORMATS",
    "ForeignSample",
    "ForeignReader",
    "detect_format",
    "open_foreign",
]


def _is_hsstore(path: Path) -> bool:
    import hsstore

    try:
        hsstore.open(path)
    except (HsstoreError, OSError):
        return False
    return True


def _has(path: Path, pattern: str) -> bool:
    return next(iter(path.glob(pattern)), None) is not None


def detect_format(path: str | os.PathLike) -> str:
    """Name the format of a directory: one of ALL_FORMATS, or BadInputError if none fits."""
    p = Path(path)
    if not p.exists():
        raise BadInputError("does not exist", path=str(p))
    if not p.is_dir():
        raise BadInputError("not a directory", path=str(p))
    if _is_hsstore(p):
        return HSSTORE
    if (p / "data_config.json").exists() or _has(p, "data_*.pt"):
        return SPECULATORS_V1
    if _has(p, "data_*.ckpt") or _has(p, "data_*.ckpt.gz") or _has(p, "rows_*/data_*.ckpt*"):
        return SPECFORGE
    if (p / "hidden_states").is_dir() and (_has(p, "*.arrow") or (p / "state.json").exists()):
        return SPECULATORS_ARROW
    if _has(p, "**/data_*.pt"):
        return SPECULATORS_V1
    raise BadInputError(
        "cannot tell the format (no data_*.pt, data_*.ckpt[.gz], Arrow dataset or hsstore "
        f"manifest); pass --from with one of {', '.join(ALL_FORMATS)}",
        path=str(p),
    )


def open_foreign(
    path: str | os.PathLike,
    *,
    fmt: str | None = None,
    layer_ids: Sequence[int] | None = None,
    num_hidden_layers: int | None = None,
    hidden_states_path: str | os.PathLike | None = None,
) -> ForeignReader:
    """Open a foreign dataset read-only, detecting its format unless ``fmt`` is given."""
    fmt = fmt or detect_format(path)
    if fmt == SPECULATORS_V1:
        from hsstore.io.speculators_v1 import SpeculatorsV1Reader as reader
    elif fmt == SPECFORGE:
        from hsstore.io.specforge import SpecForgeReader as reader
    elif fmt == SPECULATORS_ARROW:
        from hsstore.io.speculators_arrow import SpeculatorsArrowReader as reader
    elif fmt == HSSTORE:
        raise BadInputError(
            "is an hsstore dataset, not a foreign format; open it with hsstore.open", path=str(path)
        )
    else:
        raise BadInputError(
            f"unknown format {fmt!r}; known: {', '.join(FOREIGN_FORMATS)}", path=str(path)
        )
    if fmt == SPECULATORS_ARROW:
        return reader(
            path,
            layer_ids=layer_ids,
            num_hidden_layers=num_hidden_layers,
            hidden_states_path=hidden_states_path,
        )
    if hidden_states_path is not None:
        raise BadInputError(
            f"--hidden-states-path applies to speculators-arrow only, not {fmt}", path=str(path)
        )
    return reader(path, layer_ids=layer_ids, num_hidden_layers=num_hidden_layers)
