"""The cold-read benchmark runs end to end on tiny data and prints its figures."""

from __future__ import annotations

import math

from tools import bench_cold


def test_cold_read_benchmark_prints_its_figures(tmp_path, capsys):
    final = bench_cold.main(["--synthetic-mb", "3", "--real-samples", "6", "--repeats", "1",
                             "--workdir", str(tmp_path)])  # fmt: skip
    out = capsys.readouterr().out
    last = out.strip().splitlines()[-1]
    assert last.split() == [f"{k}={v:.2f}" for k, v in final.items()]
    assert list(final) == [
        "cold_each_hint_vs_nohint_small",
        "cold_each_hint_vs_nohint_large",
        "cold_each_zstd_vs_none_small",
        "cold_each_zstd_vs_none_large",
        "cold_each_inorder_vs_allatonce_small",
        "cold_each_inorder_vs_allatonce_large",
    ]
    assert all(math.isfinite(v) and v > 0 for v in final.values())
    cases = ("split-zstd, hints", "split-zstd, hints all at once", "split-zstd, no hints",
             "none, hints", "none, no hints")  # fmt: skip
    for case in cases:
        rows = [line for line in out.splitlines() if line.startswith(case + "  ")]
        assert len(rows) == 2  # one per data set
        assert all(float(v) > 0 for line in rows for v in line[len(case) :].split())
    assert list(tmp_path.iterdir()) == []  # scratch removed
