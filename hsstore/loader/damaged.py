"""Training on past damaged samples (``skip_damaged=True``): find them, name them, blank them.

A sample fails its checks when its bytes no longer match their checksum or its chunk no longer
decodes (`IntegrityError`). By default the Loader stops there, with an error that says how to
go on. With ``skip_damaged`` it reads each sample of the failed batch on its own to tell which
are damaged (a chunk may hold several samples; a worker process's error arrives without the
sample it names), warns about each one once and then decodes the batch again without them.

A damaged sample is *blanked*, not replaced: it keeps its place, tokens and document in its
batch, with zero hidden states and a zero loss mask, so it weighs nothing in the loss. The plan
never changes, so every rank runs the same number of batches of the same shapes (a rank that
skipped a batch would leave the others waiting in an all-reduce), and the batches after it are
exactly those of a run without the damage. The samples found so far travel in the loader's
``state_dict`` (``"skipped"``), so a resumed run blanks them from its first batch and counts on
from there.
"""

from __future__ import annotations

import logging
import warnings
from collections.abc import Iterable

import numpy as np
import torch

from hsstore.dataset.segment_set import left_out_line
from hsstore.errors import IntegrityError
from hsstore.loader.collate import Placements, RawBatch
from hsstore.loader.dataset_handle import DatasetSource

log = logging.getLogger("hsstore.loader")

OPTION = "skip_damaged=True"


def repair_hint(path: str | None) -> str:
    """How to be rid of damaged samples for good."""
    where = path if path is not None else "DATASET"
    return f"`hsstore repair {where}` drops damaged samples for good"


def stop_hint(path: str | None) -> str:
    """What to do when damage stops a training run, said once for the Loader and the trainer."""
    return (
        f"{repair_hint(path)}, or pass {OPTION} to the Loader (--skip-damaged to the trainer) "
        "to train without them"
    )


def stopped_by(exc: IntegrityError, path: str | None) -> IntegrityError:
    """The error a Loader without ``skip_damaged`` raises for ``exc``: the same, plus what to
    do about it."""
    return IntegrityError(f"{exc.message}; {stop_hint(path)}", path=exc.path,
                          sample_id=exc.sample_id)  # fmt: skip


def refuse_left_out(source: DatasetSource, skip: bool) -> int:
    """How many committed samples the dataset's view leaves out (segments whose index cannot
    be read); without ``skip`` any is refused: a run would silently train on part of the data."""
    ds = source.ds
    line = left_out_line(ds)
    if line is None:
        return 0
    if not skip:
        raise IntegrityError(
            f"{line}, or pass {OPTION} to the Loader (--skip-damaged to the trainer) to train "
            f"on the other samples",
            path=ds.path,
        )
    log.warning("training on the other samples: %s", line)
    return sum(s.num_samples for s in ds.manifest.segments if s.id in ds.unreadable)


class DamagedSamples:
    """The samples a Loader found damaged, in the order found (their storage positions, and
    their ids for the loader's state)."""

    def __init__(self) -> None:
        self.ids: list[str] = []
        self.positions: frozenset[int] = frozenset()

    def __len__(self) -> int:
        return len(self.ids)

    def find(
        self, source: DatasetSource, layers: list[int], candidates: Iterable[int]
    ) -> list[str]:
        """Read each candidate position on its own, as the loader reads it (its ``layers``,
        with the source's checks: some layers of a sample are checked by their chunks', all of
        them by the sample's checksum), and add those that fail; warn and log each. Returns
        the ids found (none: the error was not about these samples)."""
        found: dict[int, str] = {}
        ds = source.ds
        for i in sorted(set(int(c) for c in candidates) - self.positions):
            out = torch.empty(int(source.num_tokens[i]), len(layers), source.hidden_size,
                              dtype=source.dtype)  # fmt: skip
            try:
                source.read_hidden_into(i, out, layers)
            except IntegrityError as exc:
                found[i] = exc.message
        for i, why in found.items():
            sid = ds.sample_ids[i]
            self.ids.append(sid)
            message = (
                f"{source.path}: sample {sid!r} is damaged ({why}); the loader leaves it out "
                f"of its batch (zero states, loss_mask 0) and goes on; {repair_hint(source.path)}"
            )
            warnings.warn(message, RuntimeWarning, stacklevel=2)
            log.warning(message)
        self.positions = self.positions | found.keys()
        return [ds.sample_ids[i] for i in found]

    def restore(self, source: DatasetSource, ids: Iterable[str]) -> None:
        """Take the samples a saved state had found (ids the dataset no longer holds drop)."""
        ds = source.ds
        self.ids, positions = [], set()
        for sid in ids:
            try:
                positions.add(ds.position(sid))
            except KeyError:
                continue
            self.ids.append(sid)
        self.positions = frozenset(positions)


def blank(raw: RawBatch, places: Placements, samples: np.ndarray, skip: frozenset[int]) -> None:
    """Zero the states, scales and loss mask of the ``skip`` samples placed in ``raw`` (their
    rows hold whatever an earlier batch left in a reused buffer)."""
    b, t = raw.input_ids.shape
    hidden = raw.hidden.view(b * t, *raw.hidden.shape[2:])
    masks = raw.loss_mask.view(b * t)
    scales = None if raw.scales is None else raw.scales.view(b * t, -1)
    for k in np.flatnonzero(np.isin(samples, np.fromiter(skip, np.int64, len(skip)))).tolist():
        first = int(places.rows[k]) * t + int(places.starts[k])
        rows = slice(first, first + int(places.takes[k]))
        hidden[rows] = 0
        masks[rows] = 0
        if scales is not None:
            scales[rows] = 0
