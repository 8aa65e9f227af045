"""The batch-buffer harness runs end to end on a few real samples and cleans up after itself."""

from __future__ import annotations

import math

from tools import bench_batch_buffers


def test_every_case_reports_a_rate(tmp_path, capsys):
    rates = bench_batch_buffers.main(["--samples", "6", "--rounds", "2", "--ring", "2",
                                      "--workdir", str(tmp_path)])  # fmt: skip
    assert list(rates) == [
        "raw, one buffer",
        "raw, batch ring",
        "raw without XXH3, one buffer",
        "raw without XXH3, batch ring",
        "  + XXH3 on a thread",
        "  + XXH3 in a process",
        "read_hidden_into, one buffer",
        "read_hidden_into, batch ring",
        "read_hidden_many_into, batch ring",
        "loader",
        "loader, verify_reads=False",
    ]
    assert all(math.isfinite(r) and r > 0 for r in rates.values())
    out = capsys.readouterr().out
    assert "read_hidden_into, one buffer" in out and " 1.00x" in out  # the baseline row
    assert list(tmp_path.iterdir()) == []  # scratch removed
