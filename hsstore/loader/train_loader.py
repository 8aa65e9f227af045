"""``Loader``: the one object a training loop needs (plan, decode threads, GPU prefetch, state).

It composes the pieces: the rank's epoch plan (``stream._Planned``), decoding into a ring of
reusable (pinned, with CUDA) host buffers by a thread pool (``fetch.BatchFetcher``) or by
DataLoader worker processes, and the side-stream copy to the device
(``prefetch.DevicePrefetcher``). It counts the batches it has handed to the caller, so
``state_dict()`` is exact whatever was prefetched.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch
from torch.utils.data import DataLoader

from hsstore.loader.collate import HostBuffers, RawBatch, as_eagle3
from hsstore.loader.fetch import BatchFetcher
from hsstore.loader.prefetch import DevicePrefetcher, resolve_device
from hsstore.loader.stream import HiddenStateStream, _Planned


class Loader(_Planned):
    """Batches of an hsstore dataset for this rank, on ``device`` (or the CPU).

    See docs/LOADER.md for the options and the batch keys. On the CPU a yielded batch is valid
    until the next one is requested (its buffers are reused); on a GPU every batch is a fresh
    device allocation and stays valid.
    """

    def __init__(
        self,
        dataset: Any,
        *,
        device: str | torch.device | None = None,
        num_threads: int = 4,
        prefetch: int = 2,
        workers: int = 0,
        **options: Any,
    ):
        super().__init__(dataset, **options)
        self.device = resolve_device(device)
        self.num_threads, self.prefetch, self.workers = num_threads, prefetch, workers
        self._ring: list[HostBuffers] | None = None  # allocated on first use, kept for good
        self._active: Any = None

    def state_dict(self) -> dict[str, Any]:
        """``{"version", "epoch", "step", "seed", "fingerprint"}``: batches delivered so far."""
        return self._base_state()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue with exactly the batches the saving run had not delivered yet."""
        self._check_state(state)
        self.epoch, self.step = int(state["epoch"]), int(state["step"])

    def _host_batches(self) -> Iterator[RawBatch]:
        pin = self.device is not None and self.device.type == "cuda"  # page-locked for async H2D
        if self.workers == 0:
            plan, start = self.plan(), self.step
            if self._ring is None:
                self._ring = BatchFetcher.make_ring(
                    self.source, self.choice, self.shape, self.prefetch, pin
                )
            return BatchFetcher(
                self.source,
                self.choice,
                self.shape,
                (plan.batch(j) for j in range(start, len(plan))),
                num_threads=self.num_threads,
                prefetch=self.prefetch,
                reuse_buffers=True,
                pin_memory=pin,
                ring=self._ring,
            )
        return _WorkerBatches(self, pin)

    def __iter__(self) -> Iterator[dict[str, torch.Tensor]]:
        if self._active is not None:  # an abandoned iterator must release the shared ring
            self._active.close()
        host = self._host_batches()
        batches: Any = host if self.device is None else DevicePrefetcher(host, self.device)
        self._active = batches
        try:
            for raw in batches:
                self.step += 1
                yield as_eagle3(raw, self.choice)
        finally:
            batches.close()
            if self._active is batches:
                self._active = None
        if self.step >= len(self.plan()):  # the whole epoch was delivered (not cut short)
            self.epoch, self.step = self.epoch + 1, 0


class _WorkerBatches:
    """Host batches decoded by DataLoader worker processes, copied into a reusable ring.

    Batches from workers arrive in fresh shared-memory tensors; copying them into pinned
    buffers we own is what lets the device copy run asynchronously without pinning a fresh
    tensor per batch.
    """

    def __init__(self, loader: Loader, pin: bool):
        stream = HiddenStateStream(
            loader.source,
            num_threads=max(1, loader.num_threads // max(1, loader.workers)),
            prefetch=loader.prefetch,
            reuse_buffers=False,
            **_options(loader),
        )
        stream.load_state_dict(loader.state_dict())
        self._dl = iter(
            DataLoader(
                stream,
                batch_size=None,
                num_workers=loader.workers,
                prefetch_factor=loader.prefetch,
                persistent_workers=False,
            )
        )
        self._ring = [
            HostBuffers(
                loader.shape.capacity,
                len(loader.choice.read),
                loader.source.hidden_size,
                loader.source.dtype,
                pin,
            )
            for _ in range(2)
        ]
        self._next = 0

    def __iter__(self) -> _WorkerBatches:
        return self

    def __next__(self) -> RawBatch:
        batch = next(self._dl)
        hidden = batch["per_layer_hidden_states"]
        b, t = batch["input_ids"].shape
        buf = self._ring[self._next]
        self._next = (self._next + 1) % len(self._ring)
        raw = buf.view(b, t, batch["lengths"], batch["sample_index"])
        raw.hidden.copy_(hidden)
        for key in ("input_ids", "loss_mask", "position_ids", "document_ids"):
            getattr(raw, key).copy_(batch[key])
        return raw

    def close(self) -> None:
        shutdown = getattr(self._dl, "_shutdown_workers", None)
        if shutdown is not None:
            shutdown()


def _options(loader: Loader) -> dict[str, Any]:
    cfg = loader.config
    return {
        "max_tokens": cfg.max_tokens,
        "batch_size": cfg.batch_size,
        "pad_to_multiple_of": cfg.pad_to_multiple_of,
        "open_bins": cfg.open_bins,
        "shuffle": cfg.shuffle,
        "seed": cfg.seed,
        "block_size": cfg.block_size,
        "window": cfg.window,
        "over_long": cfg.over_long,
        "tail": cfg.tail,
        "aux_layers": list(loader.choice.aux),
        "verifier": loader.choice.verifier is not None,
        "rank": loader.rank,
        "world_size": loader.world_size,
        "pad_token_id": loader.shape.pad_token_id,
    }
