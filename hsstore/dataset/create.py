"""Making a new dataset: its first manifest and the Zarr groups around its segments."""

from __future__ import annotations

import contextlib
import os
import uuid
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from hsstore.codec import tiers
from hsstore.codec.codecs import DEFAULT_CODEC, CodecConfig
from hsstore.commits import commit
from hsstore.dataset.dataset import Dataset
from hsstore.errors import BadInputError, ConflictError, StorageError
from hsstore.spec import paths, zarr_meta
from hsstore.spec.dtypes import DTYPES, columns_for, dtype_name
from hsstore.spec.layers import MAX_DEPTH, LayerSpec, check_layer_list
from hsstore.spec.layout import Layout
from hsstore.spec.manifest import Manifest, ModelInfo, now_iso
from hsstore.storage.locations import nesting_problem, open_storage
from hsstore.storage.store import Storage

# The widest released models are ~25k wide; a hidden size past this is an error, refused before
# it sizes chunks and buffers.
MAX_HIDDEN_SIZE = 1 << 20


def create(
    path: str | os.PathLike[str] | Storage,
    *,
    layers: Sequence[LayerSpec | Mapping[str, Any]],
    hidden_size: int,
    dtype: torch.dtype | str,
    model: ModelInfo | Mapping[str, Any] | None = None,
    tokenizer: Mapping[str, Any] | None = None,
    codec: str | CodecConfig = DEFAULT_CODEC,
    layers_per_chunk: int | None = None,
    chunk_bytes: int | None = None,
    shard_bytes: int = 64 << 20,
    sample_aligned: bool | None = None,
    provenance: Mapping[str, Any] | None = None,
    exist_ok: bool = False,
    tier: str | None = None,
) -> Dataset:
    """Make an empty dataset (version 1). With ``exist_ok``, open a compatible existing one.

    ``tier`` (default lossless) picks a lossy tier (`hsstore.codec.tiers`): the writer then
    takes states of any float dtype and stores them in the tier's dtype (``dtype`` is not used).

    ``sample_aligned`` (default: whenever the codec compresses) starts every sample at a chunk
    boundary, so a random read decodes only its own rows; chunks are ~``chunk_bytes`` (default
    1 MiB), at most 32 rows when aligned (see `Layout.choose`).

    ``path`` is a local path or a URL (``s3://bucket/prefix``, ``gs://``, ``az://``,
    ``file://``); see docs/STORAGE.md.
    """
    if isinstance(hidden_size, bool) or not isinstance(hidden_size, int):
        raise BadInputError(f"hidden_size must be an integer, got {hidden_size!r}", path=str(path))
    if not 1 <= hidden_size <= MAX_HIDDEN_SIZE:
        raise BadInputError(
            f"hidden_size must be in 1..{MAX_HIDDEN_SIZE}, got {hidden_size}", path=str(path)
        )
    try:
        specs = tuple(
            x if isinstance(x, LayerSpec) else LayerSpec.from_json(dict(x)) for x in layers
        )
    except (ValueError, TypeError, KeyError) as exc:
        raise BadInputError(f"bad layer spec: {exc}", path=str(path)) from None
    try:
        tier_record = tiers.parse(tier)
    except ValueError as exc:
        raise BadInputError(str(exc), path=str(path)) from None
    name = dtype_name(dtype) if tier_record is None else tier_record.dtype
    codec_cfg = codec if isinstance(codec, CodecConfig) else CodecConfig(name=codec)
    model_info = model if isinstance(model, ModelInfo) else ModelInfo.from_json(dict(model or {}))
    n_layers = model_info.num_hidden_layers
    if n_layers is not None and (
        isinstance(n_layers, bool)
        or not isinstance(n_layers, int)
        or not 1 <= n_layers <= MAX_DEPTH
    ):
        raise BadInputError(
            f"model num_hidden_layers must be an integer in 1..{MAX_DEPTH}, got {n_layers!r}",
            path=str(path),
        )
    try:
        check_layer_list(specs, n_layers)
    except ValueError as exc:
        raise BadInputError(str(exc), path=str(path)) from None
    if model_info.hidden_size is not None and model_info.hidden_size != hidden_size:
        raise BadInputError(
            f"model hidden_size {model_info.hidden_size} != hidden_size {hidden_size}",
            path=str(path),
        )
    layout = Layout.choose(
        num_layers=len(specs),
        hidden_size=hidden_size,
        itemsize=DTYPES[name][1].itemsize,
        layers_per_chunk=tiers.layers_per_chunk(tier_record, layers_per_chunk),
        chunk_bytes=chunk_bytes,
        shard_bytes=shard_bytes,
        sample_aligned=codec_cfg.compressed if sample_aligned is None else sample_aligned,
    )
    now = now_iso()
    man = Manifest(
        version=1,
        dataset_id=uuid.uuid4().hex,
        created_at=now,
        committed_at=now,
        model=model_info,
        tokenizer=dict(tokenizer) if tokenizer is not None else None,
        hidden_size=hidden_size,
        dtype=name,
        layers=specs,
        codec=codec_cfg,
        layout=layout,
        provenance=dict(provenance or {}),
        columns=columns_for(name),
        tier=tier_record,
    )
    storage = open_storage(path)
    data = man.to_bytes()
    if commit.list_versions(storage):
        if not exist_ok:
            raise ConflictError("a dataset already exists here", path=storage.root)
        return _open_compatible(storage, man)
    nested = nesting_problem(storage)
    if nested:
        raise BadInputError(nested, path=storage.root)
    for key, doc in (
        (
            paths.ROOT_ZARR_JSON,
            zarr_meta.group_json({"hsstore": {"format_version": man.format_version}}),
        ),
        (paths.SEGMENTS_ZARR_JSON, zarr_meta.group_json()),
    ):
        storage.put_if_absent(key, doc)
    if not storage.put_if_absent(paths.manifest_key(1), data):
        if not exist_ok:
            raise ConflictError("a dataset already exists here", path=storage.root)
        return _open_compatible(storage, man)
    # A second copy of the dataset's description (a checkpoint of version 1), so losing
    # version 1's file never leaves the layers and layout unknown; redundant, so best effort.
    with contextlib.suppress(StorageError, OSError):
        commit.write_checkpoint(storage, man)
    return Dataset(storage)


def _open_compatible(storage: Storage, wanted: Manifest) -> Dataset:
    ds = Dataset(storage)
    tiers.check_same(ds.manifest.tier, wanted.tier, path=storage.root)  # first: it sets dtype
    ds.manifest.check_compatible(
        wanted.layers,
        hidden_size=wanted.hidden_size,
        dtype=wanted.dtype,
        num_hidden_layers=wanted.model.num_hidden_layers,
        path=storage.root,
    )
    return ds
