"""A convert killed with SIGKILL mid-run resumes to exactly the dataset a clean run gives."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest
import torch

import hsstore
from hsstore.errors import HsstoreError
from tools.convert_fixtures import write_v1_dir

CLI = "from hsstore.cli import main; main()"


def _committed(path) -> int:
    try:
        return len(hsstore.open(path))
    except (HsstoreError, OSError):
        return 0


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="needs a FIFO to hold the writer mid-run")
def test_kill_9_then_rerun_equals_a_clean_run(tmp_path):
    src, ds, clean = tmp_path / "v1", tmp_path / "ds", tmp_path / "clean"
    lengths = [3, 9, 1, 40, 7, 12, 5, 8]
    write_v1_dir(src, lengths, layer_ids=[1, 3], hidden_size=8)
    # data_5.pt becomes a FIFO: reading it blocks, so the run commits data_0..4 and then hangs.
    real5 = (src / "data_5.pt").read_bytes()
    (src / "data_5.pt").unlink()
    os.mkfifo(src / "data_5.pt")
    cmd = [
        sys.executable,
        "-c",
        CLI,
        "convert",
        str(src),
        str(ds),
        "--commit-every",
        "2",
        "--no-progress",
    ]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        deadline = time.monotonic() + 120
        while _committed(ds) < 4:
            assert proc.poll() is None, proc.stderr.read().decode()
            assert time.monotonic() < deadline, "writer never committed"
            time.sleep(0.2)
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    partial = hsstore.open(ds)
    assert 4 <= len(partial) < len(lengths)
    assert partial.sample_ids == [f"data_{i}" for i in range(len(partial))]

    (src / "data_5.pt").unlink()
    (src / "data_5.pt").write_bytes(real5)
    r = subprocess.run([*cmd[:-1], "--json"], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    subprocess.run(
        [sys.executable, "-c", CLI, "convert", str(src), str(clean), "--no-progress"], check=True
    )

    a, b = hsstore.open(ds), hsstore.open(clean)
    assert a.sample_ids == b.sample_ids == [f"data_{i}" for i in range(len(lengths))]
    assert a.index.column("checksum").to_pylist() == b.index.column("checksum").to_pylist()
    for x, y in zip(a, b):
        assert torch.equal(x.hidden.view(torch.int16), y.hidden.view(torch.int16))
        assert torch.equal(x.input_ids, y.input_ids) and torch.equal(x.loss_mask, y.loss_mask)
    assert hsstore.verify(ds).ok
    hsstore.gc(ds)  # the killed writer's debris goes; the data stays
    assert len(hsstore.open(ds)) == len(lengths)
