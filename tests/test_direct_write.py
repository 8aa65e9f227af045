"""Large local files are written around the page cache (`hsstore.storage.direct_write`): the
bytes come back exactly, whatever the pieces' sizes and alignment; nothing of the file stays in
the cache; the kernel's refusals of direct I/O (a misaligned write, a descriptor that cannot
take ``O_DIRECT``, a write cut short at a size limit) end in the same bytes through the cache
or in one error naming the file."""

from __future__ import annotations

import errno
import os
import pickle
import socket
import subprocess
import sys
import threading
from pathlib import Path

import numpy as np
import pytest

from hsstore import settings
from hsstore.storage import direct_write
from hsstore.storage.local_store import LocalStorage
from tests.page_cache import cached_pages, evictable

pytestmark = pytest.mark.skipif(not direct_write.SUPPORTED, reason="no O_DIRECT on this system")


def _pieces(seed: int) -> list[bytes | memoryview]:
    """Pieces of awkward sizes across more than two stages: empty, one byte, a page less one,
    views of numpy memory at an odd offset, and a tail that fills no whole page."""
    rng = np.random.default_rng(seed)
    big = rng.integers(0, 256, (5 << 20) + 3, dtype=np.uint8)
    return [
        b"",
        b"\x01",
        rng.integers(0, 256, 4095, dtype=np.uint8).tobytes(),
        memoryview(big)[3:],  # not at a page boundary
        rng.integers(0, 256, (3 << 20) + 11, dtype=np.uint8).tobytes(),
        memoryview(rng.integers(0, 256, 777, dtype=np.uint8)),
    ]


@pytest.mark.parametrize("direct", [True, False])
def test_a_large_file_comes_back_byte_for_byte(tmp_path, direct):
    store = LocalStorage(tmp_path, direct_writes=direct)
    pieces = _pieces(0)
    expected = b"".join(bytes(p) for p in pieces)
    assert len(expected) > 2 * direct_write.STAGE_BYTES
    assert store.write_file("segments/s/shard", pieces) == len(expected)
    path = tmp_path / "segments/s/shard"
    assert path.stat().st_size == len(expected)
    assert path.read_bytes() == expected
    (got,) = store.read_ranges("segments/s/shard", [(len(expected) - 5000, 5000)])
    assert bytes(got) == expected[-5000:]
    with pytest.raises(FileExistsError):  # a new file, never an overwrite
        store.write_file("segments/s/shard", [b"x" * (2 << 20)])


def test_a_direct_write_leaves_nothing_in_the_page_cache(tmp_path):
    """The point of the path: a buffered write leaves the file's pages cached (as the control
    shows), a direct one none, so writing a terabyte neither fills the cache nor pays for it."""
    probe = tmp_path / "probe"
    probe.write_bytes(b"x" * 8192)
    if not evictable(probe):
        pytest.skip("this file system keeps every page cached (tmpfs)")
    data = np.random.default_rng(1).integers(0, 256, 6 << 20, dtype=np.uint8).tobytes()
    LocalStorage(tmp_path, direct_writes=True).write_file("direct", [data])
    LocalStorage(tmp_path, direct_writes=False).write_file("buffered", [data])
    assert cached_pages(tmp_path / "direct") == []
    assert len(cached_pages(tmp_path / "buffered")) > (4 << 20) // os.sysconf("SC_PAGE_SIZE")
    assert (tmp_path / "direct").read_bytes() == data


def test_small_files_and_the_setting_keep_the_page_cache_path(tmp_path, monkeypatch):
    """Below `MIN_BYTES` a file is written through the cache (a direct write would wait for
    the device); ``HSSTORE_DIRECT_WRITES=0`` keeps every file there; the choice travels with a
    storage pickled into a worker process."""
    assert LocalStorage(tmp_path).direct_writes
    monkeypatch.setenv("HSSTORE_DIRECT_WRITES", "0")
    off = LocalStorage(tmp_path)
    assert not off.direct_writes and not pickle.loads(pickle.dumps(off)).direct_writes
    monkeypatch.setenv("HSSTORE_DIRECT_WRITES", "yes")
    with pytest.raises(settings.SettingsError, match="HSSTORE_DIRECT_WRITES='yes'"):
        LocalStorage(tmp_path)
    monkeypatch.delenv("HSSTORE_DIRECT_WRITES")
    assert pickle.loads(pickle.dumps(LocalStorage(tmp_path))).direct_writes
    small = b"y" * (direct_write.MIN_BYTES - 1)
    LocalStorage(tmp_path).write_file("small", [small])
    assert (tmp_path / "small").read_bytes() == small


def test_a_misaligned_write_the_kernel_refuses_goes_on_through_the_cache(tmp_path):
    """A real refusal: a direct write from an address off a page boundary is EINVAL on a block
    device's file system, and the same bytes are then written through the cache."""
    path = tmp_path / "f"
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL)
    try:
        if not direct_write._set_direct(fd, True):
            pytest.skip("this file system takes no direct I/O")
        data = memoryview(bytearray(os.urandom(2 * 4096 + 1)))
        still_direct = direct_write._write_out(fd, data[1:], direct=True)
    finally:
        os.close(fd)
    assert path.read_bytes() == bytes(data[1:])
    if evictable(path):  # a block device's file system (tmpfs takes any alignment)
        assert not still_direct


def test_a_descriptor_that_cannot_take_o_direct_gets_every_byte_buffered():
    """A socket refuses ``O_DIRECT`` (``fcntl`` EINVAL), as a file system without direct I/O
    does: `write_pieces` writes through the ordinary path, and every byte arrives in order."""
    ours, theirs = socket.socketpair()
    pieces = _pieces(2)
    size = sum(len(p) for p in pieces)
    received = bytearray()

    def drain() -> None:
        while chunk := theirs.recv(1 << 20):
            received.extend(chunk)

    reader = threading.Thread(target=drain)
    reader.start()
    try:
        assert not direct_write._set_direct(ours.fileno(), True)
        direct_write.write_pieces(ours.fileno(), pieces, size, direct=True)
    finally:
        ours.shutdown(socket.SHUT_WR)
        reader.join()
        ours.close()
        theirs.close()
    assert bytes(received) == b"".join(bytes(p) for p in pieces)


def test_a_write_stopped_by_a_size_limit_names_the_file(tmp_path):
    """The file size limit (RLIMIT_FSIZE) cuts the first direct write short at an unaligned
    size: what fits is written through the cache, then EFBIG is one error naming the file."""
    script = f"""
import resource, signal, sys
sys.path.insert(0, {str(Path(__file__).resolve().parents[1])!r})
from hsstore.storage.local_store import LocalStorage
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
resource.setrlimit(resource.RLIMIT_FSIZE, ((2 << 20) + 100, resource.RLIM_INFINITY))
try:
    LocalStorage(sys.argv[1], direct_writes=True).write_file("seg/shard", [bytes(6 << 20)])
except OSError as exc:
    print(exc.errno, exc.filename)
"""
    out = subprocess.run(
        [sys.executable, "-c", script, str(tmp_path)], capture_output=True, text=True, check=True
    ).stdout.split()
    assert out == [str(errno.EFBIG), str(tmp_path / "seg/shard")]
    assert (tmp_path / "seg/shard").stat().st_size == (2 << 20) + 100
