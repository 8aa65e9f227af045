"""Where a compressed read's time goes: the chunk codec alone, one core, warm memory.

    python tools/bench_codec.py            # synthetic [T, 4, 2048] + MiniLM [T, 7, 384], ~100 MB
    python tools/bench_codec.py --quick

For each data set the states are cut into chunks of the aligned layout (32 rows) and encoded
with `split-zstd`; then, best of --repeats, GB/s of decoded states on one thread:

  - decode_into: what a reader pays per chunk (frame checks, crc32c, the decode: hsstore's
    own decoder of its split frames, `hsstore.codec.codecs._SplitDecoder`);
  - c-blosc: `numcodecs.blosc.decompress` alone (zstd on the exponent stream, a copy of the
    raw mantissa stream, the unshuffle);
  - exponent stream: only the zstd (Huffman) decode of the exponent bytes, counted against all the decoded bytes: the ceiling of any decoder of these
    frames, since every other step is a copy;
  - copy: a plain copy of the decoded bytes, for scale;
  - into batches, cached / streamed: decode_into without crc (as a loader decodes) into
    consecutive places of a ring of batch-sized memory far larger than the caches, with
    ordinary stores and with the stores around the caches a loader uses (``stream``).

And the encoder, GB/s of chunks on one thread and the ratio, with hsstore's zstd parameters
and with a 1024-entry match finder instead of its 512 entries (the table size the choice was
made against), timed in turn.

The last line is ``decode_gb_s=.. blosc_gb_s=.. zstd_ceiling_gb_s=.. encode_gb_s=..
encode_vs_1024_table=.. streamed_vs_cached_batch=..`` (the worse data set).
"""

from __future__ import annotations

import argparse
import ctypes
import ctypes.util
import struct
import sys
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script from anywhere

import numpy as np  # noqa: E402
import torch  # noqa: E402
from numcodecs import blosc  # noqa: E402

from hsstore.codec.codecs import SPLIT_ZSTD_PARAMS, ChunkCodec, CodecConfig  # noqa: E402
from hsstore.spec.layout import ALIGNED_MAX_ROWS  # noqa: E402
from tools.synthetic import llm_like_states  # noqa: E402
from tools.timing import best_of  # noqa: E402

FRAME_HEADER = 16 + 4  # blosc header + the one block's start offset
# The encoder's baseline: split-zstd's parameters with a 1024-entry match finder.
TABLE_1024_PARAMS = {**SPLIT_ZSTD_PARAMS, "hash_log": 10}
# The batches decoded into: several times any cache, so each place is cold when it is written.
RING_BYTES = 256 << 20
# libzstd's public API (the library the compiled decoder links), for the exponent stream alone.
_LIB = ctypes.CDLL(ctypes.util.find_library("zstd") or "libzstd.so.1")
zstd_create = _LIB.ZSTD_createDCtx
zstd_create.restype = ctypes.c_void_p
zstd_decompress = _LIB.ZSTD_decompressDCtx
zstd_decompress.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_char_p,
                            ctypes.c_size_t]  # fmt: skip
zstd_decompress.restype = ctypes.c_size_t


def chunks_of(states: torch.Tensor, rows: int) -> list[np.ndarray]:
    flat = states.view(torch.int16).numpy()
    return [flat[r : r + rows].copy() for r in range(0, flat.shape[0] - rows + 1, rows)]


def streams_of(frame: bytes) -> list[bytes]:
    """The byte streams of a one-block split frame: (length, bytes) pairs after the header."""
    out, at = [], FRAME_HEADER
    while at < len(frame):
        (n,) = struct.unpack_from("<i", frame, at)
        out.append(frame[at + 4 : at + 4 + n])
        at += 4 + n
    return out


def measure(name: str, states: torch.Tensor, repeats: int) -> dict[str, float]:
    codec = ChunkCodec(CodecConfig("split-zstd"), 2)
    chunks = chunks_of(states, ALIGNED_MAX_ROWS)
    nbytes = chunks[0].nbytes
    encoded = [b"".join(bytes(p) for p in codec.encode(c.copy())) for c in chunks]
    frames = [e[:-4] for e in encoded]
    exponent = [streams_of(f)[-1] for f in frames]  # the high bytes: the last stream
    assert all(len(e) < nbytes // 2 for e in exponent), "exponent streams are zstd-coded"
    out = np.empty(nbytes, np.uint8)
    # libzstd one-shot into a reused buffer: python-zstandard has no decompress-into.
    half = np.empty(nbytes // 2, np.uint8)
    half_at = half.ctypes.data
    dctx = zstd_create()

    def decode_into() -> None:
        for e in encoded:
            codec.decode_into(memoryview(e), out, what=name)

    def c_blosc() -> None:
        for f in frames:
            blosc.decompress(f, out)

    def exponent_stream() -> None:
        for e in exponent:
            zstd_decompress(dctx, half_at, nbytes // 2, e, len(e))

    def copy() -> None:
        for c in chunks:
            np.copyto(out, c.view(np.uint8).reshape(-1))

    ring = np.ones(RING_BYTES // nbytes * nbytes, np.uint8)  # touched now, not while timed
    places = ring.reshape(-1, nbytes)
    turn = [0]  # where the next pass starts: a pass never finds its places warm from the last

    def into_batches(stream: bool) -> Callable[[], None]:
        def decode() -> None:
            k = turn[0]
            for e in encoded:
                codec.decode_into(memoryview(e), places[k], what=name, crc=False, stream=stream)
                k = (k + 1) % len(places)
            turn[0] = k

        return decode

    total = nbytes * len(chunks)
    encoders = {
        "encode": codec,
        "encode, 1024": ChunkCodec(CodecConfig("split-zstd"), 2, zstd_params=TABLE_1024_PARAMS),
    }

    def encoding_with(encoder: ChunkCodec) -> Callable[[], None]:
        def encode() -> None:
            for c in chunks:
                encoder.encode(c)

        return encode

    encode_s = dict.fromkeys(encoders, float("inf"))
    for _ in range(repeats):  # in turn: a slow spell of a shared machine hits both alike
        for label, encoder in encoders.items():
            encode_s[label] = min(encode_s[label], best_of(encoding_with(encoder), 1))
    encoded_bytes = {
        label: sum(len(p) for c in chunks for p in encoder.encode(c))
        for label, encoder in encoders.items()
    }
    rates = {
        label: total / best_of(fn, repeats) / 1e9
        for label, fn in [
            ("decode_into", decode_into),
            ("c-blosc", c_blosc),
            ("exponent stream", exponent_stream),
            ("copy", copy),
            ("into batches, cached", into_batches(False)),
            ("into batches, streamed", into_batches(True)),
        ]
    }
    ratio = total / sum(len(e) for e in encoded)
    print(f"\n{name}: {len(chunks)} chunks of {nbytes >> 10} KiB, ratio {ratio:.3f}")
    for label, rate in rates.items():
        print(f"  {label:22s} {rate:6.2f} GB/s")
    for label, seconds in encode_s.items():
        rates[label] = total / seconds / 1e9
        print(f"  {label:22s} {rates[label]:6.2f} GB/s  ratio {total / encoded_bytes[label]:.4f}")
    return rates


def main(argv: list[str] | None = None) -> dict[str, float]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mb", type=float, default=64.0, help="synthetic data, MB")
    parser.add_argument("--real-samples", type=int, default=60)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--quick", action="store_true", help="16 MB, 15 samples, 2 repeats")
    args = parser.parse_args(argv)
    if args.quick:
        args.mb, args.real_samples, args.repeats = 16.0, 15, 2
    tokens = max(ALIGNED_MAX_ROWS, int(args.mb * 1e6 / (4 * 2048 * 2)))
    results = [measure("synthetic [T, 4, 2048]", llm_like_states(tokens, 4, 2048), args.repeats)]
    if args.real_samples:
        from tools.real_states import minilm_states

        real = torch.cat([s for _, s in minilm_states(args.real_samples, layers=tuple(range(7)))])
        results.append(measure("MiniLM [T, 7, 384]", real, args.repeats))
    figures = {
        "decode_gb_s": min(r["decode_into"] for r in results),
        "blosc_gb_s": min(r["c-blosc"] for r in results),
        "zstd_ceiling_gb_s": min(r["exponent stream"] for r in results),
        "encode_gb_s": min(r["encode"] for r in results),
        "encode_vs_1024_table": min(r["encode"] / r["encode, 1024"] for r in results),
        "streamed_vs_cached_batch": min(
            r["into batches, streamed"] / r["into batches, cached"] for r in results
        ),
    }
    print("\n" + " ".join(f"{k}={v:.2f}" for k, v in figures.items()))
    return figures


if __name__ == "__main__":
    main()
