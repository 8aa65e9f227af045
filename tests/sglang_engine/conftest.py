"""The SGLang lane: the real sglang 0.5.23 engine on CPU (scripts/test_sglang_lane.sh).

Collected only where sglang is importable, i.e. in the environment scripts/sglang_env.sh
builds; the main suite skips this folder without importing anything from it. Every engine runs
in a child process of the CLI, so the settings reach them through the environment:
``SGLANG_USE_CPU_ENGINE=1``, and the ``sgl_kernel`` stand-in (``stub/``) first on PYTHONPATH,
with its import and call log in a file this session reads at the end.
"""

from __future__ import annotations

import importlib.util
import os
import tempfile
from pathlib import Path

import pytest

if importlib.util.find_spec("sglang") is None:
    collect_ignore_glob = ["*"]


def pytest_configure(config):
    if importlib.util.find_spec("sglang") is None:
        return
    from lane import LOG_ENV, ROOT, STUB

    os.environ[LOG_ENV] = str(Path(tempfile.mkdtemp(prefix="hsstore-lane-")) / "sgl_kernel.log")
    os.environ["SGLANG_USE_CPU_ENGINE"] = "1"
    path = [str(STUB), str(ROOT)] + [p for p in os.environ.get("PYTHONPATH", "").split(":") if p]
    os.environ["PYTHONPATH"] = ":".join(path)


def pytest_sessionfinish(session, exitstatus):
    """However the tests were selected, a call of the stand-in fails the lane."""
    if importlib.util.find_spec("sglang") is None:
        return
    from lane import stand_in_events

    _, calls = stand_in_events()
    if calls:
        session.exitstatus = pytest.ExitCode.TESTS_FAILED
        print(f"\nthe sgl_kernel stand-in was called: {sorted(set(calls))[:10]}")


@pytest.fixture(scope="session")
def sglang_wheel_models():
    """The capture rules of the wheel's model classes (tests/sglang_wheel.py)."""
    from sglang_wheel import SGLangModels, find_wheel

    return SGLangModels(find_wheel())
