"""A killed extraction worker takes the processes its engine started with it.

SGLang's engine processes set their parent-death signal only after importing sglang, seconds
after they start (hsstore/extract/process_group.py); one started by a worker killed before
that runs on. The engine here starts such a process (it never sets a parent-death signal) and
then the worker is killed: the runner must end it with the worker's process group. The real
engine's case is tests/sglang_engine/test_engine_workers.py.
"""

from __future__ import annotations

import functools
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from hsstore.demo_model import build_tiny_model
from hsstore.extract.runner import ExtractOptions, WorkerFailedError, run_extract


def engine_that_dies_leaving_a_process(pid_file: str, **_server_args):
    """Starts a long-lived process, as an engine does, then its worker is killed."""
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(300)"])
    Path(pid_file).write_text(str(child.pid))
    os.kill(os.getpid(), signal.SIGKILL)


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return False
    return state != "Z"


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="reads /proc")
def test_a_killed_worker_takes_its_engine_processes_with_it(tmp_path):
    model = build_tiny_model(tmp_path / "tiny", layers=4)
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"text": "The quick brown fox."}\n')
    pid_file = tmp_path / "engine.pid"
    opts = ExtractOptions(
        model=str(model),
        data=str(prompts),
        out=str(tmp_path / "ds"),
        backend="sglang",
        dtype="float32",
        progress=False,
        backend_options={
            "engine_factory": functools.partial(
                engine_that_dies_leaving_a_process, pid_file=str(pid_file)
            )
        },
    )
    with pytest.raises(WorkerFailedError, match=r"died \(exit code -9\)"):
        run_extract(opts)
    pid = int(pid_file.read_text())
    deadline = time.monotonic() + 10
    while alive(pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    if alive(pid):
        os.kill(pid, signal.SIGKILL)
        pytest.fail("the killed worker's engine process outlived it")
