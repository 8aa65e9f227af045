"""The capture files through which SGLang's scheduler hands hidden states to an hsstore worker.

One file per request and prefill forward, in a directory of shared memory (``/dev/shm`` where
there is one) that the worker owns: a 4 KiB JSON header, then the states as raw
``[rows, layers, hidden]`` values in the engine's dtype, already in hsstore's stored layer
order. The scheduler writes them from its forward hook (:mod:`hsstore.extract.sglang_hook`)
straight into the mapped file; the worker maps the same pages and hands them to the writer as a
tensor, so the states are never a Python object per value and never copied on the way: one
copy of a sample's bytes is in host memory while it is in flight.

A file is named ``<rid>.<prefix>.hs``: the request id hsstore chose and the number of prompt
tokens the forward did not compute (a prefix-cache hit or a later chunk of a chunked prefill),
so a sample that did not get all its rows in one forward is caught by its name alone. It is
written under a temporary name and renamed when complete, so a reader never sees half a file.
A forward whose outputs hsstore cannot use writes a header with ``problem`` set and no states,
so the worker names the sample and the reason instead of waiting for states that never come.

This module must import nothing heavier than torch: SGLang's scheduler imports it.
"""

from __future__ import annotations

import contextlib
import json
import mmap
import os
import shutil
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch

HEADER_BYTES = 4096  # page-aligned, so the states map at an aligned offset
SUFFIX = ".hs"
DIR_PREFIX = "hsstore-sglang-"
DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
_POPULATE = getattr(mmap, "MAP_POPULATE", 0)  # fault the pages in at once, not one by one


def file_name(rid: str, prefix: int) -> str:
    return f"{rid}.{int(prefix)}{SUFFIX}"


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")


def write_capture(
    directory: str,
    rid: str,
    *,
    prefix: int,
    blocks: list[torch.Tensor],
    problem: str | None = None,
    width: int | None = None,
) -> None:
    """Write one request's rows: ``blocks[l]`` (``[rows, hidden]``, any device) is stored
    layer l. With ``problem``, only a header saying why (``width``: what the engine gave)."""
    rows = int(blocks[0].shape[0]) if blocks else 0
    hidden = int(blocks[0].shape[1]) if blocks else 0
    dtype = blocks[0].dtype if blocks else torch.float32
    payload = 0 if problem else rows * len(blocks) * hidden * dtype.itemsize
    final = os.path.join(directory, file_name(rid, prefix))
    tmp = final + ".tmp"
    t0 = time.perf_counter()
    fd = os.open(tmp, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        os.ftruncate(fd, HEADER_BYTES + payload)
        if payload:
            _fill(fd, HEADER_BYTES + payload, blocks, rows, hidden, dtype)
        header = {
            "rid": rid,
            "prefix": int(prefix),
            "rows": rows,
            "layers": len(blocks),
            "hidden": hidden,
            "dtype": _dtype_name(dtype),
            "problem": problem,
            "width": width,
            "write_s": time.perf_counter() - t0,
        }
        raw = json.dumps(header).encode()
        if len(raw) > HEADER_BYTES:
            raise ValueError(f"capture header of {len(raw)} bytes is over {HEADER_BYTES}")
        os.pwrite(fd, raw, 0)
    finally:
        os.close(fd)
    os.rename(tmp, final)


def _fill(fd: int, size: int, blocks: list[torch.Tensor], rows: int, hidden: int, dtype) -> None:
    mm = mmap.mmap(fd, size, flags=mmap.MAP_SHARED | _POPULATE)
    try:
        count = rows * len(blocks) * hidden
        dst = torch.frombuffer(mm, dtype=dtype, count=count, offset=HEADER_BYTES)
        dst = dst.view(rows, len(blocks), hidden)
        if blocks[0].device.type == "cpu":
            for layer, block in enumerate(blocks):  # strided copies, no temporary
                dst[:, layer].copy_(block)
        else:  # one contiguous device-to-host copy of the request's rows
            dst.copy_(torch.stack(blocks, dim=1))
        del dst
    finally:
        # a view still referenced somewhere keeps the mapping open until the GC closes it
        with contextlib.suppress(BufferError):
            mm.close()


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
    write_s: float  # the scheduler's time to write it, mapping and copy included
    states: torch.Tensor | None


def captures_of(directory: str, rid: str) -> list[Capture]:
    """Every capture of ``rid``, by prefix, each file unlinked once mapped (its pages stay
    alive as long as the returned tensor does)."""
    base = f"{rid}."
    out = []
    for name in sorted(os.listdir(directory)):
        if not name.startswith(base) or not name.endswith(SUFFIX):
            continue
        out.append(_read(os.path.join(directory, name)))
    return sorted(out, key=lambda c: c.prefix)


def _read(path: str) -> Capture:
    with open(path, "rb") as f:
        header = json.loads(f.read(HEADER_BYTES).rstrip(b"\0").decode())
        size = os.fstat(f.fileno()).st_size
        states = None
        n = header["rows"] * header["layers"] * header["hidden"]
        if header.get("problem") is None and n:
            dtype = DTYPES[header["dtype"]]
            if size != HEADER_BYTES + n * dtype.itemsize:
                raise ValueError(
                    f"{path}: {size} bytes, expected {HEADER_BYTES + n * dtype.itemsize}"
                )
            # copy-on-write mapping: writable for torch, and nothing is ever written to it
            mm = mmap.mmap(f.fileno(), size, access=mmap.ACCESS_COPY)
            flat = torch.frombuffer(mm, dtype=dtype, count=n, offset=HEADER_BYTES)
            states = flat.view(header["rows"], header["layers"], header["hidden"])
    os.unlink(path)
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
        states=states,
    )


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
