"""How many cores this process may run on: the one count every default of threads starts from."""

from __future__ import annotations

import os


def usable_cores() -> int:
    """The cores of this process's affinity mask (a container's or ``taskset``'s limit, where
    one is set), else all the machine's."""
    return len(usable_core_ids()) or os.cpu_count() or 1


def usable_core_ids() -> list[int]:
    """The ids of the cores in this process's affinity mask, in order; empty where the platform
    has no affinity mask (nothing to bind threads to by id)."""
    return sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []


def default_read_threads() -> int:
    """Threads one sample's read may decode on: the usable cores, at most 4 (a sample's chunks
    rarely keep more busy, and a caller running many reads at once keeps the cores busy itself).
    """
    return max(1, min(4, usable_cores()))
