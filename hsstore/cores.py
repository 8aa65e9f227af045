"""How many cores this process may run on: the one count every default of threads starts from."""

from __future__ import annotations

import os


def usable_cores() -> int:
    """The cores of this process's affinity mask (a container's or ``taskset``'s limit, where
    one is set), else all the machine's."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1
