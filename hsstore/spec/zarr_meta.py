"""Zarr v3 metadata (``zarr.json``) for the groups and arrays of a dataset.

hsstore writes these documents itself so that the data stays standard Zarr v3 (zarr-python or
any other v3 reader opens every segment), while the hot paths never go through zarr-python. The bytes of the data files these
documents describe are `hsstore.spec.segment_layout`.
"""

from __future__ import annotations

import json
from typing import Any

import numpy as np

from hsstore.codec.codecs import CodecConfig
from hsstore.spec.layout import Layout


def group_json(attributes: dict[str, Any] | None = None) -> bytes:
    doc = {"zarr_format": 3, "node_type": "group", "attributes": attributes or {}}
    return json.dumps(doc, indent=1).encode()


def states_array_json(
    *,
    num_rows: int,
    num_layers: int,
    hidden_size: int,
    storage_dtype: np.dtype,
    logical_dtype: str,
    layout: Layout,
    codec: CodecConfig,
) -> bytes:
    itemsize = storage_dtype.itemsize
    doc = {
        "zarr_format": 3,
        "node_type": "array",
        "shape": [num_rows, num_layers, hidden_size],
        "data_type": _zarr_dtype(storage_dtype),
        "chunk_grid": {
            "name": "regular",
            "configuration": {"chunk_shape": [layout.rows_per_shard, num_layers, hidden_size]},
        },
        "chunk_key_encoding": {"name": "default", "configuration": {"separator": "/"}},
        "fill_value": 0,
        "codecs": [
            {
                "name": "sharding_indexed",
                "configuration": {
                    "chunk_shape": [layout.rows_per_chunk, layout.layers_per_chunk, hidden_size],
                    "codecs": codec.zarr_codecs(itemsize),
                    "index_codecs": [
                        {"name": "bytes", "configuration": {"endian": "little"}},
                        {"name": "crc32c"},
                    ],
                    "index_location": "end",
                },
            }
        ],
        "attributes": {"hsstore": {"logical_dtype": logical_dtype}},
        "dimension_names": ["token", "layer", "hidden"],
    }
    return json.dumps(doc, indent=1).encode()


def column_array_json(
    *, num_rows: int, dtype: np.dtype, zstd_level: int, width: int | None = None
) -> bytes:
    """A per-token column stored as a single zstd-compressed chunk; with ``width`` values per
    row (the per-layer scales of the fp8-token-layer tier) it holds ``num_rows * width``
    values, row after row: flat, so its one chunk keeps the key ``c/0`` of every column."""
    shape = [num_rows if width is None else num_rows * width]
    doc = {
        "zarr_format": 3,
        "node_type": "array",
        "shape": shape,
        "data_type": _zarr_dtype(dtype),
        "chunk_grid": {"name": "regular", "configuration": {"chunk_shape": shape}},
        "chunk_key_encoding": {"name": "default", "configuration": {"separator": "/"}},
        "fill_value": 0,
        "codecs": [
            {"name": "bytes"}
            if dtype.itemsize == 1
            else {"name": "bytes", "configuration": {"endian": "little"}},
            {"name": "zstd", "configuration": {"level": zstd_level, "checksum": False}},
            {"name": "crc32c"},
        ],
        "attributes": {},
        "dimension_names": ["token" if width is None else "token_layer"],
    }
    return json.dumps(doc, indent=1).encode()


def _zarr_dtype(dtype: np.dtype) -> str:
    return {"u2": "uint16", "f2": "float16", "f4": "float32", "i4": "int32", "i8": "int64",
            "u1": "uint8"}[dtype.str[1:]]  # fmt: skip
