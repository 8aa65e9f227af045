"""Readers and writers for hidden-state formats other than hsstore's own (foreign formats).

Each format lives in its own module, which describes itself in one :class:`ForeignFormat`
(name, detection, reader, writer, its own options); ``FORMATS`` lists them, and everything
else here and in ``hsstore convert`` (its ``--from``/``--to`` choices and per-format flags) is
derived from that list. Adding a format is a module plus one line below.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from hsstore.errors import BadInputError, HsstoreError, no_such_path
from hsstore.interop.formats import specforge, speculators_arrow, speculators_v1
from hsstore.interop.formats.base import (
    ForeignFormat,
    ForeignReader,
    ForeignSample,
    ForeignWriter,
    FormatOption,
)

if TYPE_CHECKING:
    from hsstore.dataset.dataset import Dataset

HSSTORE = "hsstore"

# Registration order breaks ties between formats equally sure of a folder.
FORMATS: dict[str, ForeignFormat] = {
    f.name: f
    for f in (
        speculators_v1.FOREIGN_FORMAT,
        specforge.FOREIGN_FORMAT,
        speculators_arrow.FOREIGN_FORMAT,
    )
}
SPECULATORS_V1, SPECFORGE, SPECULATORS_ARROW = (
    speculators_v1.FORMAT,
    specforge.FORMAT,
    speculators_arrow.FORMAT,
)

FOREIGN_FORMATS: tuple[str, ...] = tuple(FORMATS)
ALL_FORMATS: tuple[str, ...] = (HSSTORE, *FOREIGN_FORMATS)
# Formats an hsstore dataset can be exported to (each module's ForeignWriter).
EXPORT_FORMATS: tuple[str, ...] = tuple(n for n, f in FORMATS.items() if f.writer is not None)

__all__ = [
    "ALL_FORMATS",
    "EXPORT_FORMATS",
    "FOREIGN_FORMATS",
    "FORMATS",
    "ForeignFormat",
    "ForeignSample",
    "ForeignReader",
    "ForeignWriter",
    "FormatOption",
    "detect_format",
    "open_foreign",
    "open_writer",
    "reader_options",
    "writer_options",
]


def reader_options() -> dict[str, tuple[str, FormatOption]]:
    """Every format's reader options by name, each with the format that owns it."""
    return {o.name: (f.name, o) for f in FORMATS.values() for o in f.reader_options}


def writer_options() -> dict[str, tuple[str, FormatOption]]:
    """Every format's writer options by name, each with the format that owns it."""
    return {o.name: (f.name, o) for f in FORMATS.values() for o in f.writer_options}


def _is_hsstore(path: Path) -> bool:
    import hsstore

    try:
        hsstore.open(path)
    except (HsstoreError, OSError):
        return False
    return True


def detect_format(path: str | os.PathLike) -> str:
    """Name the format of a directory: one of ALL_FORMATS, or BadInputError if none fits."""
    p = Path(path)
    if not p.exists():
        raise no_such_path(p)
    if not p.is_dir():
        raise BadInputError("not a directory", path=str(p))
    if _is_hsstore(p):
        return HSSTORE
    scores = {name: f.detect(p) for name, f in FORMATS.items()}
    best = max(scores, key=scores.__getitem__)  # the first of the surest
    if scores[best]:
        return best
    markers = ", ".join(f.marker for f in FORMATS.values())
    raise BadInputError(
        f"cannot tell the format (no {markers} or hsstore manifest); "
        f"pass --from with one of {', '.join(ALL_FORMATS)}",
        path=str(p),
    )


def _given(options: Mapping[str, Any]) -> dict[str, Any]:
    """The options the caller set (a flag left off and a path left out are not set)."""
    return {k: v for k, v in options.items() if v is not None and v is not False}


def _own_options(
    fmt: ForeignFormat,
    owned: tuple[FormatOption, ...],
    everyone: dict[str, tuple[str, FormatOption]],
    options: Mapping[str, Any],
    path: str,
) -> dict[str, Any]:
    """The options ``fmt`` takes; one it has no use for is refused in its owner's words."""
    mine = {o.name for o in owned}
    given = _given(options)
    for name in given:
        if name in mine:
            continue
        if name not in everyone:
            raise TypeError(f"unknown format option {name!r}")
        owner, option = everyone[name]
        raise BadInputError(
            option.refusal.format(flag=option.flag, owner=owner, fmt=fmt.name), path=path
        )
    return {k: v for k, v in given.items() if k in mine}


def open_foreign(
    path: str | os.PathLike,
    *,
    fmt: str | None = None,
    layer_ids: Sequence[int] | None = None,
    num_hidden_layers: int | None = None,
    **options: Any,
) -> ForeignReader:
    """Open a foreign dataset read-only, detecting its format unless ``fmt`` is given.

    ``options`` are a format's own reader options (``FORMATS[fmt].reader_options``, e.g.
    ``hidden_states_path`` for speculators-arrow); one the format has no use for is refused.
    """
    fmt = fmt or detect_format(path)
    if fmt == HSSTORE:
        raise BadInputError(
            "is an hsstore dataset, not a foreign format; open it with hsstore.open", path=str(path)
        )
    if fmt not in FORMATS:
        raise BadInputError(
            f"unknown format {fmt!r}; known: {', '.join(FOREIGN_FORMATS)}", path=str(path)
        )
    spec = FORMATS[fmt]
    own = _own_options(spec, spec.reader_options, reader_options(), options, str(path))
    return spec.reader(path, layer_ids=layer_ids, num_hidden_layers=num_hidden_layers, **own)


def open_writer(
    fmt: str,
    ds: Dataset,
    out: Path,
    *,
    source: str,
    num_hidden_layers: int,
    **options: Any,
) -> ForeignWriter:
    """A writer exporting the hsstore dataset ``ds`` to ``out`` in the format ``fmt``.

    ``options`` are a format's own writer options (``FORMATS[fmt].writer_options``, e.g. ``fp8``
    for speculators-arrow); one the format has no use for is refused.
    """
    spec = FORMATS.get(fmt)
    if spec is None or spec.writer is None:
        raise BadInputError(
            f"cannot export an hsstore dataset to {fmt!r}; known: {', '.join(EXPORT_FORMATS)}",
            path=source,
        )
    own = _own_options(spec, spec.writer_options, writer_options(), options, source)
    return spec.writer(ds, out, source=source, num_hidden_layers=num_hidden_layers, **own)
