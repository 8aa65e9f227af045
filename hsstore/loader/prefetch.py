"""Host-to-device prefetch: copy batch n+1 on a side CUDA stream while batch n computes.

The fetcher decodes into a small ring of *pinned* host buffers (allocated once; pinning a fresh
tensor per batch costs more than the copy). A stager thread takes each decoded batch, issues
its copies on a side stream, records an event, hands (device batch, event) to the consumer,
and waits for the event before giving the host buffer back to the ring. The consumer makes
its own stream wait on the event (a GPU-side wait, the host does not block) and marks the
tensors as used on its stream so the caching allocator does not recycle them early.

A batch of an fp8 dataset is copied in its stored form (fp8 states and scales, half the bytes
of bf16 values) and dequantized on the side stream after the copy (`dequant.to_device`).

Without CUDA everything stays on the host: ``DevicePrefetcher`` then just passes batches on.
"""

from __future__ import annotations

import contextlib
import queue
import threading
import warnings
from collections.abc import Iterator
from typing import Any

import torch

from hsstore.loader.collate import RawBatch
from hsstore.loader.dequant import to_device
from hsstore.loader.shutdown import await_stopped, close_at_exit, put_unless_stopped

_END = object()


def resolve_device(device: str | torch.device | None) -> torch.device | None:
    """The CUDA device to prefetch to, or None for CPU (with a warning if CUDA was asked for)."""
    if device is None:
        return None
    dev = torch.device(device)
    if dev.type == "cpu":
        return None
    if dev.type != "cuda":
        raise ValueError(f"device must be a CUDA device or None/'cpu', got {dev}")
    if not torch.cuda.is_available():
        warnings.warn("CUDA is not available: the loader yields CPU tensors", stacklevel=3)
        return None
    if dev.index is None:
        dev = torch.device("cuda", torch.cuda.current_device())
    return dev


class DevicePrefetcher:
    """Iterator of device ``RawBatch`` es over an iterator of host ones.

    ``host`` must keep a yielded host batch's memory intact until its next ``__next__`` (the
    fetcher's buffer-ring contract); the stager only asks for the next host batch once the
    copy of the previous one has completed.
    """

    def __init__(self, host: Iterator[RawBatch], device: torch.device, depth: int = 1):
        self.device = device
        self._host = host
        self._stream = torch.cuda.Stream(device=device)
        self._q: queue.Queue = queue.Queue(maxsize=max(1, depth))
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._stage, name="hsstore-h2d", daemon=True)
        close_at_exit(self)
        self._thread.start()

    def _stage(self) -> None:
        try:
            torch.cuda.set_device(self.device)
            for raw in self._host:
                with torch.cuda.stream(self._stream):
                    dev = to_device(raw, self.device, non_blocking=True)
                    event = torch.cuda.Event()
                    event.record(self._stream)
                if not self._put((dev, event)):
                    return
                # The host buffer goes back to the ring on the next pull: only after the copy.
                event.synchronize()
            self._put(_END)
        except BaseException as exc:
            self._put(exc)

    def _put(self, item: Any) -> bool:
        return put_unless_stopped(self._q, item, self._stop)

    def __iter__(self) -> DevicePrefetcher:
        return self

    def __next__(self) -> RawBatch:
        if self._stop.is_set():
            raise StopIteration
        item = self._q.get()
        if item is _END:
            self.close()
            raise StopIteration
        if isinstance(item, BaseException):
            self.close()
            raise item
        dev, event = item
        current = torch.cuda.current_stream(self.device)
        current.wait_event(event)
        for t in dev.tensors().values():
            t.record_stream(current)
        return dev

    def close(self) -> None:
        if not self._stop.is_set():
            self._stop.set()
            with contextlib.suppress(queue.Empty):  # room for a stager waiting to queue a batch
                self._q.get_nowait()
            close = getattr(self._host, "close", None)
            if close is not None:
                close()
        await_stopped(self._thread)

    def __del__(self) -> None:
        # Not contextlib.suppress: at interpreter exit this module's globals may already be
        # None when the last reference goes, and a failing __del__ prints a traceback.
        try:  # noqa: SIM105
            self.close()
        except Exception:
            pass
