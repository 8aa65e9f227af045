"""Bring foreign hidden states into hsstore, and take hsstore datasets back out as speculators v1.

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

import torch

from hsstore.errors import BadInputError, HsstoreError
from hsstore.format.conventions import SPECULATORS, ConventionError, from_canonical
from hsstore.format.store import Storage, is_url, open_storage
from hsstore.io import HSSTORE, detect_format, open_source
from hsstore.io.base import SourceItem, SourceReader, dtype_name, file_index
from hsstore.io.pipeline import Progress, default_workers, ordered_map, single_torch_thread
from hsstore.io.speculators_v1 import (
    CONFIG_FILE,
    LENGTHS_FILE,
    build_data_config,
    read_json,
    write_json,
    write_sample,
)

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
        }


# ------------------------------------------------------------------------------ into hsstore


def _manifest_value(ds: Any, name: str) -> Any:
    return getattr(ds.manifest, name, None)


def _open_or_create(
    reader: SourceReader, dst: Storage, *, model_name: str | None, codec: str | None
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
        _check_compatible(ds, reader, dst)
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
        **kwargs,
    )


def _check_compatible(ds: Any, reader: SourceReader, dst: Storage) -> None:
    """Resuming into an existing dataset only makes sense if it describes the same states."""
    problems = []
    if list(ds.layers) != list(reader.layers):
        problems.append(
            f"layers {[s.label for s in ds.layers]} vs source {[s.label for s in reader.layers]}"
        )
    h = _manifest_value(ds, "hidden_size")
    if h is not None and int(h) != reader.hidden_size:
        problems.append(f"hidden_size {h} vs source {reader.hidden_size}")
    d = _manifest_value(ds, "dtype")
    d_name = dtype_name(d) if isinstance(d, torch.dtype) else str(d).replace("torch.", "")
    if d is not None and d_name != dtype_name(reader.dtype):
        problems.append(f"dtype {d} vs source {dtype_name(reader.dtype)}")
    if problems:
        raise BadInputError(
            "destination dataset does not match the source: " + "; ".join(problems), path=dst.root
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
) -> ConvertResult:
    """Convert a foreign dataset at ``src`` into the hsstore dataset ``dst`` (created or resumed).

    ``on_error='fail'`` stops writing at the first bad file, keeps checking the rest so every
    bad file is listed, then raises ConvertFailed; samples committed before stay committed.
    ``on_error='skip'`` leaves bad files out and records them in the dataset's provenance.
    ``on_problem(name, reason)`` is called as each bad file is found.
    """
    if on_error not in ON_ERROR:
        raise ValueError(f"on_error must be one of {ON_ERROR}, got {on_error!r}")
    if commit_every < 1 or commit_bytes < 1:
        raise ValueError("commit_every and commit_bytes must be >= 1")
    t0 = time.perf_counter()
    src, dst_storage = Path(src), open_storage(dst)  # the dataset may live at a URL
    reader = open_source(src, fmt=fmt, layer_ids=layer_ids, num_hidden_layers=num_hidden_layers)
    ds = _open_or_create(reader, dst_storage, model_name=model_name, codec=codec)
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
                item: SourceItem = got
                result.bytes_read += item.nbytes
                if writing:
                    w.add(
                        item.sample_id,
                        item.input_ids,
                        item.loss_mask,
                        item.hidden,
                        source=item.name,
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
    if hasattr(ds, "refresh"):
        ds.refresh()
    result.total_samples = len(ds)
    result.seconds = time.perf_counter() - t0
    return result


def _recorded_skips(ds: Any) -> set[tuple[str, str]]:
    prov = getattr(ds.manifest, "provenance", None) or {}
    return {
        (d.get("name"), d.get("reason")) for d in prov.get("skipped", []) if isinstance(d, dict)
    }


def _reason(exc: BaseException) -> str:
    return exc.message if isinstance(exc, HsstoreError) else str(exc)


# ------------------------------------------------------------------------------ out to v1


def _model_field(model: Any, key: str) -> Any:
    if model is None:
        return None
    if isinstance(model, dict):
        return model.get(key)
    return getattr(model, key, None)


def v1_layer_ids(layers: Sequence[Any], num_hidden_layers: int, path: str) -> list[int]:
    """speculators ids for a dataset's layers, or BadInputError saying why v1 cannot hold them."""
    try:
        ids = from_canonical(SPECULATORS, layers, num_hidden_layers)
    except ConventionError as exc:
        raise BadInputError(f"cannot export to speculators v1: {exc}", path=path) from None
    if ids != sorted(set(ids)):
        raise BadInputError(
            f"cannot export to speculators v1: its files list layers in ascending order, "
            f"but this dataset stores ids {ids}",
            path=path,
        )
    if layers[-1].depth != num_hidden_layers:
        raise BadInputError(
            "cannot export to speculators v1: its trainer takes the last layer as the verifier's "
            f"final state, but this dataset's last layer is {layers[-1].label} of {num_hidden_layers}",
            path=path,
        )
    return ids


@single_torch_thread
def export_to_v1(
    src: str | os.PathLike,
    out: str | os.PathLike,
    *,
    num_hidden_layers: int | None = None,
    workers: int | None = None,
    progress: bool = True,
) -> ConvertResult:
    """Write the hsstore dataset ``src`` as a speculators v1 directory ``out``.

    Sample k in storage order becomes ``data_{k}.pt`` (so numbering is stable for a given
    dataset), written atomically; an interrupted export resumes by keeping finished files.
    ``sample_lengths.json`` and ``data_config.json`` are written last.
    """
    import hsstore

    t0 = time.perf_counter()
    out = Path(out)
    ds = hsstore.open(src)  # a path or URL
    src = ds.path
    manifest = ds.manifest
    n = num_hidden_layers or _model_field(getattr(manifest, "model", None), "num_hidden_layers")
    if not n:
        raise BadInputError(
            "the dataset does not record num_hidden_layers; pass --num-hidden-layers", path=str(src)
        )
    layers = list(ds.layers)
    ids = v1_layer_ids(layers, int(n), str(src))
    if out.exists() and not out.is_dir():
        raise BadInputError("exists and is not a directory", path=str(out))
    out.mkdir(parents=True, exist_ok=True)
    foreign = [p.name for p in out.iterdir() if not _is_v1_file(p.name)]
    if foreign:
        raise BadInputError(
            f"output directory holds files that are not speculators v1 output ({foreign[:3]}); "
            "choose an empty or new directory",
            path=str(out),
        )
    result = ConvertResult(str(src), HSSTORE, str(out), "speculators-v1")
    index = ds.index
    lengths = [int(v) for v in index.column("num_tokens").to_pylist()]
    todo = [k for k in range(len(ds)) if not (out / f"data_{k}.pt").exists()]
    result.already_present = len(ds) - len(todo)

    def export_one(k: int) -> int:
        s = ds[k]
        write_sample(out / f"data_{k}.pt", s.input_ids, s.loss_mask, s.hidden)
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
    write_json(out / LENGTHS_FILE, {str(k): t for k, t in enumerate(lengths)})
    provenance = getattr(manifest, "provenance", None) or {}
    base = provenance.get("speculators_data_config") if isinstance(provenance, dict) else None
    cfg = build_data_config(
        layer_ids=ids,
        hidden_size=int(ds.hidden_size),
        dtype=ds.dtype,
        num_samples=len(ds),
        model_name=_model_field(getattr(manifest, "model", None), "name"),
        base=base,
    )
    write_json(out / CONFIG_FILE, cfg)
    result.total_samples = len(ds)
    result.seconds = time.perf_counter() - t0
    return result


def _is_v1_file(name: str) -> bool:
    if name in (LENGTHS_FILE, CONFIG_FILE):
        return True
    if name.startswith(".data_") and name.endswith(".tmp"):  # debris of an interrupted write
        return True
    return name.endswith(".pt") and file_index(name[:-3], "data_") is not None


# ------------------------------------------------------------------------------ dispatch


def convert(
    src: str | os.PathLike,
    dst: str | os.PathLike,
    *,
    src_format: str | None = None,
    dst_format: str | None = None,
    **kwargs: Any,
) -> ConvertResult:
    """``hsstore convert``: foreign -> hsstore by default, hsstore -> speculators v1 for datasets."""
    # Foreign formats are local directories; a URL source can only be an hsstore dataset.
    src_format = src_format or (HSSTORE if is_url(src) else detect_format(src))
    if src_format == HSSTORE:
        dst_format = dst_format or "speculators-v1"
        if dst_format != "speculators-v1":
            raise BadInputError(
                f"cannot convert an hsstore dataset to {dst_format!r}", path=str(src)
            )
        allowed = {"num_hidden_layers", "workers", "progress"}
        return export_to_v1(src, dst, **{k: v for k, v in kwargs.items() if k in allowed})
    dst_format = dst_format or HSSTORE
    if dst_format != HSSTORE:
        raise BadInputError(
            f"{src_format} converts only into hsstore; convert to hsstore first, then export",
            path=str(src),
        )
    kwargs.pop("dst_format", None)
    return convert_to_hsstore(src, dst, fmt=src_format, **kwargs)


def read_lengths(path: Path) -> dict[str, int]:
    """``sample_lengths.json`` of a v1 directory (used by tests and tools)."""
    return read_json(path / LENGTHS_FILE)
