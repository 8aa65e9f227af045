"""The hsstore part of the peer benchmark runs without any peer package installed."""

from __future__ import annotations

import math

import pytest

from hsstore.codec.codecs import DEFAULT_CODEC
from tools import bench_peers


def test_hsstore_only_race_prints_its_figures(tmp_path, capsys):
    final = bench_peers.main(["--peers", "none", "--synthetic-mb", "3", "--real-samples", "6",
                              "--repeats", "1", "--workdir", str(tmp_path)])  # fmt: skip
    out = capsys.readouterr().out
    last = out.strip().splitlines()[-1]
    assert last.split() == [f"{k}={v:.2f}" for k, v in final.items()]
    assert last.startswith("ratio_vs_best_peer=nan write_vs_best_compressed_peer=nan ")
    for key in ("rand_vs_seq_small", "cold_rand_zstd_vs_none", "loader_small_vs_seq",
                "decode_gb_s_per_core"):  # fmt: skip
        assert math.isfinite(final[key]) and final[key] > 0, key
    for name in (f"hsstore {DEFAULT_CODEC} ", "hsstore blosc-zstd, format 2 layout "):
        rows = [line for line in out.splitlines() if line.startswith(name)]
        assert len(rows) == 2  # one row per data set
        assert all(float(line[len(name) :].split()[0]) > 1.2 for line in rows)  # ratio column
    one_thread = [ln for ln in out.splitlines() if ln.startswith(f"hsstore {DEFAULT_CODEC}, 1 ")]
    assert len(one_thread) == 2  # the per-sample reads decoding on the caller alone
    assert list(tmp_path.iterdir()) == []  # scratch removed


def test_unknown_peer_is_refused(capsys):
    with pytest.raises(SystemExit) as exit_info:
        bench_peers.main(["--peers", "parquet"])
    assert exit_info.value.code == 2
    assert "unknown peers ['parquet']" in capsys.readouterr().err
