"""What a benchmark process and its workers hold in memory, read from ``/proc`` (Linux)."""

from __future__ import annotations

import os
import threading


def status_kb(field: str, pid: str = "self") -> int:
    """A ``kB`` field of ``/proc/PID/status`` (``VmHWM``: the peak RSS since exec)."""
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    return 0


def descendants(pid: int) -> list[int]:
    """Every process below ``pid`` (DataLoader workers and theirs)."""
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        try:
            for task in os.listdir(f"/proc/{p}/task"):
                with open(f"/proc/{p}/task/{task}/children") as f:
                    kids = [int(x) for x in f.read().split()]
                out.extend(kids)
                todo.extend(kids)
        except OSError:
            continue
    return out


class PssSampler(threading.Thread):
    """Peak of the summed PSS of this process and its workers (shared pages counted once)."""

    def __init__(self) -> None:
        super().__init__(daemon=True)
        self.peak_kb = 0
        self._stop_flag = threading.Event()

    def _sample(self) -> int:
        total = 0
        for pid in [os.getpid(), *descendants(os.getpid())]:
            try:
                with open(f"/proc/{pid}/smaps_rollup") as f:
                    for line in f:
                        if line.startswith("Pss:"):
                            total += int(line.split()[1])
                            break
            except OSError:
                continue
        return total

    def run(self) -> None:
        while not self._stop_flag.wait(0.05):
            self.peak_kb = max(self.peak_kb, self._sample())

    def stop(self) -> int:
        self._stop_flag.set()
        self.join()
        return max(self.peak_kb, self._sample())
