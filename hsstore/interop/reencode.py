"""Re-encode an hsstore dataset into a new one: another lossy tier (or codec), same samples.

``hsstore convert SRC DST --tier NAME`` with an hsstore dataset at SRC. The new dataset keeps
the source's layers, model, tokenizer and sample ids, in storage order; its provenance names
the source dataset and its tier. Without ``--tier`` (or with ``lossless``: lose nothing more)
the source's tier is kept and its stored states are copied bit for bit. The writer turns each sample into the new tier
(`hsstore.codec.tiers.prepare`): fp8 states whose scales the tier can hold are kept bit for
bit, anything else is dequantized and quantized again, so the error bounds of the two tiers add.
Resumable like every convert: a rerun skips the samples already committed.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from typing import Any

from hsstore.codec import tiers
from hsstore.errors import BadInputError
from hsstore.interop.formats import HSSTORE
from hsstore.interop.formats.pipeline import Progress
from hsstore.storage.locations import open_storage

# Options of `convert` that re-encoding uses; any other one given is refused.
_USED = {"tier", "codec", "progress", "commit_every", "commit_bytes", "on_error", "on_problem"}
_KEEP = "keep"  # `tier` default: the source's own tier


def reencode(
    src: str | os.PathLike,
    dst: str | os.PathLike,
    *,
    make_result: Callable[[str, str, str, str], Any],
    tier: str | None = _KEEP,
    codec: str | None = None,
    progress: bool = True,
    commit_every: int = 1000,
    commit_bytes: int = 1 << 30,
    **unused: Any,
) -> Any:
    """Write every sample of the hsstore dataset ``src`` into the new dataset ``dst`` in
    ``tier`` (a name of `hsstore.codec.tiers.TIER_NAMES`; by default the source's).
    ``make_result(source, source_format, dest, dest_format)`` makes the summary it fills in
    (convert's ``ConvertResult``)."""
    import hsstore

    given = sorted(k for k, v in unused.items() if k not in _USED and v not in (None, False))
    if given:
        raise BadInputError(
            f"{', '.join(given)}: not used when re-encoding an hsstore dataset "
            "(only --tier and --codec are)",
            path=str(src),
        )
    t0 = time.perf_counter()
    source = hsstore.open(src)
    man = source.manifest
    # "lossless" loses nothing more: the source's tier, like no --tier at all.
    name = tiers.name_of(man.tier) if tier in (None, _KEEP, tiers.LOSSLESS) else tier
    dst_storage = open_storage(dst)
    result = make_result(str(source.path), HSSTORE, dst_storage.root, HSSTORE)
    provenance = {
        "created_by": "hsstore convert",
        "reencoded_from": {"dataset_id": man.dataset_id, "tier": tiers.name_of(man.tier)},
    }
    out = hsstore.create(
        dst_storage,
        layers=man.layers,
        hidden_size=man.hidden_size,
        dtype=man.dtype,
        model=man.model,
        tokenizer=man.tokenizer,
        codec=codec or man.codec,
        provenance=provenance,
        exist_ok=True,
        tier=name,
    )
    present = set(out.sample_ids)
    todo = [k for k, sid in enumerate(source.sample_ids) if sid not in present]
    result.already_present = len(source) - len(todo)
    bar = Progress(len(todo), "re-encode", progress)
    try:
        with out.writer() as w:
            pending = pending_bytes = 0
            for k in todo:
                s = source[k]
                nbytes = s.hidden.numel() * s.hidden.element_size()
                w.add(s.sample_id, s.input_ids, s.loss_mask, s.hidden, scales=s.scales)
                result.added += 1
                result.bytes_read += nbytes
                pending, pending_bytes = pending + 1, pending_bytes + nbytes
                if pending >= commit_every or pending_bytes >= commit_bytes:
                    w.commit()
                    pending = pending_bytes = 0
                bar.update(nbytes)
    finally:
        bar.close()
    out.refresh()
    result.total_samples = len(out)
    result.seconds = time.perf_counter() - t0
    return result
