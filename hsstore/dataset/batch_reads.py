"""Whole samples read into the rows of one batch, their checksums verified apart: the loader's
way into a dataset (`hsstore.loader.dataset_handle.DatasetSource`), not part of the public
`Dataset` API (docs/API.md), which reads a sample at a time.

The same bytes and checks as `Dataset.read_hidden_into` per sample, the checks of the batch's
buffer done once. A loader that runs a checker thread leaves each sample checksum to it
(``unchecked``, then `check_decoded`), and one that runs a pipeline has the reads planned here
and done on its own thread (``runs_to``).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable, Sequence

import numpy as np
import torch

from hsstore.dataset.dataset import Dataset
from hsstore.dataset.sample_checks import check_samples
from hsstore.errors import BadInputError
from hsstore.segment.rows import PlannedRead, RawSamplesRead
from hsstore.spec.dtypes import storage_view


def read_hidden_many_into(
    ds: Dataset,
    out: torch.Tensor,
    placed: Iterable[tuple[int, int]],
    *,
    layers: Sequence[int] | None = None,
    unchecked: list[tuple[int, int]] | None = None,
    runs_to: Callable[[PlannedRead], None] | None = None,
) -> int:
    """Decode whole samples of ``ds`` into the token rows of ``out`` ([R, len(layers), H],
    contiguous CPU, the dataset's dtype, or for an fp8 dataset the dtype its values dequantize
    to): for every ``(i, row)`` drawn from ``placed``, sample ``i`` lands in
    ``out[row : row + T_i]``. Returns how many samples were read.

    Each sample decodes on the calling thread (the loader runs its own threads). All layers of
    uncompressed segments whose checksums are left to the caller (or not verified) are read a
    few MiB of samples at a time (`RawSamplesRead`). ``placed`` is drawn a pair at a time, as
    each is planned, so threads drawing from one shared queue split a batch between them. With
    an ``unchecked`` list, sample checksums are left to `check_decoded`, ``(position, row)``
    appended for each; with ``runs_to``, compressed chunks and uncompressed samples are handed
    to it to be read (and decoded) there (`hsstore.segment.row_reads.HandedOff`,
    `RawSamplesRead.flush`)."""
    layer_list = ds._check_layers(layers)
    values = ds._check_out(out, layer_list, None, values_ok=True)
    np_out = None if values else storage_view(out)
    defer = unchecked is not None and not values and ds.verify_reads and layer_list is None
    raw = None  # checked later or never: then a few MiB at a time, else hashed as they land
    if np_out is not None and layer_list is None and (defer or not ds.verify_reads):
        read_one = functools.partial(_read_alone, ds, np_out)
        raw = RawSamplesRead(ds.storage, np_out, read_one, runs_to)
    index = ds._index
    done = 0
    for i, first in placed:
        i = index.position(i)
        n = int(index.len[i])
        if not 0 <= first <= out.shape[0] - n:  # a slice would silently shrink
            raise BadInputError(
                f"sample {i} ({n} tokens) at row {first} overruns out ({out.shape[0]} rows)",
                path=str(ds.path),
            )
        if defer:
            unchecked.append((i, first))  # type: ignore[union-attr]
        reader = ds.segment_reader(index.segment[i])
        if raw is not None and reader.raw_rows:
            row = int(index.row[i])
            if raw.add(reader, row, row + n, i, first):
                raw = raw.flush()
        elif np_out is None:
            ds._read_into(i, layer_list, out[first : first + n], values)
        else:
            ds._decode(i, layer_list, np_out[first : first + n], deferred=defer, runs_to=runs_to,
                       stream=True)  # fmt: skip
        done += 1
    if raw is not None:
        raw.flush()
    return done


def _read_alone(ds: Dataset, np_out: np.ndarray, i: int, first: int) -> None:
    """Sample ``i`` read alone into ``np_out[first:]``, its checksum left to the caller."""
    ds._decode(i, None, np_out[first : first + int(ds._index.len[i])], deferred=True)


def check_decoded(ds: Dataset, out: torch.Tensor, unchecked: Iterable[tuple[int, int]]) -> None:
    """Verify the sample checksums that `read_hidden_many_into` left to the caller: sample
    ``i`` decoded into ``out[row:]`` for each ``(i, row)`` of ``unchecked``."""
    check_samples(storage_view(out), unchecked, ds._index, ds._readers, ds.sample_ids)
