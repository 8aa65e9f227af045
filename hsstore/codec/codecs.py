"""Chunk codecs: the lossless, bf16-aware choice and its Zarr v3 description.

A chunk goes through ``bytes (little endian) -> [blosc] -> crc32c``; both are standard Zarr v3
codecs, so zarr-python opens the arrays as-is, while hsstore's hot path encodes and decodes the
frames directly (no per-call zarr overhead). The trailing crc32c lets any reader detect a
flipped byte before decoding.

Where the compression comes from: in bf16 activations only the high byte of each value (sign
and exponent) is predictable; the low byte is mantissa noise. Blosc's byte shuffle puts the
high bytes of a chunk together, apart from the low bytes.

- ``split-zstd`` (the default) writes each chunk as one blosc block whose byte streams are
  stored apart ("split" blocks, as blosc itself writes them for lz4): each stream is zstd-coded
  with the least match search zstd offers (the exponent stream is close to order-0 entropy,
  which Huffman coding captures; the few repeats of 7+ bytes it holds still pay for their match
  search), and a stream that does not shrink by 1/16 (the mantissa noise) is stored raw, which
  blosc's decoder copies. So decoding is one entropy decode of half the bytes, a copy and an
  unshuffle, where ``blosc-zstd`` entropy-decodes every byte (docs/PERFORMANCE.md has the
  rates and ratios). The frames are ordinary blosc frames: c-blosc (and so
  zarr-python) decodes them with no knowledge of how they were made (c-blosc 1.x ``blosc.c``,
  ``blosc_d``: a split whose compressed size equals its size is copied, any other is
  zstd-decoded). hsstore decodes the frames of 2-byte values it writes the same way itself
  (`_SplitDecoder`, compiled: `hsstore.codec._split_decoder`), keeping a zstd context per
  thread where c-blosc makes one per call, and joining the two byte planes in one pass that
  can write around the caches.
- ``blosc-zstd``: c-blosc's own encoder, zstd level 1 over the whole shuffled block.
- ``none``: raw bytes (+ crc32c).
"""

from __future__ import annotations

import struct
import sys
import threading
import warnings
from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any

import crc32c as _crc32c
import numpy as np
import zstandard

from hsstore import settings
from hsstore.errors import FormatError, IntegrityError

# numcodecs (0.16.4 and later) warns on import when it finds the crc32c package rather than
# google-crc32c, through a filter of its own that shows the warning: a stray line in front of
# every CLI message. Its checksum codecs are not used here (chunks are checked with crc32c
# directly), so the warning is recorded and dropped, and its filter goes with the block.
with warnings.catch_warnings(record=True):
    from numcodecs import blosc as _blosc

try:  # linked with libzstd where its header was there at build time (setup.py)
    from hsstore.codec import _split_decoder
except ImportError:
    _split_decoder = None
# The encoder's split of 2-byte values into byte planes, compiled in the same module (where
# built; a module built before it had the split lacks it).
_split_planes = getattr(_split_decoder, "split_planes", None)

CODEC_NAMES = ("split-zstd", "blosc-zstd", "blosc-lz4", "none")
DEFAULT_CODEC = "split-zstd"
# Blosc 1 frame header: version, versionlz, flags, typesize, nbytes (decoded), blocksize, cbytes.
_BLOSC_HEADER = struct.Struct("<BBBBIII")
_CRC_BYTES = 4  # the crc32c that ends every encoded chunk
# The same header as a numpy record, to read the headers of many chunks at once.
_BLOSC_HEADER_FIELDS = np.dtype(
    [(name, "<u1") for name in ("version", "versionlz", "flags", "typesize")]
    + [(name, "<u4") for name in ("nbytes", "blocksize", "cbytes")]
)
_SHUFFLE_IDS = {"noshuffle": 0, "shuffle": 1, "bitshuffle": 2}
# The frame fields of a split-zstd chunk, as c-blosc 1.x writes them (blosc.h): format version
# 2, zstd format version 1; flags: byte shuffle 0x1, "blocks not split" 0x10, compressor
# format in bits 5-7 (zstd = 4).
_BLOSC_VERSION_FORMAT, _BLOSC_ZSTD_VERSION_FORMAT = 2, 1
_FLAG_SHUFFLE, _FLAG_DONT_SPLIT, _ZSTD_FORMAT_FLAGS = 0x01, 0x10, 4 << 5
# c-blosc splits a block into typesize streams only when each stream has at least this many
# bytes (MIN_BUFFERSIZE); a smaller chunk is written as one stream.
_MIN_SPLIT_BYTES = 128
# zstd mostly for entropy coding: the shortest search and a small window, and matches of 7+
# bytes only, so most of an exponent stream becomes Huffman-coded literals. The hash table of
# the match finder has 512 entries: a smaller table than zstd's level-1 default encodes
# faster, and on hidden states (few long matches) it compresses practically as well
# (`tools/bench_codec.py` compares the two). Encoder parameters only: any zstd frame decodes.
SPLIT_ZSTD_PARAMS: Mapping[str, int] = MappingProxyType(
    dict(min_match=7, search_log=1, hash_log=9, window_log=17)
)
_PROBE_BYTES = 1024
_DECODE_STATE = threading.local()  # `_SplitDecoder._thread_state`


def fast_decode() -> bool:
    """Whether split-zstd chunks decode through the compiled decoder: it was built, and
    ``HSSTORE_NO_FAST_DECODE=1`` does not ask for the portable path (c-blosc through numcodecs'
    public ``decompress``, which reads the same frames)."""
    return _split_decoder is not None and not settings.current().no_fast_decode


def single_threaded_blosc() -> None:
    """Have c-blosc work on the calling thread only, for the whole process (numcodecs'
    ``blosc.use_threads``): hsstore runs its own thread pools, which blosc's threads would
    compete with for the cores. `hsstore.tuning.tune_process` calls it."""
    _blosc.use_threads = False


def crc32c(data: Any, value: int = 0) -> int:
    """CRC-32C (Castagnoli) of a buffer, continuing from ``value``."""
    return _crc32c.crc32c(data, value)


@dataclass(frozen=True)
class CodecConfig:
    """How state chunks are compressed. ``name == "none"`` stores raw bytes (+ crc32c)."""

    name: str = DEFAULT_CODEC
    clevel: int = 1
    shuffle: str = "shuffle"
    # One blosc block per ~1 MiB chunk: blosc's automatic choice (blocksize 0) picks small
    # blocks, each starting its compressor afresh, so it compresses worse and decodes slower.
    blocksize: int = 1 << 20

    def __post_init__(self) -> None:
        if self.name not in CODEC_NAMES:
            raise FormatError(f"unknown codec {self.name!r}; expected one of {CODEC_NAMES}")
        if self.shuffle not in _SHUFFLE_IDS:
            raise FormatError(f"unknown shuffle {self.shuffle!r}")

    @property
    def compressed(self) -> bool:
        return self.name != "none"

    @property
    def cname(self) -> str:
        """The blosc compressor name of the frames."""
        return "zstd" if self.name == "split-zstd" else self.name.split("-", 1)[1]

    def to_json(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "clevel": self.clevel,
            "shuffle": self.shuffle,
            "blocksize": self.blocksize,
        }

    @classmethod
    def from_json(cls, obj: dict[str, Any]) -> CodecConfig:
        return cls(
            name=obj["name"],
            clevel=int(obj.get("clevel", 1)),
            shuffle=obj.get("shuffle", "shuffle"),
            blocksize=int(obj.get("blocksize", 1 << 20)),
        )

    def zarr_codecs(self, itemsize: int) -> list[dict[str, Any]]:
        """The inner-chunk codec chain as Zarr v3 metadata."""
        chain: list[dict[str, Any]] = [_bytes_codec(itemsize)]
        if self.compressed:
            chain.append(
                {
                    "name": "blosc",
                    "configuration": {
                        "cname": self.cname,
                        "clevel": self.clevel,
                        "shuffle": self.shuffle,
                        "typesize": itemsize,
                        "blocksize": self.blocksize,
                    },
                }
            )
        chain.append({"name": "crc32c"})
        return chain


def _bytes_codec(itemsize: int) -> dict[str, Any]:
    if itemsize == 1:
        return {"name": "bytes"}
    return {"name": "bytes", "configuration": {"endian": "little"}}


class ChunkCodec:
    """Encodes and decodes one chunk of a fixed shape and storage dtype."""

    def __init__(
        self,
        config: CodecConfig,
        itemsize: int,
        *,
        zstd_params: Mapping[str, int] = SPLIT_ZSTD_PARAMS,
    ):
        """``zstd_params``: how ``split-zstd`` codes its streams (zstd's advanced parameters
        over ``config.clevel``); the frames decode the same whatever they are."""
        self.config = config
        self.itemsize = itemsize
        self._shuffle = _SHUFFLE_IDS[config.shuffle]
        self._zstd_params = zstandard.ZstdCompressionParameters.from_level(
            config.clevel, **zstd_params
        )
        self._local = threading.local()
        self._compressed = config.compressed
        split = config.name == "split-zstd" and itemsize == 2 and sys.byteorder == "little"
        self._split = _SplitDecoder() if split and fast_decode() else None
        # The compiled split into byte planes goes with the compiled decoder (the portable
        # path, numpy's, is the one ``HSSTORE_NO_FAST_DECODE=1`` runs).
        self._split_planes = _split_planes if fast_decode() else None

    def encode(self, chunk: np.ndarray, *, reuse_input: bool = False) -> list[bytes | memoryview]:
        """Encoded pieces of one chunk; written back to back they form the chunk.

        Pieces may be views of ``chunk``'s memory, so it must stay unchanged until they are
        written. With ``reuse_input`` (a C-contiguous chunk the caller will not read again),
        ``split-zstd`` stores its raw streams in ``chunk``'s own memory instead of fresh
        memory (first touch of fresh memory is slow; the writer's shard buffer is warm).
        """
        raw = memoryview(np.ascontiguousarray(chunk)).cast("B")
        if self.config.name == "split-zstd":
            own = reuse_input and chunk.flags.c_contiguous and chunk.flags.writeable
            return _with_crc(self._encode_split(raw, np.frombuffer(raw, np.uint8) if own else None))
        if self.config.compressed:
            body: bytes | memoryview = _blosc.compress(
                raw, self.config.cname.encode(), self.config.clevel, self._shuffle,
                self.config.blocksize, self.itemsize,
            )  # fmt: skip
        else:
            body = raw
        return [body, struct.pack("<I", crc32c(body))]

    def takes_planes(self, nbytes: int) -> bool:
        """Whether `encode_planes` encodes chunks of ``nbytes``: ``split-zstd`` chunks of 2-byte
        values large enough to be split (on the compiled path, the one that splits them)."""
        return (
            self.config.name == "split-zstd"
            and self.itemsize == 2
            and self._split_planes is not None
            and nbytes % 2 == 0
            and nbytes // 2 >= _MIN_SPLIT_BYTES
        )

    def encode_planes(self, planes: np.ndarray) -> list[bytes | memoryview]:
        """`encode` of a chunk given as its byte planes (``planes``: the low bytes of all its
        values, then the high bytes; a C-contiguous uint8 array of a size `takes_planes`
        accepts): the same pieces, byte for byte. Raw planes are stored as they lie, so
        ``planes`` must stay unchanged until the pieces are written."""
        m = planes.nbytes // 2
        return _with_crc(self._frame([planes[:m], planes[m:]], planes.nbytes, True, kept=2))

    def _encode_split(
        self, raw: memoryview, raw_home: np.ndarray | None
    ) -> list[bytes | memoryview]:
        """One blosc frame of one block whose byte streams are coded apart (module docstring).
        Raw streams go to ``raw_home`` (the chunk's own memory, already split into a scratch)
        or, without one, to fresh memory.

        Thread-safe: a zstd context and a scratch buffer per thread (the writer encodes in a
        pool).
        """
        nbytes, k = len(raw), self.itemsize
        split = k > 1 and nbytes // k >= _MIN_SPLIT_BYTES
        local = self._thread_state()
        if local.scratch.nbytes < nbytes:
            local.scratch = np.empty(nbytes, np.uint8)
        # The shuffled bytes: byte b of every value, for b = 0 .. k-1 (what blosc's unshuffle
        # interleaves), in a reused scratch: fresh memory would be faulted in on every chunk.
        shuffled = local.scratch[:nbytes]
        m = nbytes // k
        # The low plane of 2-byte values split in the chunk's own memory, where it is stored
        # as it lies when raw (mantissa noise): no copy back out of the scratch.
        two_byte = k == 2 and nbytes % 2 == 0 and self._split_planes is not None
        in_place = two_byte and split and raw_home is not None
        if in_place:
            self._split_planes(raw, raw_home[:m], shuffled[m:])
        elif two_byte:
            self._split_planes(raw, shuffled[:m], shuffled[m:])
        elif k in (2, 4, 8) and nbytes % k == 0:
            # Byte b of every value as a shift and a truncating cast of the little-endian
            # words: contiguous passes numpy vectorizes, where a strided byte copy is not.
            # Byte 0 is the cast alone: numpy would compute a shift by 0 in the wide type.
            words = np.frombuffer(raw, dtype=f"<u{k}")
            np.copyto(shuffled[:m], words, casting="unsafe")
            for b in range(1, k):
                np.right_shift(words, 8 * b, out=shuffled[b * m : (b + 1) * m], casting="unsafe")
        else:
            values = np.frombuffer(raw, dtype=np.uint8)
            for b in range(k):
                np.copyto(shuffled[b * m : (b + 1) * m], values[b::k])
        streams = [shuffled[b * m : (b + 1) * m] for b in range(k)] if split else [shuffled]
        if in_place:
            streams[0] = raw_home[:m]
        return self._frame(streams, nbytes, split, kept=int(in_place), raw_home=raw_home)

    def _thread_state(self) -> threading.local:
        """This thread's zstd context and scratch (the writer encodes in a pool)."""
        local = self._local
        if getattr(local, "zstd", None) is None:
            local.zstd = zstandard.ZstdCompressor(compression_params=self._zstd_params)
            local.scratch = np.empty(0, np.uint8)
        return local

    def _frame(
        self,
        streams: list[np.ndarray],
        nbytes: int,
        split: bool,
        *,
        kept: int,
        raw_home: np.ndarray | None = None,
    ) -> list[bytes | memoryview]:
        """The frame of a chunk of ``nbytes`` from its ``streams`` (its byte planes, or with
        ``split`` false the shuffled chunk whole): each zstd-coded, or raw where zstd does not
        save 1/16. The first ``kept`` streams lie where they may be stored raw (memory
        unchanged until written; in ``raw_home`` back to back, where there is one); other raw
        streams are copied into ``raw_home`` after them or, without one, to fresh memory."""
        k = self.itemsize
        flags = _ZSTD_FORMAT_FLAGS | (_FLAG_SHUFFLE if k > 1 else 0)
        if not split:
            flags |= _FLAG_DONT_SPLIT
        zstd = self._thread_state().zstd
        parts: list[bytes | memoryview] = []
        raw_at = sum(stream.nbytes for stream in streams[:kept])
        for b, stream in enumerate(streams):
            size = stream.nbytes
            body: bytes | memoryview | None = None
            # The last stream holds the high bytes (sign and exponent): always worth coding.
            # The others (mantissa noise, unless padding or low-precision data) are probed.
            if size and (b == len(streams) - 1 or _worth_compressing(stream, zstd)):
                packed = zstd.compress(stream)
                # Raw unless zstd saves 1/16: raw streams decode as a copy. A packed stream of
                # exactly ``size`` bytes would be read as raw, which the margin rules out.
                if len(packed) < size - size // 16:
                    body = packed
            if body is None and b < kept:  # already where it is stored
                body = stream.data
            elif body is None:  # raw: out of the scratch, which the next chunk overwrites
                if raw_home is not None:
                    home = raw_home[raw_at : raw_at + size]
                    np.copyto(home, stream)
                    body, raw_at = home.data, raw_at + size
                else:
                    body = stream.tobytes()
            parts += [struct.pack("<i", len(body)), body]
        cbytes = _BLOSC_HEADER.size + 4 + sum(len(p) for p in parts)
        header = _BLOSC_HEADER.pack(
            _BLOSC_VERSION_FORMAT, _BLOSC_ZSTD_VERSION_FORMAT, flags, k, nbytes, nbytes, cbytes
        )
        # One block: its start offset (bstarts[0]) follows the header.
        return [header + struct.pack("<i", _BLOSC_HEADER.size + 4), *parts]

    def check(self, encoded: memoryview, nbytes: int, *, what: str, crc: bool = True) -> memoryview:
        """Check the crc32c of ``encoded`` (unless ``crc`` is false) and that it decodes to
        exactly ``nbytes`` (the size the manifest's layout implies), without decoding it;
        returns the body."""
        if crc:
            body = check_crc(encoded, what=what)
        elif len(encoded) < 4:
            raise IntegrityError("chunk is shorter than its checksum", path=what)
        else:
            body = encoded[:-4]
        if self._compressed:
            if len(body) < _BLOSC_HEADER.size:
                raise IntegrityError("chunk is shorter than a blosc header", path=what)
            _, _, _, _, decoded, _, cbytes = _BLOSC_HEADER.unpack_from(body)
            if cbytes != len(body):  # c-blosc would read a frame of cbytes from this buffer
                raise IntegrityError(
                    f"chunk is {len(body)} bytes, its blosc header says {cbytes}", path=what
                )
        else:
            decoded = len(body)
        if decoded != nbytes:
            # A layout edited in the manifest (rows_per_chunk, hidden_size) must never turn
            # chunks into wrong numbers.
            raise IntegrityError(
                f"chunk decodes to {decoded} bytes, the manifest's layout expects {nbytes}",
                path=what,
            )
        return body

    def all_pass(
        self, data: memoryview, offsets: np.ndarray, sizes: np.ndarray, nbytes: int
    ) -> bool:
        """Whether every chunk ``data[offsets[k] : offsets[k] + sizes[k]]`` passes `check`
        (crc32c, frame size, decoded size ``nbytes``): one crc32c call per chunk, the rest for
        all chunks at once. Which one fails, and why, is `check`'s to say."""
        offsets, sizes = np.asarray(offsets, np.int64), np.asarray(sizes, np.int64)
        body = sizes - _CRC_BYTES
        if np.any(body < (_BLOSC_HEADER.size if self._compressed else 0)):
            return False
        raw = np.frombuffer(data, np.uint8)
        ends = offsets + body
        stored = raw[ends[:, None] + np.arange(_CRC_BYTES)].copy().view("<u4")[:, 0]
        if self._compressed:
            headers = raw[offsets[:, None] + np.arange(_BLOSC_HEADER.size)].copy()
            header = headers.view(_BLOSC_HEADER_FIELDS)[:, 0]
            if np.any(header["cbytes"] != body) or np.any(header["nbytes"] != nbytes):
                return False
        elif np.any(body != nbytes):
            return False
        computed = [crc32c(data[at:end]) for at, end in zip(offsets.tolist(), ends.tolist())]
        return bool(np.array_equal(np.array(computed, np.uint32), stored))

    def decode_into(
        self,
        encoded: memoryview,
        out: memoryview | np.ndarray,
        *,
        what: str,
        crc: bool = True,
        stream: bool = False,
    ) -> None:
        """Check ``encoded`` (crc32c unless ``crc`` is false, decoded size = ``len(out)``, a
        1-d byte buffer) and decode it into ``out``.

        ``stream`` writes split-zstd values around the caches, for an ``out`` this thread does
        not read again soon (a loader's batch): an ordinary store first reads each destination
        line from memory only to overwrite it. Other frames decode as without it.

        Leave the crc out only where a checksum of the decoded bytes is verified instead (a
        whole-sample read): the size and frame checks still run, and c-blosc and zstd decode
        any frame that passes them without reading or writing out of bounds (both are fuzzed
        for malformed input), so damage then surfaces as a decode error or a sample checksum
        mismatch.
        """
        nbytes = len(out)
        body = self.check(encoded, nbytes, what=what, crc=crc)
        if self._split is not None and self._split.decode_into(body, out, what=what, stream=stream):
            return
        if self._compressed:
            # `check` made sure the frame's sizes match ``body`` and ``out``, so c-blosc reads
            # and writes inside them.
            try:
                _blosc.decompress(body, out)
            except (RuntimeError, ValueError) as err:
                raise IntegrityError(f"chunk does not decode ({err})", path=what) from None
        else:
            out[:] = body


class _SplitDecoder:
    """Decodes the split-zstd frames of 2-byte values that `ChunkCodec` writes (one block, two
    streams), the way c-blosc does (a stream of the block's half size is raw, any other is one
    zstd frame of exactly that size), but with a zstd context kept per thread: c-blosc makes
    and frees one per call, which costs as much as decoding a small chunk. One
    compiled call (`decode_split_frame`, without the GIL) reads the frame, decodes its zstd
    streams into this thread's scratch and joins the two byte planes into values in one
    pass, which writes around the caches where asked to (c-blosc's unshuffle always goes
    through them).

    A frame of any other shape is left to c-blosc (`decode_into` returns False)."""

    _FLAGS = _ZSTD_FORMAT_FLAGS | _FLAG_SHUFFLE

    @staticmethod
    def _thread_state(nbytes: int) -> tuple[object, np.ndarray]:
        """This thread's zstd context and stream scratch (at least ``nbytes``), shared by every
        codec, so a reading thread holds one of each however many segments it reads."""
        state = getattr(_DECODE_STATE, "state", None)
        if state is None or state[1].nbytes < nbytes:
            context = state[0] if state is not None else _split_decoder.new_context()
            state = _DECODE_STATE.state = (context, np.empty(nbytes, np.uint8))
        return state

    def decode_into(
        self, body: memoryview, out: memoryview | np.ndarray, *, what: str, stream: bool
    ) -> bool:
        """Decode ``body`` (a frame that passed `ChunkCodec.check`) into ``out`` (around the
        caches with ``stream``); False, having written nothing, when the frame is not of the
        shape this decoder reads."""
        context, scratch = self._thread_state(len(out))
        got = _split_decoder.decode_split_frame(out, body, scratch, context, self._FLAGS,
                                                _MIN_SPLIT_BYTES, stream)  # fmt: skip
        if got < 0:
            raise IntegrityError("chunk does not decode (zstd stream)", path=what)
        return got == 1


def _with_crc(body_parts: list[bytes | memoryview]) -> list[bytes | memoryview]:
    """An encoded chunk's pieces: its body's, then the crc32c of them all."""
    crc = 0
    for part in body_parts:
        crc = crc32c(part, crc)
    return [*body_parts, struct.pack("<I", crc)]


def _worth_compressing(stream: np.ndarray, zstd: zstandard.ZstdCompressor) -> bool:
    """Whether zstd is likely to save 1/16 of ``stream``, judged on ~1 KiB spread evenly
    over it: mantissa noise is skipped for the price of a tiny probe instead of a full
    attempt, while a stream holding padding zeros or few distinct values is coded."""
    probe = np.ascontiguousarray(stream[:: max(1, stream.nbytes // _PROBE_BYTES)])
    return len(zstd.compress(probe)) < probe.nbytes - probe.nbytes // 16


def check_crc(encoded: memoryview, *, what: str) -> memoryview:
    """Strip and verify the trailing crc32c of an encoded chunk or index."""
    if len(encoded) < 4:
        raise IntegrityError("chunk is shorter than its checksum", path=what)
    body = encoded[:-4]
    (stored,) = struct.unpack("<I", encoded[-4:])
    if crc32c(body) != stored:
        raise IntegrityError("crc32c mismatch (corrupted bytes)", path=what)
    return body
