"""A killed extraction worker takes the processes its engine started with it; an interrupted
run passes the interrupt on to its workers.

SGLang's engine processes set their parent-death signal only after importing sglang, seconds
after they start (hsstore/extractors/process_group.py); one started by a worker killed before
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
from hsstore.extractors.runner import ExtractOptions, WorkerFailedError, run_extract


def engine_that_dies_leaving_a_process(pid_file: str, **_server_args):
    """Starts a long-lived process, as an engine does, then its worker is killed."""
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(300)"])
    Path(pid_file).write_text(str(child.pid))
    os.kill(os.getpid(), signal.SIGKILL)


class EngineThatWaits:
    """An engine whose forward blocks until it is interrupted, and records the interrupt."""

    def __init__(self, flag: str, **_server_args):
        self.flag = Path(flag)

    def generate(self, **_request):
        self.flag.with_suffix(".busy").write_text("")
        try:
            time.sleep(300)
        except KeyboardInterrupt:
            self.flag.write_text("interrupted")
            raise

    def shutdown(self) -> None:
        pass


def run_until_interrupted(model: str, prompts: str, out: str, flag: str) -> None:
    """The child process of the interrupt test: one SGLang worker on the engine above."""
    factory = functools.partial(EngineThatWaits, flag=flag)
    run_extract(
        ExtractOptions(model=model, data=prompts, out=out, backend="sglang", dtype="float32",
                       progress=False, backend_options={"engine_factory": factory})
    )  # fmt: skip


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


def test_an_interrupt_reaches_the_workers_in_their_own_groups(tmp_path):
    """Ctrl-C signals the terminal's foreground group, which holds the CLI but not its workers
    (each leads its own group): the runner passes it on, and the worker stops as on its own."""
    model = build_tiny_model(tmp_path / "tiny", layers=4)
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"text": "The quick brown fox."}\n')
    flag = tmp_path / "engine.flag"
    args = [str(model), str(prompts), str(tmp_path / "ds"), str(flag)]
    # Ctrl-C's disposition as in a terminal's foreground: a suite started in the background
    # (`make test &`) has SIGINT ignored, and its children would inherit that.
    code = (
        "import signal; signal.signal(signal.SIGINT, signal.default_int_handler); "
        f"import sys; sys.path.insert(0, {str(Path(__file__).parent)!r}); "
        f"import test_extract_sglang_processes as t; t.run_until_interrupted(*{args!r})"
    )
    proc = subprocess.Popen([sys.executable, "-c", code], stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 120
        while not flag.with_suffix(".busy").exists() and time.monotonic() < deadline:
            assert proc.poll() is None, proc.communicate()[1][-2000:]
            time.sleep(0.1)
        proc.send_signal(signal.SIGINT)  # to the run's own process only
        _, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode != 0 and "KeyboardInterrupt" in err, err[-2000:]
    assert flag.read_text() == "interrupted"


def test_engine_starts_on_cpu_take_turns(tmp_path):
    """While one engine starts on CPU (holding the lock) another waits: SGLang would count the
    second engine's memory against the first's profile (hsstore/extractors/backends/sglang/memory.py)."""
    from hsstore.extractors.backends.sglang.memory import engine_start_lock

    code = (
        "from hsstore.extractors.backends.sglang.memory import engine_start_lock\n"
        "print('waiting', flush=True)\n"
        "with engine_start_lock():\n"
        "    print('started', flush=True)\n"
    )
    with engine_start_lock():
        proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
        try:
            assert proc.stdout.readline() == "waiting\n"
            time.sleep(1.0)
            assert proc.poll() is None  # still waiting for the lock
        except BaseException:
            proc.kill()
            raise
    out, _ = proc.communicate(timeout=60)
    assert out == "started\n" and proc.returncode == 0
