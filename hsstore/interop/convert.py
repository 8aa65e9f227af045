"""Bring foreign hidden states into hsstore, and take hsstore datasets back out to them.

Both directions stream: a pool of threads reads (and validates) a bounded window of samples
ahead while the calling thread hands them, in source order, to the writer. Memory therefore stays
at about ``2 * workers`` samples, and storage order equals source order, which is what makes a
resumed run end with exactly the dataset a clean run gives: samples already committed are
skipped by id, the rest are appended in order, and the writer commits every ``commit_every``
samples or ``commit_bytes`` of states, whichever comes first.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hsstore.codec import tiers
from hsstore.dataset.dataset import Dataset
from hsstore.errors import BadInputError, HsstoreError
from hsstore.interop.formats import (
    HSSTORE,
    SPECULATORS_V1,
    detect_format,
    open_foreign,
    open_writer,
    reader_options,
    writer_options,
)
from hsstore.interop.formats.base import ForeignReader, ForeignSample, is_temp_debris
from hsstore.interop.formats.pipeline import (
    Progress,
    default_workers,
    ordered_map,
    single_torch_thread,
)
from hsstore.interop.formats.speculators_v1 import LENGTHS_FILE, read_json
from hsstore.storage.locations import is_url, open_storage
from hsstore.storage.store import Storage

ON_ERROR = ("fail", "skip")


class ConvertFailed(BadInputError):
    """Bad input files were found with ``on_error='fail'``; ``problems`` lists every one."""

    def __init__(self, message: str, *, path: str | None, problems: list[tuple[str, str]]):
        super().__init__(message, path=path)
        self.problems = problems


@dataclass
class ConvertResult:
    """What one run did (the CLI prints it, ``--json`` emits it)."""

    source: str
    source_format: str
    dest: str
    dest_format: str
    added: int = 0
    already_present: int = 0
    skipped: list[tuple[str, str]] = field(default_factory=list)
    total_samples: int = 0
    bytes_read: int = 0
    seconds: float = 0.0
    notes: list[str] = field(default_factory=list)  # what the user must know to use the output

    def to_json(self) -> dict[str, Any]:
        return {
            "source": self.source,
            "source_format": self.source_format,
            "dest": self.dest,
            "dest_format": self.dest_format,
            "added": self.added,
            "already_present": self.already_present,
            "skipped": [{"name": n, "reason": r} for n, r in self.skipped],
            "total_samples": self.total_samples,
            "bytes": self.bytes_read,
            "seconds": round(self.seconds, 3),
            "notes": self.notes,
        }


# ------------------------------------------------------------------------------ into hsstore


def _open_or_create(
    reader: ForeignReader,
    dst: Storage,
    *,
    model_name: str | None,
    codec: str | None,
    tier: str | None = None,
):
    import hsstore

    if dst.list(""):
        try:
            ds = hsstore.open(dst)
        except HsstoreError as exc:
            raise BadInputError(
                f"destination exists and is not an hsstore dataset ({exc.message}); "
                "choose a new path or an existing dataset to resume",
                path=dst.root,
            ) from None
        _check_compatible(ds, reader, dst, tier)
        return ds
    model = dict(reader.model or {})
    if model_name:
        model["name"] = model_name
    kwargs: dict[str, Any] = {}
    if codec:
        kwargs["codec"] = codec
    return hsstore.create(
        dst,
        layers=reader.layers,
        hidden_size=reader.hidden_size,
        dtype=reader.dtype,
        model=model,
        provenance={"created_by": "hsstore convert", **reader.provenance()},
        tier=tier,
        **kwargs,
    )


def _check_compatible(
    ds: Dataset, reader: ForeignReader, dst: Storage, tier: str | None = None
) -> None:
    """Resuming into an existing dataset only makes sense if it describes the same states."""
    wanted = tiers.checked(tier)
    tiers.check_same(ds.manifest.tier, wanted, path=dst.root)  # first: it decides the dtype
    dtype = reader.dtype if wanted is None else wanted.dtype
    # The source's layer count may be inferred from its ids, so it is not compared.
    ds.manifest.check_compatible(
        reader.layers, hidden_size=reader.hidden_size, dtype=dtype, path=dst.root
    )


@single_torch_thread
def convert_to_hsstore(
    src: str | os.PathLike,
    dst: str | os.PathLike,
    *,
    fmt: str | None = None,
    layer_ids: Sequence[int] | None = None,
    num_hidden_layers: int | None = None,
    model_name: str | None = None,
    codec: str | None = None,
    workers: int | None = None,
    commit_every: int = 1000,
    commit_bytes: int = 1 << 30,
    on_error: str = "fail",
    progress: bool = True,
    on_problem: Callable[[str, str], None] | None = None,
    tier: str | None = None,
    **format_options: Any,
) -> ConvertResult:
    """Convert a foreign dataset at ``src`` into the hsstore dataset ``dst`` (created or resumed).

    ``on_error='fail'`` stops writing at the first bad file, keeps checking the rest so every
    bad file is listed, then raises ConvertFailed; samples committed before stay committed.
    ``on_error='skip'`` leaves bad files out and records them in the dataset's provenance.
    ``on_problem(name, reason)`` is called as each bad file is found. ``format_options`` are
    the source format's own reader options (``hsstore.interop.formats.FORMATS[fmt].reader_options``).
    """
    if on_error not in ON_ERROR:
        raise ValueError(f"on_error must be one of {ON_ERROR}, got {on_error!r}")
    if commit_every < 1 or commit_bytes < 1:
        raise ValueError("commit_every and commit_bytes must be >= 1")
    t0 = time.perf_counter()
    src, dst_storage = Path(src), open_storage(dst)  # the dataset may live at a URL
    reader = open_foreign(
        src,
        fmt=fmt,
        layer_ids=layer_ids,
        num_hidden_layers=num_hidden_layers,
        **format_options,
    )
    ds = _open_or_create(reader, dst_storage, model_name=model_name, codec=codec, tier=tier)
    present = set(ds.sample_ids)
    ids = reader.sample_ids()
    todo = [i for i, sid in enumerate(ids) if sid not in present]
    result = ConvertResult(str(src), reader.format, dst_storage.root, HSSTORE)
    result.already_present = len(ids) - len(todo)
    names = reader.names()
    recorded = _recorded_skips(ds)
    problems: list[tuple[str, str]] = []
    bar = Progress(len(todo), "convert", progress)
    writing = True
    try:
        with ds.writer() as w:
            pending = pending_bytes = 0
            for i, got in ordered_map(reader.read, todo, workers or default_workers()):
                if isinstance(got, BaseException):
                    name, reason = names[i], _reason(got)
                    problems.append((name, reason))
                    if on_problem:
                        on_problem(name, reason)
                    if on_error == "skip":
                        if (name, reason) not in recorded:  # a resumed run already noted it
                            w.record_skipped(name, reason)
                    elif writing:  # keep the good prefix, write nothing after a bad file
                        if pending:
                            w.commit()
                        writing = False
                    bar.update(0)
                    continue
                item: ForeignSample = got
                result.bytes_read += item.nbytes
                if writing:
                    w.add(
                        item.sample_id,
                        item.input_ids,
                        item.loss_mask,
                        item.hidden,
                        source=item.name,
                        scales=item.scales,
                    )
                    result.added += 1
                    pending += 1
                    pending_bytes += item.nbytes
                    if pending >= commit_every or pending_bytes >= commit_bytes:
                        w.commit()
                        pending = pending_bytes = 0
                bar.update(item.nbytes)
            if problems and on_error == "fail":
                raise ConvertFailed(
                    f"{len(problems)} bad input file(s); samples before the first one were "
                    "committed, nothing after it was written (fix the files and rerun to resume, "
                    "or rerun with --on-error skip to leave them out)",
                    path=str(src),
                    problems=problems,
                )
    finally:
        bar.close()
    result.skipped = problems
    ds.refresh()
    result.total_samples = len(ds)
    result.seconds = time.perf_counter() - t0
    return result


def _recorded_skips(ds: Dataset) -> set[tuple[str, str]]:
    prov = ds.manifest.provenance
    return {
        (d.get("name"), d.get("reason")) for d in prov.get("skipped", []) if isinstance(d, dict)
    }


def _reason(exc: BaseException) -> str:
    return exc.message if isinstance(exc, HsstoreError) else str(exc)


# ------------------------------------------------------------------------------ out of hsstore


@single_torch_thread
def export(
    src: str | os.PathLike,
    out: str | os.PathLike,
    *,
    dst_format: str = SPECULATORS_V1,
    num_hidden_layers: int | None = None,
    workers: int | None = None,
    progress: bool = True,
    **format_options: Any,
) -> ConvertResult:
    """Write the hsstore dataset ``src`` into the folder ``out`` in a foreign format.

    ``format_options`` are the target format's own writer options
    (``hsstore.interop.formats.FORMATS[dst_format].writer_options``, e.g. ``fp8``, ``target``).

    Sample k in storage order becomes file k (so numbering is stable for a given dataset),
    written atomically; an interrupted export resumes by keeping finished files. The
    dataset-wide files are written last.
    """
    import hsstore

    t0 = time.perf_counter()
    out = Path(out)
    ds = hsstore.open(src)  # a path or URL
    src = ds.path
    model = ds.manifest.model
    n = num_hidden_layers or (model.num_hidden_layers if model else None)
    if not n:
        raise BadInputError(
            "the dataset does not record num_hidden_layers; pass --num-hidden-layers", path=str(src)
        )
    if out.exists() and not out.is_dir():
        raise BadInputError("exists and is not a directory", path=str(out))
    writer = open_writer(
        dst_format, ds, out, source=str(src), num_hidden_layers=int(n), **format_options
    )
    out.mkdir(parents=True, exist_ok=True)
    foreign = [p.name for p in out.iterdir() if not (writer.is_own(p) or is_temp_debris(p.name))]
    if foreign:
        raise BadInputError(
            f"output directory holds files that are not {dst_format} output ({foreign[:3]}); "
            "choose an empty or new directory",
            path=str(out),
        )
    result = ConvertResult(str(src), HSSTORE, str(out), dst_format)
    todo = [k for k in range(len(ds)) if not writer.sample_path(k).exists()]
    result.already_present = len(ds) - len(todo)

    def export_one(k: int) -> int:
        s = ds[k]
        # Per-token scales only: hs-connectors' files have no per-layer ones (fp8-token-layer
        # states leave dequantized, and the writer quantizes them per token).
        if s.scales is not None and s.scales.dim() == 1 and writer.stores_fp8:
            writer.write_fp8(k, s.input_ids, s.hidden, s.scales)  # the stored bits, not requantized
        else:  # fp8 states leave dequantized, as speculators' trainer reads them
            writer.write(k, s.input_ids, s.loss_mask, s.dequantized())
        return s.hidden.numel() * s.hidden.element_size()

    bar = Progress(len(todo), "export", progress)
    try:
        for _k, got in ordered_map(export_one, todo, workers or default_workers()):
            if isinstance(got, BaseException):
                raise got
            result.added += 1
            result.bytes_read += got
            bar.update(got)
    finally:
        bar.close()
    writer.finish()
    result.notes = writer.notes()
    result.total_samples = len(ds)
    result.seconds = time.perf_counter() - t0
    return result


def export_to_v1(src: str | os.PathLike, out: str | os.PathLike, **kwargs: Any) -> ConvertResult:
    """``export`` to speculators v1 (the layout speculators 0.4-0.7 read)."""
    return export(src, out, dst_format=SPECULATORS_V1, **kwargs)


# ------------------------------------------------------------------------------ dispatch


# Options of one direction only, with the CLI flag that sets them (for the refusal message):
# the formats' own reader options are import-only too, their writer options export-only.
_IMPORT_ONLY = {
    "layer_ids": "--layer-ids",
    "model_name": "--model",
    "codec": "--codec",
    "tier": "--tier",
}


def _flags(options: dict) -> dict[str, str]:
    return {name: option.flag for name, (_owner, option) in options.items()}


# Import settings with defaults the CLI always passes; an export has no use for them.
_IMPORT_TUNING = ("commit_every", "commit_bytes", "on_error", "on_problem")


def convert(
    src: str | os.PathLike,
    dst: str | os.PathLike,
    *,
    src_format: str | None = None,
    dst_format: str | None = None,
    **kwargs: Any,
) -> ConvertResult:
    """``hsstore convert``: foreign -> hsstore by default, hsstore -> a foreign format for datasets.

    An option that means nothing in the chosen direction is refused, never silently dropped.
    """
    # Foreign formats are local directories; a URL source can only be an hsstore dataset.
    src_format = src_format or (HSSTORE if is_url(src) else detect_format(src))
    given = {k for k, v in kwargs.items() if v is not None and v is not False}
    if "tier" in given:
        tiers.checked(kwargs["tier"])
    if src_format == HSSTORE and (dst_format == HSSTORE or (not dst_format and "tier" in given)):
        from hsstore.interop.reencode import reencode

        return reencode(src, dst, make_result=ConvertResult, **kwargs)
    import_only = {**_IMPORT_ONLY, **_flags(reader_options())}
    export_only = _flags(writer_options())
    if src_format == HSSTORE:
        dst_format = dst_format or SPECULATORS_V1
        wrong = [flag for k, flag in import_only.items() if k in given]
        if kwargs.get("on_error") not in (None, "fail"):
            wrong.append(f"--on-error {kwargs['on_error']}")
        if wrong:
            raise BadInputError(
                f"{', '.join(wrong)}: only for converting into hsstore, not for exporting to "
                f"{dst_format} (an export writes every sample as stored, in the target format's "
                "own encoding, and stops at the first unreadable one)",
                path=str(src),
            )
        drop = {*import_only, *_IMPORT_TUNING}
        return export(
            src, dst, dst_format=dst_format, **{k: v for k, v in kwargs.items() if k not in drop}
        )
    dst_format = dst_format or HSSTORE
    if dst_format != HSSTORE:
        raise BadInputError(
            f"{src_format} converts only into hsstore; convert to hsstore first, then export",
            path=str(src),
        )
    wrong = [flag for k, flag in export_only.items() if k in given]
    if wrong:
        raise BadInputError(
            f"{', '.join(wrong)}: only for exporting an hsstore dataset, not for converting "
            f"{src_format} into hsstore",
            path=str(src),
        )
    kwargs = {k: v for k, v in kwargs.items() if k not in export_only}
    return convert_to_hsstore(src, dst, fmt=src_format, **kwargs)


def read_lengths(path: Path) -> dict[str, int]:
    """``sample_lengths.json`` of a v1 directory (used by tests and tools)."""
    return read_json(path / LENGTHS_FILE)
