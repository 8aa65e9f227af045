"""What `Writer.add` checks of a sample before it is written: ids and names that can be stored,
states and token columns that match the dataset, per-token scales where the dtype has them.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from hsstore.codec import tiers
from hsstore.errors import BadInputError
from hsstore.spec.manifest import Manifest

# Sample ids and source names are stored as UTF-8 in every segment index; one that cannot be
# encoded would fail every commit of the writer that accepted it, so add() refuses it.
MAX_TEXT_BYTES = 4096


def text_problem(text: str) -> str | None:
    """Why ``text`` cannot be stored as a sample id or source name, or None."""
    try:
        size = len(text.encode("utf-8"))
    except UnicodeEncodeError as exc:
        return f"is not valid Unicode (lone surrogate at position {exc.start}), so not UTF-8"
    if size > MAX_TEXT_BYTES:
        return f"is {size} bytes of UTF-8, more than {MAX_TEXT_BYTES}"
    return None


def shorten(text: str) -> str:
    return repr(text) if len(text) <= 80 else repr(text[:80]) + "..."


def check_names(where: str, sample_id: Any, source: Any) -> None:
    """Refuse a sample id that is not a non-empty string that can be stored, or a source name
    that is neither None nor such a string (``where``: the dataset, named in errors)."""
    if not isinstance(sample_id, str) or not sample_id:
        raise BadInputError(
            f"sample id must be a non-empty string, got {sample_id!r}",
            path=source if isinstance(source, str) else where,
        )
    problem = text_problem(sample_id)
    if problem:
        raise BadInputError(f"sample id {shorten(sample_id)} {problem}", path=where)
    if source is not None and not isinstance(source, str):
        raise BadInputError(
            f"source must be a string or None, got {type(source).__name__}",
            path=where,
            sample_id=sample_id,
        )
    problem = text_problem(source) if source is not None else None
    if problem:
        raise BadInputError(f"source {shorten(source)} {problem}", path=where, sample_id=sample_id)


def check_sample(
    manifest: Manifest,
    where: str,
    sample_id: str,
    input_ids: Any,
    loss_mask: Any,
    hidden: Any,
    source: str | None,
) -> tuple[torch.Tensor, np.ndarray, np.ndarray]:
    """The sample's states (contiguous, on the CPU) and its token columns as stored, after
    checking them against the dataset (``where``: the dataset, named in errors unless the
    sample has a ``source``)."""
    man = manifest
    where = source or where

    def bad(msg: str) -> BadInputError:
        return BadInputError(msg, path=where, sample_id=sample_id)

    if isinstance(hidden, np.ndarray):
        hidden = torch.from_numpy(hidden)
    if not isinstance(hidden, torch.Tensor):
        raise bad(f"hidden must be a tensor, got {type(hidden).__name__}")
    if hidden.dim() != 3:
        raise bad(f"hidden must be [tokens, layers, hidden], got shape {tuple(hidden.shape)}")
    t, n_layers, h = hidden.shape
    if n_layers != man.num_layers or h != man.hidden_size:
        raise bad(
            f"hidden has {n_layers} layers x {h}, dataset stores {man.num_layers} x {man.hidden_size}"
        )
    if hidden.dtype != man.torch_dtype:
        raise bad(
            f"hidden is {hidden.dtype}, dataset stores {man.torch_dtype} (hsstore never casts silently)"
        )
    if t < 1:
        raise bad("sample has no tokens")
    hidden = hidden.detach().to("cpu").contiguous()
    ids = torch.as_tensor(input_ids).detach().cpu()
    mask = torch.as_tensor(loss_mask).detach().cpu()
    if ids.dim() != 1 or ids.shape[0] != t:
        raise bad(f"input_ids has shape {tuple(ids.shape)}, states have {t} tokens")
    if mask.dim() != 1 or mask.shape[0] != t:
        raise bad(f"loss_mask has shape {tuple(mask.shape)}, states have {t} tokens")
    if ids.dtype.is_floating_point or ids.dtype == torch.bool:
        raise bad(f"input_ids must be integers, got {ids.dtype}")
    if int(ids.min()) < 0 or int(ids.max()) >= 2**31:
        raise bad("input_ids out of range [0, 2^31)")
    if mask.dtype.is_floating_point:
        raise bad(f"loss_mask must be integer or bool, got {mask.dtype}")
    if mask.numel() and (int(mask.min()) < 0 or int(mask.max()) > 1):
        raise bad("loss_mask must hold only 0 and 1")
    return (
        hidden,
        ids.numpy().astype("<i4"),
        mask.numpy().astype("<u1"),
    )


def check_scales(
    manifest: Manifest,
    where: str,
    sample_id: str,
    scales: Any,
    num_tokens: int,
    source: str | None,
) -> np.ndarray | None:
    """The per-token scales as a float32 [T] array, or None for an unscaled dtype."""
    where = source or where
    dtype = manifest.dtype
    if not manifest.scaled:
        if scales is not None:
            raise BadInputError(
                f"scales given, but a {dtype} dataset stores no per-token scales",
                path=where,
                sample_id=sample_id,
            )
        return None
    if scales is None:
        raise BadInputError(
            f"a {dtype} dataset needs the per-token scales of each sample (scales=)",
            path=where,
            sample_id=sample_id,
        )
    if isinstance(scales, np.ndarray):
        scales = torch.from_numpy(scales)
    if not isinstance(scales, torch.Tensor):
        raise BadInputError(
            f"scales must be a tensor, got {type(scales).__name__}",
            path=where,
            sample_id=sample_id,
        )
    shape = tuple(scales.shape)
    width = tiers.scales_width(manifest.tier, manifest.num_layers)
    if (
        scales.dtype != torch.float32
        or scales.numel() != num_tokens * (width or 1)
        or (scales.dim() and shape[0] != num_tokens)
    ):
        raise BadInputError(
            f"scales are {scales.dtype} {list(shape)}, expected float32 with one per token "
            f"([{num_tokens}] or [{num_tokens}, 1, 1])",
            path=where,
            sample_id=sample_id,
        )
    flat = scales.detach().cpu().reshape(-1).contiguous()
    if not bool(torch.all(torch.isfinite(flat) & (flat > 0))):
        raise BadInputError("scales must be finite and positive", path=where, sample_id=sample_id)
    flat = flat if width is None else flat.reshape(num_tokens, width)
    return flat.numpy().astype("<f4", copy=False)
