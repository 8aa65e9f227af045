"""The codec harness parses split-zstd frames the way c-blosc lays them out, and reports."""

from __future__ import annotations

import math

import numpy as np
import torch

from hsstore.codec.codecs import SPLIT_ZSTD_PARAMS, ChunkCodec, CodecConfig
from tools import bench_codec
from tools.synthetic import llm_like_states


def test_streams_of_a_frame_are_the_low_bytes_raw_and_the_exponents_coded():
    chunk = llm_like_states(32, 4, 256).view(torch.int16).numpy().copy()
    frame = b"".join(bytes(p) for p in ChunkCodec(CodecConfig("split-zstd"), 2).encode(chunk))
    low, high = bench_codec.streams_of(frame[:-4])  # without the crc32c
    assert bench_codec.FRAME_HEADER + 8 + len(low) + len(high) == len(frame) - 4
    assert low == chunk.reshape(-1).view(np.uint8)[0::2].tobytes()  # mantissa noise: raw
    assert len(high) < chunk.size // 2  # the exponent bytes: zstd-coded


def test_every_figure_is_a_rate(capsys):
    figures = bench_codec.main(["--quick", "--real-samples", "0"])
    assert list(figures) == [
        "decode_gb_s",
        "blosc_gb_s",
        "zstd_ceiling_gb_s",
        "encode_gb_s",
        "encode_vs_1024_table",
        "streamed_vs_cached_batch",
    ]
    assert all(math.isfinite(v) and v > 0 for v in figures.values())
    assert capsys.readouterr().out.strip().splitlines()[-1].startswith("decode_gb_s=")


def test_both_encoders_of_the_comparison_make_frames_that_decode_to_the_chunk():
    from numcodecs import blosc

    chunk = llm_like_states(32, 4, 256).view(torch.int16).numpy().copy()
    for params in (SPLIT_ZSTD_PARAMS, bench_codec.TABLE_1024_PARAMS):
        codec = ChunkCodec(CodecConfig("split-zstd"), 2, zstd_params=params)
        frame = b"".join(bytes(p) for p in codec.encode(chunk))
        out = np.empty(chunk.nbytes, np.uint8)
        codec.decode_into(memoryview(frame), out, what="chunk")
        assert out.tobytes() == chunk.tobytes()
        assert blosc.decompress(frame[:-4]) == chunk.tobytes()  # c-blosc alone, as zarr reads
