"""A long command stopped before its end says, in one line, what is kept and how to go on:
Ctrl-C (SIGINT) and SIGTERM of `hsstore extract` and `hsstore convert` (real processes, real
signals), a full disk (ENOSPC raised around the real local disk) and lost credentials mid-run
(the real object store refusing a wrong secret). The rerun of the same command resumes."""

from __future__ import annotations

import errno
import json
import os
import signal
import subprocess
import sys
import time
import warnings
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

import hsstore
import hsstore.interop.convert as convert_module
from hsstore import LayerSpec
from hsstore.cli import main
from hsstore.demo_model import build_tiny_model
from hsstore.errors import HsstoreError
from hsstore.storage.locations import open_storage
from hsstore.storage.object_store import ObjectStorage
from tests.faults import Call, Fault, FaultyStorage, Plan, sitecustomize_env
from tools.convert_fixtures import write_v1_dir
from tools.synthetic import random_sample

# Ctrl-C's disposition as in a terminal's foreground: a suite started in the background
# (`make test &`) has SIGINT ignored, and its children would inherit that.
CLI = (
    "import signal; signal.signal(signal.SIGINT, signal.default_int_handler); "
    "from hsstore.cli import main; main()"
)
SAMPLES = 60
RESUME = "rerun the same command to resume"

# Imported at the start of the interrupted process: each commit is followed by a pause (a slow
# disk), so the signal lands mid-run however fast the machine.
SLOW_COMMITS = """
import time

from hsstore.dataset.writer import Writer

_commit = Writer.commit


def _slow_commit(self, *args, **kwargs):
    published = _commit(self, *args, **kwargs)
    time.sleep(0.2)
    return published


Writer.commit = _slow_commit
"""


def _committed(path: Path) -> int:
    try:
        return len(hsstore.open(path))
    except (HsstoreError, OSError):
        return 0


@pytest.fixture(scope="module")
def sources(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("interrupted")
    write_v1_dir(root / "v1", [5 + i % 7 for i in range(SAMPLES)], layer_ids=[1, 3], hidden_size=8)
    model = build_tiny_model(root / "model")
    rows = [{"text": f"prompt number {i} about hidden states"} for i in range(SAMPLES)]
    (root / "prompts.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return {"root": root, "v1": root / "v1", "model": model, "prompts": root / "prompts.jsonl"}


def _command(name: str, sources: dict[str, Path], dest: Path) -> list[str]:
    if name == "convert":
        return ["convert", str(sources["v1"]), str(dest), "--commit-every", "2", "--no-progress"]
    return ["extract", "--model", str(sources["model"]), "--data", str(sources["prompts"]),
            "--out", str(dest), "--batch-size", "2", "--commit-every", "2", "--no-progress",
            "--device", "cpu"]  # fmt: skip


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM])
@pytest.mark.parametrize("name", ["convert", "extract"])
def test_an_interrupted_command_says_what_is_kept_and_a_rerun_resumes(sources, name, signum):
    dest = sources["root"] / f"{name}-{signum.name}"
    args = _command(name, sources, dest)
    env = sitecustomize_env(sources["root"] / "slow-hook", SLOW_COMMITS)
    proc = subprocess.Popen([sys.executable, "-c", CLI, *args], env=env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)  # fmt: skip
    deadline = time.monotonic() + 180
    while _committed(dest) == 0:
        assert proc.poll() is None, proc.communicate()[1]
        assert time.monotonic() < deadline, "nothing committed"
        time.sleep(0.1)
    proc.send_signal(signum)
    _, stderr = proc.communicate(timeout=120)
    assert proc.returncode == 128 + signum, stderr
    kept = _committed(dest)
    assert 0 < kept < SAMPLES
    lines = [line for line in stderr.splitlines() if line.strip()]
    assert lines[-1] == (
        f"interrupted ({signum.name}): {kept} samples committed in {dest} are kept; {RESUME}"
    ), stderr
    assert "Aborted!" not in stderr and "Traceback" not in stderr

    if signum == signal.SIGTERM:  # the same command, run again, stores the rest
        again = CliRunner().invoke(main, args)
        assert again.exit_code == 0, again.output
        assert _committed(dest) == SAMPLES


class FullDisk(FaultyStorage):
    """The real local disk, full from a chosen write on: ENOSPC naming the file."""

    def _error(self, call: Call, what: str) -> Exception:
        path = self.inner.path_of(call.key)
        return OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), path)


def _after_commits(commits: int, then: Callable[[Call], Fault | None]) -> Plan:
    """A plan that hands every call after the dataset's ``commits``-th sample commit (its
    creation's version is not one) to ``then``."""
    versions = [0]

    def plan(call: Call) -> Fault | None:
        if versions[0] > commits:
            return then(call)
        if call.verb == "put_if_absent" and call.key.startswith("manifests/v"):
            versions[0] += 1
        return None

    return plan


def test_a_full_disk_says_what_is_kept_and_a_rerun_resumes(sources, tmp_path, monkeypatch):
    dest = tmp_path / "ds"
    args = _command("convert", sources, dest)
    real = convert_module.open_storage
    with monkeypatch.context() as patch:
        full_disk = _after_commits(
            2, lambda call: Fault("fail") if call.verb == "write_file" else None
        )
        patch.setattr(convert_module, "open_storage", lambda loc: FullDisk(real(loc), full_disk))
        full = CliRunner().invoke(main, args)
    assert full.exit_code == 2
    kept = _committed(dest)
    assert 0 < kept < SAMPLES
    lines = full.stderr.strip().splitlines()
    assert len(lines) == 1, full.stderr
    assert lines[0].startswith(f"error: {dest}") and "no space left on device" in lines[0]
    assert (
        f"; {kept} samples committed in {dest} are kept; free some space, then {RESUME}"
        in (lines[0])
    )
    again = CliRunner().invoke(main, args)
    assert again.exit_code == 0, again.output
    assert _committed(dest) == SAMPLES


def test_credentials_lost_mid_run_say_what_is_kept(sources, remote_of, monkeypatch):
    remote = remote_of("s3")
    args = _command("convert", sources, Path("unused"))
    args[2] = remote.url
    real = convert_module.open_storage
    good = real(remote.url)
    monkeypatch.setenv(remote.secret_var, "not-the-secret")
    stale = ObjectStorage(remote.url)  # the same store, asked with a secret that is no longer good
    monkeypatch.setenv(remote.secret_var, remote.server.env()[remote.secret_var])

    def expire(call: Call) -> None:  # from now on every request goes with the stale secret
        faulty.inner = stale

    plan = _after_commits(2, expire)
    faulty = FaultyStorage(good, plan)
    with monkeypatch.context() as patch:
        patch.setattr(convert_module, "open_storage", lambda loc: faulty)
        lost = CliRunner().invoke(main, args)
    assert lost.exit_code == 2
    kept = len(hsstore.open(remote.url))
    assert 0 < kept < SAMPLES
    lines = lost.stderr.strip().splitlines()
    assert len(lines) == 1, lost.stderr
    assert "access denied" in lines[0] and "not-the-secret" not in lines[0]
    assert f"; {kept} samples committed in {remote.url} are kept; {RESUME}" in lines[0]


@pytest.mark.parametrize("at", [".committed", "manifests/_latest"])
def test_an_interrupt_inside_a_commit_never_removes_what_it_published(tmp_path, at):
    """Ctrl-C (or SIGTERM, which the CLI turns into the same interrupt) may land anywhere in
    a commit, also after its version was created: the writer's abort then leaves the
    segments to gc instead of deleting files a version references."""
    location = str(tmp_path / "ds")
    hsstore.create(location, layers=[LayerSpec(1)], hidden_size=8, dtype=torch.float32)
    created = [False]

    def plan(call: Call) -> Fault | None:
        if call.verb == "put_if_absent" and call.key.startswith("manifests/v0"):
            created[0] = True
        elif created[0] and at in call.key and call.verb in ("put", "put_if_absent"):
            raise KeyboardInterrupt  # the signal arrives here
        return None

    ds = hsstore.open(FaultyStorage(open_storage(location), plan))
    with pytest.raises(KeyboardInterrupt), ds.writer() as w:
        for i in range(3):
            w.add(f"s{i}", *random_sample(5, 1, 8, seed=i, dtype=torch.float32))
        w.commit()
    assert created[0]
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # nothing left out
        after = hsstore.open(location)
    assert after.sample_ids == ["s0", "s1", "s2"] and hsstore.verify(location).ok
