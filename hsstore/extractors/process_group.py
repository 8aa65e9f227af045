"""A spawned extraction worker and every process it starts live and die as one process group.

An SGLang engine runs in processes the worker spawns (scheduler and detokenizer; sglang 0.5.23
``srt/entrypoints/engine.py:894`` ``_launch_scheduler_processes`` and ``:1042``
``_launch_detokenizer_subprocesses``, started with the spawn method, ``:1995``). Each asks the
kernel to kill it when its parent dies, but only in the first line of its entry function
(``srt/managers/scheduler.py:6269``, ``srt/managers/detokenizer_manager.py:550``, calling
``srt/utils/common.py:3432`` ``kill_itself_when_parent_died``), which a spawned child reaches only
after importing sglang, seconds after it starts. A worker killed in that window leaves them
running for ever, holding the CLI's stdout and stderr, so whoever waits for the CLI waits for
ever. None of SGLang's processes leaves its process group (nothing in ``srt/`` calls setsid or
setpgid), so the worker leads a group of its own before it starts anything, and the runner kills
that whole group once the worker has ended, however it ended.
"""

from __future__ import annotations

import contextlib
import os
import signal
import time
from collections.abc import Sequence
from typing import Any


def lead_own_group() -> None:
    """Make this process the leader of a new process group; call it before any child starts."""
    with contextlib.suppress(AttributeError, OSError):
        os.setpgid(0, 0)


def leads_own_group() -> bool:
    return hasattr(os, "getpgrp") and os.getpgrp() == os.getpid()


def die_with_group(code: int) -> None:
    """End this process and, when it leads its own group, everything it started."""
    if leads_own_group():
        os.killpg(0, signal.SIGKILL)
    os._exit(code)


def exited(proc: Any) -> bool:
    """Whether a multiprocessing child has exited, without reaping it where the platform allows:
    an unreaped child keeps its pid, and so its group id, from being reused, so its group can
    still be killed safely."""
    if not hasattr(os, "waitid"):
        return not proc.is_alive()
    try:
        return os.waitid(os.P_PID, proc.pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is not None
    except ChildProcessError:  # reaped already
        return True


def wait_exited(procs: Sequence[Any], timeout: float | None) -> None:
    """Wait until every process in ``procs`` has exited (see :func:`exited`), or ``timeout``."""
    deadline = None if timeout is None else time.monotonic() + timeout
    while not all(exited(p) for p in procs):
        if deadline is not None and time.monotonic() >= deadline:
            return
        time.sleep(0.05)


def signal_group(pid: int, signum: int) -> None:
    """Send ``signum`` to the group that ``pid`` leads (nothing if it leads none)."""
    with contextlib.suppress(ProcessLookupError, PermissionError, AttributeError):
        os.killpg(pid, signum)


def end_group(proc: Any) -> None:
    """Kill what is left of the group a multiprocessing worker led, the worker too if it still
    runs, then reap it. Call it once per worker: once reaped, its pid may name another process."""
    signal_group(proc.pid, signal.SIGKILL)
    proc.join()
