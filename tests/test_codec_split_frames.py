"""split-zstd frames of 2-byte values are decoded by hsstore's own stream decoder (a zstd
context kept per thread); every frame gives exactly what c-blosc gives, from many threads, and
a damaged stream is an IntegrityError naming the chunk."""

from __future__ import annotations

import struct
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
import torch

from hsstore.codec import codecs
from hsstore.codec.codecs import ChunkCodec, CodecConfig
from hsstore.codec.tiers import round_mantissa
from hsstore.errors import IntegrityError
from tools.synthetic import llm_like_states


def chunk_of(kind: str, rows: int, hidden: int) -> np.ndarray:
    """A [rows, 1, hidden] chunk as int16 bit patterns, whose streams code in different ways."""
    x = llm_like_states(rows, 1, hidden, seed=rows + hidden)
    if kind == "m2":  # both streams zstd-coded (the low bytes keep 3 bits)
        x = round_mantissa(x, 2)
    elif kind == "noise":  # both streams raw
        x = torch.randint(-(2**15), 2**15 - 1, (rows, 1, hidden), dtype=torch.int16)
    elif kind == "padding":  # mostly zero rows, as a sample-aligned chunk's tail
        x[rows // 4 :] = 0
    return x.view(torch.int16).numpy()


def frame(codec: ChunkCodec, chunk: np.ndarray) -> bytes:
    return b"".join(bytes(p) for p in codec.encode(chunk))


def by_blosc(encoded: bytes, nbytes: int) -> np.ndarray:
    blosc_only = ChunkCodec(CodecConfig(name="split-zstd"), 2)
    blosc_only._split = None
    out = np.empty(nbytes, np.uint8)
    blosc_only.decode_into(memoryview(encoded), out, what="test")
    return out


@pytest.mark.parametrize("kind", ["lossless", "m2", "noise", "padding"])
@pytest.mark.parametrize(
    "rows, hidden", [(1, 32), (2, 64), (32, 64), (32, 384), (16, 4096), (64, 4096)]
)
@pytest.mark.parametrize("stream", [False, True])
def test_own_decoder_gives_what_c_blosc_gives(kind, rows, hidden, stream):
    codec = ChunkCodec(CodecConfig(name="split-zstd"), 2)
    chunk = chunk_of(kind, rows, hidden)
    encoded = frame(codec, chunk)
    out = np.full(chunk.nbytes, 0xAB, np.uint8)
    codec.decode_into(memoryview(encoded), out, what="test", stream=stream)
    assert out.tobytes() == chunk.tobytes() == by_blosc(encoded, chunk.nbytes).tobytes()
    # which path decoded it: frames too small to split ("blocks not split") go to c-blosc, and
    # every frame does on the portable path
    if not codecs.fast_decode():
        assert codec._split is None
        return
    body = memoryview(encoded)[:-4]
    own = chunk.nbytes >= 256
    assert codec._split.decode_into(body, out, what="test", stream=stream) == own


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("offset", [0, 1, 2, 6, 16])
@pytest.mark.parametrize("hidden", [64, 65, 72, 2050])
def test_decoding_into_any_place_writes_exactly_the_chunk(stream, offset, hidden):
    """Stores around the caches need aligned destinations: a chunk decoded at any offset of a
    buffer, even an odd address (no aligned stores at all), and of any length (a tail past
    the last full store), gives the same bytes and writes nothing outside its place."""
    codec = ChunkCodec(CodecConfig(name="split-zstd"), 2)
    for kind in ("lossless", "noise"):
        chunk = chunk_of(kind, 2, hidden)
        encoded = frame(codec, chunk)
        held = np.full(chunk.nbytes + offset + 64, 0xAB, np.uint8)
        out = held[offset : offset + chunk.nbytes]
        codec.decode_into(memoryview(encoded), out, what="test", crc=False, stream=stream)
        assert out.tobytes() == chunk.tobytes()
        assert (held[:offset] == 0xAB).all() and (held[offset + chunk.nbytes :] == 0xAB).all()


@pytest.mark.parametrize("name", ["split-zstd", "split-zstd by c-blosc", "blosc-zstd"])
def test_decoders_decode_from_and_into_any_buffer(name):
    """The decoders are handed the buffers' addresses: a frame held read-only (bytes, as object
    storage returns them) or writable at an offset (a read buffer of the loader's), decoded
    into a numpy array or a memoryview, always gives the chunk."""
    codec = ChunkCodec(CodecConfig(name=name.split()[0]), 2)
    if name.endswith("c-blosc"):
        codec._split = None
    chunk = chunk_of("lossless", 64, 4096)
    encoded = frame(codec, chunk)
    held = np.zeros(len(encoded) + 7, np.uint8)
    held[7:] = np.frombuffer(encoded, np.uint8)
    for source in (memoryview(encoded), memoryview(bytearray(encoded)), memoryview(held)[7:]):
        for out in (
            np.full(chunk.nbytes + 3, 0xAB, np.uint8)[3:],
            memoryview(bytearray(chunk.nbytes)),
        ):
            codec.decode_into(source, out, what="test")
            assert bytes(out) == chunk.tobytes()


def test_threads_each_decode_with_their_own_context():
    codec = ChunkCodec(CodecConfig(name="split-zstd"), 2)
    chunks = [chunk_of(kind, 32, 384 + 64 * k) for k in range(6) for kind in ("lossless", "m2")]
    frames = [frame(codec, c) for c in chunks]

    def decode(k: int) -> bool:
        out = np.empty(chunks[k].nbytes, np.uint8)
        for _ in range(20):
            codec.decode_into(memoryview(frames[k]), out, what="test", crc=False)
            if out.tobytes() != chunks[k].tobytes():
                return False
        return True

    with ThreadPoolExecutor(4) as pool:
        assert all(pool.map(decode, list(range(len(chunks))) * 4))


def test_a_damaged_stream_is_an_integrity_error_naming_the_chunk():
    codec = ChunkCodec(CodecConfig(name="split-zstd"), 2)
    chunk = chunk_of("m2", 32, 384)
    encoded = bytearray(frame(codec, chunk))
    first = codecs._BLOSC_HEADER.size + 4
    (low_len,) = struct.unpack_from("<i", encoded, first)
    high_at = first + 4 + low_len + 4
    out = np.empty(chunk.nbytes, np.uint8)
    for damage in ("stream bytes", "stream length"):
        bad = bytearray(encoded)
        if damage == "stream bytes":
            bad[high_at : high_at + 8] = b"\xff" * 8  # the zstd frame's magic and header
        else:
            struct.pack_into("<i", bad, first, low_len - 3)  # the streams no longer tile the frame
        with pytest.raises(IntegrityError, match="does not decode") as info:
            codec.decode_into(memoryview(bytes(bad)), out, what="shard 0 chunk (0, 0)", crc=False)
        assert "shard 0 chunk (0, 0)" in str(info.value) and "\n" not in str(info.value)


def test_damaged_frames_decode_or_fail_cleanly():
    """The compiled decoder trusts nothing in a frame: with any bytes of the header, the
    stream lengths or the streams changed, or the frame cut short, a decode gives bytes or an
    IntegrityError (c-blosc's, for a frame no longer of the split shape), never a crash."""
    codec = ChunkCodec(CodecConfig(name="split-zstd"), 2)
    chunk = chunk_of("m2", 32, 384)
    encoded = np.frombuffer(frame(codec, chunk), np.uint8)
    first = codecs._BLOSC_HEADER.size + 4
    rng = np.random.default_rng(7)
    out = np.empty(chunk.nbytes, np.uint8)
    outcomes = set()
    for _ in range(400):
        bad = encoded.copy()
        where = rng.integers(0, first + 8) if rng.random() < 0.7 else rng.integers(0, len(bad))
        bad[where] = rng.integers(0, 256)
        if rng.random() < 0.2:
            bad = bad[: rng.integers(1, len(bad))]
        try:
            codec.decode_into(memoryview(bad.tobytes()), out, what="chunk (0, 0)", crc=False)
            outcomes.add("decoded")
        except IntegrityError as exc:
            assert "chunk (0, 0)" in str(exc)
            outcomes.add("refused")
    assert outcomes == {"decoded", "refused"}


def test_a_process_that_decoded_exits_without_a_word():
    """Thread contexts are freed when their threads end, and at shutdown with a daemon thread
    still decoding, with nothing printed."""
    import subprocess
    import sys

    script = (
        "import threading, numpy as np, torch\n"
        "from hsstore.codec.codecs import ChunkCodec, CodecConfig\n"
        "c = ChunkCodec(CodecConfig(name='split-zstd'), 2)\n"
        "x = torch.randn(32, 1, 384).to(torch.bfloat16).view(torch.int16).numpy()\n"
        "f = memoryview(b''.join(bytes(p) for p in c.encode(x)))\n"
        "out = np.empty(x.nbytes, np.uint8)\n"
        "def decode():\n"
        "    c.decode_into(f, out, what='t')\n"
        "    assert out.tobytes() == x.tobytes()\n"
        "t = threading.Thread(target=decode); t.start(); t.join()\n"
        "d = threading.Thread(target=decode, daemon=True); d.start()\n"
        "decode()\n"
        "d2 = threading.Thread(target=lambda: [decode() for _ in range(10**6)], daemon=True)\n"
        "d2.start()\n"
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True)
    assert done.returncode == 0 and done.stderr == "" and done.stdout == "", done.stderr
