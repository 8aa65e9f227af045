"""The slots through which SGLang's scheduler hands hidden states to an hsstore worker.

A worker owns one directory of shared memory (``/dev/shm`` where there is one) holding a pool
of *slot* files, reused from request to request. A slot is a 4 KiB JSON header followed by the
states as raw ``[rows, layers, hidden]`` values in the engine's dtype, already in hsstore's
stored layer order. Both processes keep each slot mapped once (``MAP_SHARED``) and reuse the
mapping: the pages are allocated and faulted in the first time a slot reaches a size, never
again, so a capture costs one copy into memory that is already resident (first touch of fresh
memory runs several times slower than copying into warm pages).

The life of a slot, all by ``rename`` within the directory (atomic, so no reader ever sees a
half-written capture):

* ``free-<k>``: free, owned by the scheduler;
* ``<rid>.<prefix>.hs.tmp``: claimed by the forward hook for request ``rid``, being written;
* ``<rid>.<prefix>.hs``: the receipt, complete; ``prefix`` is the number of prompt tokens the
  forward did not compute (a prefix-cache hit or a later chunk of a chunked prefill), so a
  sample that did not get all its rows in one forward is caught by its name alone;
* back to ``free-<k>`` when the worker's tensor over it is freed (the writer has consumed
  the states): :func:`SlotReader.take` ties the release to the tensor's lifetime.

A forward whose outputs hsstore cannot use writes a receipt with ``problem`` set and no states,
so the worker names the sample and the reason instead of waiting for states that never come.
One copy of a sample's states is in host memory while it is in flight.

This module must import nothing heavier than torch and numpy: SGLang's scheduler imports it.
"""

from __future__ import annotations

import contextlib
import json
import mmap
import os
import shutil
import tempfile
import time
import weakref
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

HEADER_BYTES = 4096  # page-aligned, so the states map at an aligned offset
SUFFIX = ".hs"
TMP = ".tmp"
FREE = "free-"
DIR_PREFIX = "hsstore-sglang-"
DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def file_name(rid: str, prefix: int) -> str:
    return f"{rid}.{int(prefix)}{SUFFIX}"


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")


def _header_bytes(header: dict) -> bytes:
    raw = json.dumps(header).encode()
    if len(raw) > HEADER_BYTES:
        raise ValueError(f"capture header of {len(raw)} bytes is over {HEADER_BYTES}")
    return raw.ljust(HEADER_BYTES, b"\0")


@dataclass
class Slot:
    """One slot as the scheduler holds it: its file descriptor and mapping, and where it is."""

    number: int
    fd: int
    size: int
    mm: mmap.mmap
    path: str  # its current name

    def view(self, rows: int, layers: int, hidden: int, dtype: torch.dtype) -> torch.Tensor:
        count = rows * layers * hidden
        flat = torch.frombuffer(self.mm, dtype=dtype, count=count, offset=HEADER_BYTES)
        return flat.view(rows, layers, hidden)


class SlotWriter:
    """The scheduler's side: claims a free slot per request, fills it, publishes the receipt."""

    def __init__(self, directory: str):
        self.directory = directory
        self._slots: dict[int, Slot] = {}

    def claim(self, rid: str, prefix: int, nbytes: int) -> Slot:
        """A slot of at least ``nbytes`` of states, renamed to ``rid``'s temporary name."""
        free = self._free()
        fits = [k for k in free if self._slots[k].size >= HEADER_BYTES + nbytes]
        if fits:  # the smallest that fits; else grow the largest free one
            k = min(fits, key=lambda n: self._slots[n].size)
        elif free:
            k = max(free, key=lambda n: self._slots[n].size)
        else:
            k = self._new()
        slot = self._slots[k]
        tmp = os.path.join(self.directory, file_name(rid, prefix) + TMP)
        os.rename(slot.path, tmp)
        slot.path = tmp
        if slot.size < HEADER_BYTES + nbytes:
            try:
                self._grow(slot, HEADER_BYTES + nbytes)
            except BaseException:
                self.unclaim(slot)
                raise
        return slot

    def publish(self, slot: Slot, header: dict) -> None:
        """Write the header and give the slot its receipt name (the worker owns it now)."""
        slot.mm[:HEADER_BYTES] = _header_bytes({**header, "slot": slot.number})
        final = slot.path[: -len(TMP)]
        os.rename(slot.path, final)
        slot.path = final

    def unclaim(self, slot: Slot) -> None:
        """Give back a claimed slot whose write failed."""
        free = os.path.join(self.directory, f"{FREE}{slot.number}")
        os.rename(slot.path, free)
        slot.path = free

    def write_problem(self, rid: str, prefix: int, header: dict) -> None:
        """A receipt with no states: a small file that is no slot."""
        final = os.path.join(self.directory, file_name(rid, prefix))
        tmp = f"{final}.problem{TMP}"  # never a claimed slot's name
        with open(tmp, "wb") as f:
            f.write(_header_bytes({**header, "slot": None}))
        os.rename(tmp, final)

    def _free(self) -> list[int]:
        out = []
        for name in os.listdir(self.directory):
            if name.startswith(FREE) and name[len(FREE) :].isdigit():
                k = int(name[len(FREE) :])
                if k not in self._slots:  # a slot this process has not mapped yet
                    self._open(k, os.path.join(self.directory, name))
                else:
                    self._slots[k].path = os.path.join(self.directory, name)
                out.append(k)
        return out

    def _new(self) -> int:
        k = max(self._slots, default=-1) + 1
        path = os.path.join(self.directory, f"{FREE}{k}")
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        os.ftruncate(fd, HEADER_BYTES)
        self._slots[k] = Slot(k, fd, HEADER_BYTES, mmap.mmap(fd, HEADER_BYTES), path)
        return k

    def _open(self, k: int, path: str) -> None:
        fd = os.open(path, os.O_RDWR)
        size = os.fstat(fd).st_size
        self._slots[k] = Slot(k, fd, size, mmap.mmap(fd, size), path)

    @staticmethod
    def _grow(slot: Slot, size: int) -> None:
        # allocated here, so a full /dev/shm is an OSError now, not a SIGBUS on a later store
        os.posix_fallocate(slot.fd, 0, size)
        with contextlib.suppress(BufferError):  # a view still alive keeps the old map open
            slot.mm.close()
        slot.mm = mmap.mmap(slot.fd, size, flags=mmap.MAP_SHARED | _POPULATE)
        slot.size = size


_POPULATE = getattr(mmap, "MAP_POPULATE", 0)  # fault a grown slot in at once, not page by page


def write_capture(
    writer: SlotWriter,
    rid: str,
    *,
    prefix: int,
    blocks: list[torch.Tensor],
    problem: str | None = None,
    width: int | None = None,
) -> None:
    """Write one request's rows synchronously: ``blocks[l]`` (``[rows, hidden]``, on the CPU) is
    stored layer l. With ``problem``, only a receipt saying why (``width``: what the engine
    gave)."""
    t0, c0 = time.perf_counter(), time.thread_time()
    header = {"rid": rid, "prefix": int(prefix), "problem": problem, "width": width}
    if problem or not blocks:
        header.update(rows=0, layers=0, hidden=0, dtype="float32", write_s=0.0, write_cpu_s=0.0)
        writer.write_problem(rid, prefix, header)
        return
    rows, hidden, dtype = int(blocks[0].shape[0]), int(blocks[0].shape[1]), blocks[0].dtype
    slot = writer.claim(rid, prefix, rows * len(blocks) * hidden * dtype.itemsize)
    try:
        dst = bits(slot.view(rows, len(blocks), hidden, dtype))
        for layer, block in enumerate(blocks):  # strided copies into warm pages, no temporary
            np.copyto(dst[:, layer], bits(block))
        del dst
    except BaseException:
        writer.unclaim(slot)
        raise
    header.update(rows=rows, layers=len(blocks), hidden=hidden, dtype=dtype_name(dtype))
    header["write_s"] = time.perf_counter() - t0
    header["write_cpu_s"] = time.thread_time() - c0
    writer.publish(slot, header)


def bits(t: torch.Tensor) -> np.ndarray:
    """A CPU tensor's values as a numpy array of same-sized integers (a view, no copy).

    Copies and checks go through numpy, on the calling thread alone: torch would split a large
    copy across its intra-op threads, and on a host whose cores are all busy (the engine's own
    threads) a copy that waits for every thread to be scheduled ran 5-10x slower."""
    return t.view({2: torch.int16, 4: torch.int32, 1: torch.uint8}[t.element_size()]).numpy()


@dataclass(frozen=True)
class Capture:
    """What the scheduler wrote for one request's forward (``states`` None with a problem)."""

    rid: str
    prefix: int
    rows: int
    layers: int
    hidden: int
    dtype: str
    problem: str | None
    width: int | None
    write_s: float  # the scheduler's time to write it, the copy included
    write_cpu_s: float  # the CPU time of that (one thread)
    states: torch.Tensor | None


class SlotReader:
    """The worker's side: maps each slot once and hands out tensors over its pages."""

    def __init__(self, directory: str):
        self.directory = directory
        self._maps: dict[int, tuple[int, mmap.mmap]] = {}  # slot -> (inode, mapping)

    def pending(self, rid: str) -> list[str]:
        """Names of ``rid``'s captures still being written."""
        base = f"{rid}."
        return [n for n in os.listdir(self.directory) if n.startswith(base) and n.endswith(TMP)]

    def captures_of(self, rid: str) -> list[Capture]:
        """Every complete capture of ``rid``, by prefix. A capture's slot goes back to the pool
        when its ``states`` tensor (and every view of it) is freed."""
        base = f"{rid}."
        out = []
        for name in sorted(os.listdir(self.directory)):
            if name.startswith(base) and name.endswith(SUFFIX):
                out.append(self.take(os.path.join(self.directory, name)))
        return sorted(out, key=lambda c: c.prefix)

    def take(self, path: str) -> Capture:
        fd = os.open(path, os.O_RDWR)
        states, slot = None, None
        try:
            try:
                header = json.loads(os.pread(fd, HEADER_BYTES, 0).rstrip(b"\0").decode())
            except ValueError as exc:
                raise ValueError(f"{path}: unreadable capture header ({exc})") from None
            st = os.fstat(fd)
            slot = header.get("slot")
            n = header["rows"] * header["layers"] * header["hidden"]
            if slot is not None and header.get("problem") is None and n:
                dtype = DTYPES[header["dtype"]]
                need = HEADER_BYTES + n * dtype.itemsize
                if st.st_size < need:
                    raise ValueError(f"{path}: {st.st_size} bytes, expected at least {need}")
                mm = self._map(int(slot), fd, st)
                raw = np.frombuffer(mm, dtype=np.uint8, count=need - HEADER_BYTES, offset=4096)
                # the slot is free again once nothing refers to these pages any more
                weakref.finalize(raw, _release, path, os.path.join(self.directory, f"{FREE}{slot}"))
                states = (
                    torch.from_numpy(raw)
                    .view(dtype)
                    .view(header["rows"], header["layers"], header["hidden"])
                )
        finally:
            os.close(fd)
        if states is None and slot is not None:  # a slot that carries a problem: free again
            _release(path, os.path.join(self.directory, f"{FREE}{slot}"))
        elif states is None:
            _unlink(path)
        return Capture(
            rid=header["rid"],
            prefix=int(header["prefix"]),
            rows=int(header["rows"]),
            layers=int(header["layers"]),
            hidden=int(header["hidden"]),
            dtype=header["dtype"],
            problem=header.get("problem"),
            width=header.get("width"),
            write_s=float(header.get("write_s", 0.0)),
            write_cpu_s=float(header.get("write_cpu_s", 0.0)),
            states=states,
        )

    def _map(self, slot: int, fd: int, st: os.stat_result) -> mmap.mmap:
        cached = self._maps.get(slot)
        if cached is not None and cached[0] == st.st_ino and len(cached[1]) >= st.st_size:
            return cached[1]
        mm = mmap.mmap(fd, st.st_size, flags=mmap.MAP_SHARED | _POPULATE)
        self._maps[slot] = (st.st_ino, mm)  # a replaced map stays alive while its views do
        return mm


def _release(path: str, free: str) -> None:
    with contextlib.suppress(FileNotFoundError):  # the directory went with a closed backend
        os.rename(path, free)


def _unlink(path: str) -> None:
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)


def shared_memory_root() -> str:
    """Where capture directories live: RAM-backed ``/dev/shm`` if present, else the temp dir."""
    shm = Path("/dev/shm")
    if shm.is_dir() and os.access(shm, os.W_OK):
        return str(shm)
    return tempfile.gettempdir()


def make_capture_dir() -> str:
    """A fresh directory for one worker's captures, after removing those of dead workers
    (a killed worker cannot clean up, and its files would hold memory until reboot)."""
    root = shared_memory_root()
    for entry in Path(root).glob(f"{DIR_PREFIX}*"):
        pid = entry.name[len(DIR_PREFIX) :].split("-", 1)[0]
        if pid.isdigit() and not _alive(int(pid)):
            shutil.rmtree(entry, ignore_errors=True)
    return tempfile.mkdtemp(prefix=f"{DIR_PREFIX}{os.getpid()}-", dir=root)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
