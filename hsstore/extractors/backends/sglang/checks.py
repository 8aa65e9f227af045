"""Checks that each SGLang request gave one full row of states per prompt token, and nothing else.

Two ways the states arrive (see :mod:`hsstore.extractors.backends.sglang.backend`): through shared-memory
slots written by hsstore's forward hook (:func:`states_from_captures`, the default), or as nested
lists in the response (:func:`rows_from_response`, the named fallback). Both refuse anything
but exactly T rows of the expected width computed in one forward with no cached prefix, and
name the sample.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from hsstore.errors import HsstoreError
from hsstore.extractors.backends.sglang.capture import Capture, SlotReader, bits
from hsstore.segment.stats import nonfinite_rows

# Why an SGLang capture may be missing.
MISSING_HINT = (
    "the forward hook did not run: a CUDA graph replayed the prefill, or the model passed no "
    "ForwardBatch to its logits processor"
)
# How long a capture whose slot was claimed may take to arrive (a GPU's asynchronous copy).
PENDING_WAIT_S = 60.0


class SGLangResponseError(HsstoreError):
    """SGLang answered, but not with one full row of hidden states per prompt token."""


def _fail(sample_id: str, msg: str) -> SGLangResponseError:
    return SGLangResponseError(f"sglang response: {msg}", sample_id=sample_id)


def _width_reason(got: int, width: int, hidden_size: int | None) -> str:
    if not hidden_size:
        return ""
    if got == width - hidden_size:
        return (
            " (the final state was not appended: the forward hook did not run, e.g. a "
            "CUDA graph replayed the prefill, or this SGLang keeps no last_hidden_states)"
        )
    if got in (hidden_size, 2 * hidden_size):
        return " (the model returned its pre-norm final state instead of the aux captures)"
    return ""


def check_meta(response: Any, *, num_tokens: int, sample_id: str, rid: str | None = None) -> dict:
    """The response's ``meta_info``, after the checks that need no states."""
    if not isinstance(response, dict) or not isinstance(response.get("meta_info"), dict):
        raise _fail(sample_id, "no meta_info")
    meta = response["meta_info"]
    finish = meta.get("finish_reason")
    if isinstance(finish, dict) and finish.get("type") == "abort":
        raise _fail(sample_id, f"request aborted: {finish.get('message', finish)}")
    if rid is not None and meta.get("id") not in (None, rid):
        raise _fail(sample_id, f"answer to request {meta.get('id')!r}, expected {rid!r}")
    if meta.get("prompt_tokens") not in (None, num_tokens):
        raise _fail(sample_id, f"prompt_tokens {meta.get('prompt_tokens')} != {num_tokens} sent")
    if meta.get("cached_tokens"):
        raise _fail(
            sample_id,
            f"{meta['cached_tokens']} prompt tokens came from the prefix cache, so their rows "
            "are missing; start the engine with disable_radix_cache=True",
        )
    return meta


def states_from_captures(
    reader: SlotReader,
    rid: str,
    *,
    num_tokens: int,
    layers: int,
    hidden_size: int,
    dtype: torch.dtype,
    sample_id: str,
    stats: dict[str, float] | None = None,
    wait_s: float = PENDING_WAIT_S,
    fail: Callable[[str, str], HsstoreError] = _fail,
    missing_hint: str = MISSING_HINT,
) -> torch.Tensor:
    """The ``[T, layers, H]`` states the hook wrote for request ``rid``, or a loud error.

    ``fail(sample_id, message)`` makes the error and ``missing_hint`` says why no capture may
    have come: the vLLM backend, whose hook writes the same slots, names its own engine.

    The tensor lies in the capture's slot, which goes back to the pool once the tensor is
    freed. ``stats`` (if given) adds up ``bytes``, the scheduler's ``write_s`` and
    ``write_cpu_s``, and this side's ``read_s`` and ``read_cpu_s`` (waiting, mapping and the
    finiteness check)."""
    t0, c0 = time.perf_counter(), time.thread_time()
    deadline = time.monotonic() + wait_s
    while reader.pending(rid):  # a GPU capture still on its way from the device
        if time.monotonic() > deadline:
            raise fail(
                sample_id,
                f"the capture of request {rid} was started but not finished within {wait_s:.0f}"
                " s (the engine's forward hook stopped while writing it)",
            )
        time.sleep(0.001)
    caps: list[Capture] = reader.captures_of(rid)
    if not caps:
        raise fail(
            sample_id,
            f"no hidden states captured for this request ({missing_hint})",
        )
    first = caps[0]
    if first.problem:
        why = ""
        if first.width == hidden_size:  # the aux width the engine gave
            why = " (the model returned its pre-norm final state instead of the aux captures)"
        raise fail(sample_id, f"{first.problem}{why}")
    if first.prefix != 0 or len(caps) > 1 or first.rows != num_tokens:
        forwards = ", ".join(f"{c.rows} rows after {c.prefix} tokens" for c in caps)
        raise fail(
            sample_id,
            f"truncated: {first.rows} rows of hidden states for {num_tokens} prompt tokens in "
            f"its first forward ({forwards}; chunked prefill or prefix caching enabled?)",
        )
    want = str(dtype).replace("torch.", "")
    if (first.layers, first.hidden, first.dtype) != (layers, hidden_size, want):
        raise fail(
            sample_id,
            f"capture of {first.layers} layers x {first.hidden} {first.dtype}, expected "
            f"{layers} x {hidden_size} {want}",
        )
    states = first.states
    assert states is not None
    if nonfinite_rows(bits(states), first.dtype):
        raise fail(sample_id, "non-finite values in hidden_states")
    if stats is not None:
        stats["bytes"] = stats.get("bytes", 0) + states.numel() * states.element_size()
        stats["write_s"] = stats.get("write_s", 0.0) + first.write_s
        stats["write_cpu_s"] = stats.get("write_cpu_s", 0.0) + first.write_cpu_s
        stats["read_s"] = stats.get("read_s", 0.0) + time.perf_counter() - t0
        stats["read_cpu_s"] = stats.get("read_cpu_s", 0.0) + time.thread_time() - c0
    return states


def rows_from_response(
    response: Any, *, num_tokens: int, width: int, sample_id: str, hidden_size: int | None = None
) -> torch.Tensor:
    """One response of the list fallback -> a float32 ``[num_tokens, width]`` tensor.

    ``meta_info["hidden_states"]`` is a list with one entry per forward the request took part
    in: the prefill entry is ``[T][width]`` nested lists; with ``max_new_tokens=1`` no decode
    entry follows, and any that do are ignored.
    """
    meta = check_meta(response, num_tokens=num_tokens, sample_id=sample_id)
    hidden = meta.get("hidden_states")
    if not isinstance(hidden, list) or not hidden:
        raise _fail(
            sample_id, "no hidden_states (engine started without return-hidden-states support?)"
        )
    try:
        rows = np.asarray(hidden[0], dtype=np.float32)
    except (ValueError, TypeError) as exc:
        raise _fail(sample_id, f"ragged or non-numeric hidden_states ({exc})") from None
    if rows.ndim != 2:
        raise _fail(
            sample_id, f"prefill hidden_states has shape {rows.shape}, expected [T, {width}]"
        )
    if rows.shape[0] != num_tokens:
        raise _fail(
            sample_id,
            f"truncated: {rows.shape[0]} rows of hidden states for {num_tokens} prompt tokens "
            "(chunked prefill or prefix caching enabled?)",
        )
    if rows.shape[1] != width:
        why = _width_reason(rows.shape[1], width, hidden_size)
        raise _fail(sample_id, f"rows have width {rows.shape[1]}, expected {width}{why}")
    if not np.isfinite(rows).all():
        raise _fail(sample_id, "non-finite values in hidden_states")
    return torch.from_numpy(rows)
