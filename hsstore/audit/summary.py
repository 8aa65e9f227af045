"""The summary block of an audit: what the dataset is and what it costs, before any verdict."""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from hsstore.audit.collect import SampleRecord
from hsstore.audit.inputs import AuditSource

_ITEMSIZE = {"bfloat16": 2, "float16": 2, "float32": 4, "float8_e4m3fn": 1}


def length_distribution(lengths: np.ndarray, scope: str) -> dict[str, Any]:
    if len(lengths) == 0:
        return {"scope": scope, "min": None, "median": None, "p99": None, "max": None}
    return {
        "scope": scope,
        "min": int(lengths.min()),
        "median": float(np.median(lengths)),
        "p99": float(np.percentile(lengths, 99)),
        "max": int(lengths.max()),
    }


def layer_entries(src: AuditSource) -> list[dict[str, Any]]:
    return [
        {
            "index": i,
            "depth": s.depth,
            "final_norm": s.final_norm,
            "label": s.label,
            "source_convention": s.source_convention,
            "source_id": s.source_id,
        }
        for i, s in enumerate(src.layers)
    ]


def build_summary(
    src: AuditSource, records: list[SampleRecord], *, read_all: bool
) -> dict[str, Any]:
    """Summary numbers; exact from the index when there is one, else from the samples read."""
    n = len(src)
    lengths = src.lengths()
    loss = src.loss_tokens()
    ok = [r for r in records if r.error is None]
    if lengths is not None:
        tokens_exact, dist = True, length_distribution(np.asarray(lengths), "all")
        tokens = int(np.sum(lengths))
    else:
        seen = np.array([r.num_rows for r in ok], dtype=np.int64)
        tokens_exact = read_all and len(ok) == n
        dist = length_distribution(seen, "all" if tokens_exact else "read")
        tokens = (
            int(seen.sum()) if tokens_exact else int(round(seen.mean() * n)) if len(seen) else 0
        )
    if loss is not None and lengths is not None:
        loss_fraction = float(np.sum(loss)) / tokens if tokens else math.nan
        loss_scope = "all"
    else:
        seen_tok = sum(r.num_rows or 0 for r in ok)
        loss_fraction = sum(r.loss_tokens or 0 for r in ok) / seen_tok if seen_tok else math.nan
        loss_scope = "all" if tokens_exact else "read"
    raw = tokens * len(src.layers) * src.hidden_size * _ITEMSIZE.get(src.dtype, 2)
    disk = src.bytes_on_disk()
    return {
        "path": str(src.path),
        "format": src.kind,
        "format_version": src.format_version,
        "version": src.version,
        "model": src.model,
        "hidden_size": src.hidden_size,
        "dtype": src.dtype,
        "codec": src.codec,
        "layers": layer_entries(src),
        "samples": n,
        "tokens": tokens,
        "tokens_exact": tokens_exact,
        "lengths": dist,
        "loss_token_fraction": loss_fraction,
        "loss_token_scope": loss_scope,
        "bytes_on_disk": disk,
        "raw_bytes": raw,
        "compression_ratio": raw / disk if disk else None,
        "extraction": src.extraction,
    }
