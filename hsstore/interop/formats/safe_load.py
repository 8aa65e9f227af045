"""Opening a foreign file without trusting it: regular files only, bounded inflation, checked
zip archives, and ``torch.load`` restricted to tensors and plain containers.

Every problem is a :class:`BadInputError` naming the file, never a crash, a hang or code run
from a pickle.
"""

from __future__ import annotations

import gzip
import io
import mmap
import os
import pickle
import re
import stat
import struct
import zipfile
import zlib
from pathlib import Path
from typing import Any, BinaryIO

import torch

from hsstore.errors import BadInputError

# Hidden states are close to incompressible (bf16 activations keep ~0.7-0.9 of their size under
# zstd, less under gzip), so a file that expands far beyond its stored size is a decompression
# bomb, not data: what a file may expand to is bounded by its size before anything inflates it.
INFLATE_RATIO_LIMIT = 32
INFLATE_FLOOR_BYTES = 256 << 20  # small samples may hold very compressible tokens and masks
PICKLE_MEMBER_LIMIT = 16 << 20  # the pickle of a dict of a few tensors is a few KiB
_READ_BLOCK = 8 << 20


def inflate_limit(stored_bytes: int) -> int:
    """The most bytes a stored file of this size may expand to before it is refused."""
    return max(INFLATE_FLOOR_BYTES, INFLATE_RATIO_LIMIT * stored_bytes)


def open_regular(path: Path) -> BinaryIO:
    """Open ``path`` for reading, refusing anything but a regular file (links are followed).

    A FIFO blocks its reader forever and ``/dev/zero`` never ends, so both are refused before a
    byte is read; O_NONBLOCK keeps the open itself from waiting for a FIFO's writer.
    """
    name = str(path)
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    except FileNotFoundError:
        raise BadInputError("file is missing", path=name) from None
    except OSError as exc:
        raise BadInputError(f"cannot open it ({exc.strerror or exc})", path=name) from None
    mode = os.fstat(fd).st_mode
    if not stat.S_ISREG(mode):
        os.close(fd)
        raise BadInputError(
            f"not a regular file ({_file_kind(mode)}); refusing to read it", path=name
        )
    os.set_blocking(fd, True)
    return os.fdopen(fd, "rb")


def _file_kind(mode: int) -> str:
    for test, kind in (
        (stat.S_ISDIR, "a directory"),
        (stat.S_ISFIFO, "a FIFO"),
        (stat.S_ISCHR, "a character device"),
        (stat.S_ISBLK, "a block device"),
        (stat.S_ISSOCK, "a socket"),
    ):
        if test(mode):
            return kind
    return f"file type {stat.S_IFMT(mode):o}"


def load_torch_file(path: Path) -> Any:
    """``torch.load`` with ``weights_only=True`` (mmap for plain files), never unsafe unpickling.

    Before torch sees the file: it must be a regular file, a ``.gz`` may expand only to
    :func:`inflate_limit` bytes, and every zip member must match the CRC-32 the archive records.
    Every failure becomes a BadInputError that says what is wrong with the file.
    """
    name = str(path)
    try:
        with open_regular(path) as f:
            size = os.fstat(f.fileno()).st_size
            if path.name.endswith(".gz"):
                raw = gunzip_bounded(f, inflate_limit(size), name)
                check_zip_archive(io.BytesIO(raw), raw, name)
                return torch.load(io.BytesIO(raw), weights_only=True, map_location="cpu")
            if size == 0:
                raise BadInputError(_not_zip_reason(b"", 0), path=name)
            with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as data:
                check_zip_archive(f, data, name)
        # The checked file is loaded by name (mmap needs one); a writer swapping the file in
        # between is outside what a reader of finished files defends against.
        return torch.load(path, mmap=True, weights_only=True, map_location="cpu")
    except BadInputError:
        raise
    except FileNotFoundError:
        raise BadInputError("file is missing", path=name) from None
    except (gzip.BadGzipFile, EOFError, zlib.error) as exc:
        raise BadInputError(f"corrupt or truncated gzip file ({exc})", path=name) from None
    except pickle.UnpicklingError as exc:
        m = re.search(r"GLOBAL ([\w.]+)", str(exc))
        detail = f" (unsupported global {m.group(1)})" if m else ""
        raise BadInputError(
            "refused by torch.load(weights_only=True): the pickle holds objects other than "
            f"tensors and plain containers{detail}; hsstore never unpickles unsafely",
            path=name,
        ) from None
    except RecursionError:
        raise BadInputError("the pickle is nested too deeply", path=name) from None
    except (RuntimeError, ValueError, OSError, zipfile.BadZipFile) as exc:
        msg = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise BadInputError(f"truncated or corrupt torch.save archive ({msg})", path=name) from None


def gunzip_bounded(f: BinaryIO, limit: int, name: str) -> bytes:
    """The decompressed bytes of a gzip stream, or BadInputError once they pass ``limit``."""
    out = bytearray()
    with gzip.GzipFile(fileobj=f, mode="rb") as gz:
        while block := gz.read(min(_READ_BLOCK, limit + 1 - len(out))):
            out += block
            if len(out) > limit:
                raise BadInputError(
                    f"expands past {limit} bytes ({INFLATE_RATIO_LIMIT}x its size, at least "
                    f"{INFLATE_FLOOR_BYTES >> 20} MiB); hidden states do not compress that well, "
                    "so it is refused as a decompression bomb",
                    path=name,
                )
    return bytes(out)


def check_zip_archive(f: BinaryIO, data: bytes | mmap.mmap, name: str) -> None:
    """Check a torch.save zip before torch trusts it: bounded members, each matching its CRC-32.

    ``f`` and ``data`` hold the same bytes: zipfile parses the directory from ``f``, the CRCs
    of stored members (torch stores every member) are taken over ``data`` without a copy.
    torch itself never checks the CRCs, so one flipped bit in tensor data would load silently.
    """
    size = len(data)
    if not zipfile.is_zipfile(f):
        raise BadInputError(_not_zip_reason(bytes(data[:4]), size), path=name)
    with zipfile.ZipFile(f) as zf:
        infos = zf.infolist()
        declared = sum(info.file_size for info in infos)
        if declared > inflate_limit(size):
            raise BadInputError(
                f"its zip members claim {declared} bytes, more than {INFLATE_RATIO_LIMIT}x the "
                "file size; refused as a decompression bomb",
                path=name,
            )
        with memoryview(data) as view:
            for info in infos:
                if info.filename.endswith(".pkl") and info.file_size > PICKLE_MEMBER_LIMIT:
                    raise BadInputError(
                        f"zip member {info.filename!r} is a {info.file_size}-byte pickle, more "
                        f"than the {PICKLE_MEMBER_LIMIT >> 20} MiB a dict of tensors needs",
                        path=name,
                    )
                # CRC 0 means the writer recorded none (torch's
                # torch.utils.serialization.config.save.compute_crc32 = False): nothing to check.
                if info.CRC == 0:
                    continue
                problem = (
                    _stored_crc_problem(view, info)
                    if info.compress_type == zipfile.ZIP_STORED
                    else _inflated_crc_problem(zf, info)
                )
                if problem:
                    raise BadInputError(f"zip member {info.filename!r} {problem}", path=name)


def _stored_crc_problem(view: memoryview, info: zipfile.ZipInfo) -> str | None:
    """Why a stored member's bytes do not match its recorded CRC-32, or None."""
    header = info.header_offset
    if bytes(view[header : header + 4]) != b"PK\x03\x04" or header + 30 > len(view):
        return "is damaged (its local header is missing)"
    name_len, extra_len = struct.unpack_from("<HH", view, header + 26)
    start = header + 30 + name_len + extra_len
    end = start + info.compress_size
    if end > len(view):
        return "is damaged (it runs past the end of the file)"
    if zlib.crc32(view[start:end]) != info.CRC:
        return "is damaged (its bytes fail the CRC-32 the archive records)"
    return None


def _inflated_crc_problem(zf: zipfile.ZipFile, info: zipfile.ZipInfo) -> str | None:
    """The same for a compressed member, which zipfile inflates and checks as it reads."""
    try:
        with zf.open(info) as member:
            while member.read(_READ_BLOCK):
                pass
    except (zipfile.BadZipFile, EOFError, zlib.error, NotImplementedError) as exc:
        return f"is damaged ({exc})"
    return None


def _not_zip_reason(head: bytes, size: int) -> str:
    if size == 0:
        return "empty file (0 bytes), not a torch.save archive"
    if head[:2] == b"PK":
        return "truncated or corrupt torch.save archive (zip central directory missing)"
    if head[:1] == b"\x80":
        return "legacy (non-zip) torch.save file; re-save it with a current torch"
    return "not a torch.save archive (not a zip file)"
