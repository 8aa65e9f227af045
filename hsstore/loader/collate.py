"""Batch tensors: one raw layout, decoded in place, viewed as speculators' EAGLE-3 keys.

Inside the loader a batch is a handful of base tensors (``RawBatch``, internal): hidden states
``[B, T, L', H]`` with the aux layers first and the verifier layer last, and the per-token
columns ``[B, T]``. The trainer's keys are views of these (``as_eagle3``, applied once, as a
batch is handed out), so a batch crosses PCIe as one hidden-state copy and is never
re-concatenated on the host. A batch of an fp8 dataset travels in its stored form, fp8 states
plus their float32 scales ``[B, T, S]`` (half the bytes of bf16 values), until
`hsstore.loader.dequant` turns it into values where it is going.

Keys follow speculators' trainer (``speculators/train/data.py``): ``hidden_states``
``[B, T, k*H]``, ``verifier_last_hidden_states`` ``[B, T, H]``, ``input_ids``, ``loss_mask``,
``position_ids``, ``document_ids`` ``[B, T]`` and ``lengths`` ``[n]``; packed batches have
``B == 1`` and padding with document id -1 and position 0, as there.
"""

from __future__ import annotations

import contextlib
import mmap
from collections.abc import Sequence
from dataclasses import dataclass, fields

import numpy as np
import torch

from hsstore.loader.dataset_handle import LayerChoice

TOKEN_KEYS = ("input_ids", "loss_mask", "position_ids", "document_ids")
# Buffers from this size on are asked for in huge pages (`host_memory`).
_HUGE_PAGE_MIN_BYTES = 4 << 20


@dataclass
class RawBatch:
    """The base tensors of one batch (host or device)."""

    hidden: torch.Tensor  # [B, T, L', H]
    input_ids: torch.Tensor  # [B, T] int64
    loss_mask: torch.Tensor  # [B, T] int64
    position_ids: torch.Tensor  # [B, T] int64
    document_ids: torch.Tensor  # [B, T] int64, -1 on padding
    lengths: torch.Tensor  # [n] int64, tokens per sample
    sample_index: torch.Tensor  # [n] int64, storage positions
    # [B, T, S] float32 when ``hidden`` holds fp8 states: S is 1 (a scale per token) or L' (per
    # token and layer). None: ``hidden`` holds the values.
    scales: torch.Tensor | None = None

    def tensors(self) -> dict[str, torch.Tensor]:
        """The batch's tensors by field name (``scales`` only when set)."""
        return {f.name: v for f in fields(self) if (v := getattr(self, f.name)) is not None}

    def to(self, device: torch.device, non_blocking: bool = False) -> RawBatch:
        return RawBatch(
            **{k: v.to(device, non_blocking=non_blocking) for k, v in self.tensors().items()}
        )


def as_eagle3(raw: RawBatch, choice: LayerChoice) -> dict[str, torch.Tensor]:
    """The trainer's dict: views of ``raw`` (no copy)."""
    b, t, _, h = raw.hidden.shape
    k = len(choice.aux)
    out: dict[str, torch.Tensor] = {
        "input_ids": raw.input_ids,
        "hidden_states": raw.hidden[:, :, :k, :].reshape(b, t, k * h),
        "loss_mask": raw.loss_mask,
        "lengths": raw.lengths,
        "position_ids": raw.position_ids,
        "document_ids": raw.document_ids,
        "per_layer_hidden_states": raw.hidden,
        "sample_index": raw.sample_index,
    }
    if choice.verifier is not None:
        out["verifier_last_hidden_states"] = raw.hidden[:, :, k, :]
    return out


def host_memory(numel: int, dtype: torch.dtype, pin: bool, zeroed: bool) -> torch.Tensor:
    """``numel`` elements of host memory for batch states: pinned when feeding a GPU; else, if
    large, in transparent huge pages where the kernel offers them (a batch's hundreds of MB are
    written in full every batch, and on 4 KiB pages the writes miss the TLB every 4 KiB).
    ``zeroed``: written with zeros now, so that no epoch pays for first touches."""
    nbytes = numel * dtype.itemsize
    if pin or nbytes < _HUGE_PAGE_MIN_BYTES or not hasattr(mmap, "MADV_HUGEPAGE"):
        alloc = torch.zeros if zeroed else torch.empty
        return alloc(numel, dtype=dtype, pin_memory=pin)
    # Private: a forked worker gets its own copy on write, as with any other allocation.
    region = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    with contextlib.suppress(OSError):  # a hint
        region.madvise(mmap.MADV_HUGEPAGE)
    out = torch.frombuffer(region, dtype=torch.uint8).view(dtype)  # keeps ``region`` alive
    if zeroed:
        out.zero_()
    return out


class HostBuffers:
    """Host memory for one batch of at most ``capacity`` tokens, reused batch after batch.

    Allocated once (pinned when feeding a GPU: page-locked memory is what lets the copy run
    asynchronously) and touched once up front, so the hot path never faults in fresh pages.
    ``scales_width`` (fp8 states, ``dtype`` their stored dtype): room for S scales per token;
    ``values_dtype`` besides: room for the batch's values, dequantized on the host.
    """

    def __init__(
        self,
        capacity: int,
        num_layers: int,
        hidden_size: int,
        dtype: torch.dtype,
        pin: bool,
        prefault: bool = True,
        *,
        scales_width: int | None = None,
        values_dtype: torch.dtype | None = None,
    ):
        self.capacity = capacity
        self.row = num_layers * hidden_size
        self.num_layers, self.hidden_size = num_layers, hidden_size
        # prefault=False for one-shot buffers: every element is written anyway (samples and
        # padding), so zeroing would only add a pass over fresh memory.
        self.hidden = host_memory(capacity * self.row, dtype, pin, prefault)
        # Every token row of ``hidden`` from this one on is zero: padding there is already
        # written (`fill_padding`), which spares a pass over most of the padding of a batch.
        self.clean_from = 0 if prefault else capacity
        # The 4 per-token columns, then lengths and sample positions (at most one sample per
        # token), so every field of a batch lives in these two allocations.
        self.tokens = torch.zeros(len(TOKEN_KEYS) + 2, capacity, dtype=torch.int64, pin_memory=pin)
        self.scales = (
            None
            if scales_width is None
            else torch.zeros(capacity, scales_width, dtype=torch.float32, pin_memory=pin)
        )
        self.values = (
            None
            if scales_width is None or values_dtype is None
            else host_memory(capacity * self.row, values_dtype, False, prefault)
        )

    @classmethod
    def like(cls, raw: RawBatch, capacity: int, pin: bool) -> HostBuffers:
        """Buffers that hold batches of ``raw``'s form (dtype, layers, scales)."""
        _b, _t, n_layers, hidden_size = raw.hidden.shape
        width = None if raw.scales is None else raw.scales.shape[-1]
        return cls(capacity, n_layers, hidden_size, raw.hidden.dtype, pin, scales_width=width)

    def hold(self, batch: RawBatch) -> RawBatch:
        """A copy of ``batch`` (of this buffer's form) in these buffers."""
        b, t = batch.input_ids.shape
        raw = self.view(b, t, batch.lengths, batch.sample_index)
        self.clean_from = max(self.clean_from, b * t)
        for name, dst in raw.tensors().items():
            if name not in ("lengths", "sample_index"):  # copied by view
                dst.copy_(getattr(batch, name))
        return raw

    def values_view(self, b: int, t: int) -> torch.Tensor | None:
        """The front of the values buffer as ``[b, t, L', H]`` (None without one)."""
        if self.values is None:
            return None
        return self.values[: b * t * self.row].view(b, t, self.num_layers, self.hidden_size)

    def view(
        self,
        b: int,
        t: int,
        lengths: Sequence[int] | np.ndarray | torch.Tensor,
        samples: Sequence[int] | np.ndarray | torch.Tensor,
    ) -> RawBatch:
        """A RawBatch of shape [b, t] over the front of these buffers."""
        if b * t > self.capacity:
            raise ValueError(f"batch of {b}x{t} tokens exceeds buffer capacity {self.capacity}")
        hidden = self.hidden[: b * t * self.row].view(b, t, self.num_layers, self.hidden_size)
        cols = self.tokens[: len(TOKEN_KEYS), : b * t].view(len(TOKEN_KEYS), b, t)
        n = len(lengths)
        lens, index = self.tokens[len(TOKEN_KEYS), :n], self.tokens[len(TOKEN_KEYS) + 1, :n]
        lens.copy_(torch.as_tensor(lengths, dtype=torch.int64))
        index.copy_(torch.as_tensor(samples, dtype=torch.int64))
        return RawBatch(
            hidden=hidden,
            input_ids=cols[0],
            loss_mask=cols[1],
            position_ids=cols[2],
            document_ids=cols[3],
            lengths=lens,
            sample_index=index,
            scales=None if self.scales is None else self.scales[: b * t].view(b, t, -1),
        )


@dataclass(frozen=True)
class Placements:
    """Where each sample of a batch goes: its row, first token and tokens taken (one entry per
    sample, in batch order)."""

    rows: np.ndarray  # int64
    starts: np.ndarray  # int64
    takes: np.ndarray  # int64

    def __len__(self) -> int:
        return len(self.takes)

    def token_slots(self, seq_len: int) -> np.ndarray:
        """The flat ``[B * T]`` slot of every placed token, sample after sample."""
        before = np.cumsum(self.takes) - self.takes  # tokens of the samples placed earlier
        firsts = self.rows * seq_len + self.starts
        return np.repeat(firsts - before, self.takes) + np.arange(int(self.takes.sum()))


def placements(packed: bool, tokens: np.ndarray) -> Placements:
    """Packed: one row, samples back to back. Padded: one row per sample, from token 0."""
    takes = np.asarray(tokens, dtype=np.int64)
    if packed:
        rows = np.zeros_like(takes)
        starts = np.cumsum(takes) - takes
    else:
        rows = np.arange(len(takes), dtype=np.int64)
        starts = np.zeros_like(takes)
    return Placements(rows, starts, takes)


def fill_padding(
    raw: RawBatch,
    places: Placements,
    packed: bool,
    pad_token_id: int,
    clean_from: int,
    stale: list[torch.Tensor] | None = None,
) -> int:
    """Write pad values everywhere no sample lands (buffers are reused: stale data otherwise).

    ``clean_from``: the buffer's hidden states are zero from this flat ``[B * T]`` token row
    on (`HostBuffers.clean_from`), so padding there is not written again. Returns that bound
    for after this batch (its samples end before it). With a ``stale`` list, the hidden states
    still to zero are appended to it, for the caller to zero (on another thread), rather than
    zeroed here."""
    b, t = raw.input_ids.shape
    if packed:
        _pad_row(raw, 0, int(places.takes.sum()), pad_token_id, clean_from, stale)
    else:
        for row, take in enumerate(places.takes.tolist()):
            _pad_row(raw, row, take, pad_token_id, clean_from, stale)
        for row in range(len(places), b):
            _pad_row(raw, row, 0, pad_token_id, clean_from, stale)
    if clean_from > b * t:  # rows past this batch keep what an earlier, longer batch left
        return clean_from
    if packed or not len(places):
        return int(places.takes.sum()) if packed else 0
    return (len(places) - 1) * t + int(places.takes[-1])


def _pad_row(
    raw: RawBatch,
    row: int,
    start: int,
    pad_token_id: int,
    clean_from: int,
    stale: list[torch.Tensor] | None,
) -> None:
    """Pad row ``row`` from token ``start`` on (hidden states only below flat row
    ``clean_from``, or left in ``stale``)."""
    t = raw.input_ids.shape[1]
    if start >= t:
        return
    stop = min(t, clean_from - row * t)
    if stop > start:
        rows = raw.hidden[row, start:stop]
        if stale is None:
            rows.zero_()
        else:
            stale.append(rows)
    raw.input_ids[row, start:] = pad_token_id
    raw.loss_mask[row, start:] = 0
    raw.position_ids[row, start:] = 0
    raw.document_ids[row, start:] = -1
    if raw.scales is not None:  # zero states times a zero scale: padding dequantizes to zero
        raw.scales[row, start:] = 0


def write_tokens(
    raw: RawBatch,
    places: Placements,
    packed: bool,
    input_ids: torch.Tensor,
    loss_mask: torch.Tensor,
    scales: torch.Tensor | None = None,
) -> None:
    """Token columns of every placed sample at once: ``input_ids`` and ``loss_mask`` (and the
    ``scales`` [tokens, S] of a batch in stored form) hold the taken tokens of the samples back
    to back, in batch order. Document ids number the samples of a row (packed rows hold
    many)."""
    takes = places.takes
    total = int(takes.sum())
    before = np.cumsum(takes) - takes
    positions = torch.from_numpy(np.arange(total) - np.repeat(before, takes))
    docs = torch.from_numpy(
        np.repeat(np.arange(len(takes)) if packed else np.zeros_like(takes), takes)
    )
    columns = ((raw.input_ids, input_ids), (raw.loss_mask, loss_mask),
               (raw.position_ids, positions), (raw.document_ids, docs))  # fmt: skip
    if scales is not None:
        assert raw.scales is not None, "scales for a batch without room for them"
        columns += ((raw.scales, scales),)
    if packed:  # the samples fill the front of row 0
        for dst, src in columns:
            dst[0, :total] = src
        return
    slots = torch.from_numpy(places.token_slots(raw.input_ids.shape[1]))
    for dst, src in columns:
        dst.flatten(0, 1).index_copy_(0, slots, src)


# --- collation of per-sample dicts (map-style dataset + any DataLoader) -------------------------

SAMPLE_KEYS = (
    "hidden_states",
    "input_ids",
    "verifier_last_hidden_states",
    "loss_mask",
    "position_ids",
)


def pack_collate(max_tokens: int, pad_token_id: int = 0):
    """A ``collate_fn`` packing per-sample dicts into ``[1, max_tokens]`` like speculators'.

    Samples are concatenated in the given order; tokens past ``max_tokens`` are cut off
    (speculators' behaviour; plan batches with :func:`hsstore.loader.batching.plan_packed`
    so that never happens).
    """

    def collate(batch: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
        keys = [k for k in SAMPLE_KEYS if k in batch[0]]
        out: dict[str, torch.Tensor] = {}
        for key in keys:
            cat = torch.cat([s[key] for s in batch], dim=0)[:max_tokens]
            pad_value = pad_token_id if key == "input_ids" else 0
            padded = cat.new_full((max_tokens, *cat.shape[1:]), pad_value)
            padded[: cat.shape[0]] = cat
            out[key] = padded.unsqueeze(0)
        lengths, used = [], 0
        for s in batch:
            n = min(int(s["input_ids"].shape[0]), max_tokens - used)
            if n <= 0:
                break
            lengths.append(n)
            used += n
        out["lengths"] = torch.tensor(lengths, dtype=torch.int64)
        docs = torch.full((max_tokens,), -1, dtype=torch.int64)
        docs[:used] = torch.repeat_interleave(torch.arange(len(lengths)), out["lengths"])
        out["document_ids"] = docs.unsqueeze(0)
        return out

    return collate


def pad_collate(pad_token_id: int = 0, pad_to_multiple_of: int = 1):
    """A ``collate_fn`` stacking per-sample dicts into ``[B, T]``, padded to the longest."""

    def collate(batch: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
        longest = max(int(s["input_ids"].shape[0]) for s in batch)
        t = -(-longest // pad_to_multiple_of) * pad_to_multiple_of
        keys = [k for k in SAMPLE_KEYS if k in batch[0]]
        out: dict[str, torch.Tensor] = {}
        for key in keys:
            first = batch[0][key]
            pad_value = pad_token_id if key == "input_ids" else 0
            stacked = first.new_full((len(batch), t, *first.shape[1:]), pad_value)
            for row, s in enumerate(batch):
                stacked[row, : s[key].shape[0]] = s[key]
            out[key] = stacked
        lengths = torch.tensor([int(s["input_ids"].shape[0]) for s in batch], dtype=torch.int64)
        out["lengths"] = lengths
        out["document_ids"] = torch.where(torch.arange(t)[None, :] < lengths[:, None], 0, -1)
        return out

    return collate
