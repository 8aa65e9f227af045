"""One tqdm bar for all workers: samples, tokens/s, GB written (raw state bytes), ETA.

Workers send events ``(kind, rank, payload)``: ``plan`` once (how much they will do, which
sets the bar's total, hence the ETA) and ``written`` per stored sample. The bar counts samples
actually stored by the writer threads, not batches computed, so it never runs ahead of the
data on disk.
"""

from __future__ import annotations

import sys
import threading
import time
from typing import Any


class Progress:
    def __init__(self, *, enabled: bool, workers: int):
        self.enabled = enabled
        self.workers = workers
        self.planned: dict[int, int] = {}
        self.tokens = 0
        self.bytes = 0
        self._t0 = time.perf_counter()
        self._bar: Any = None
        self._lock = threading.Lock()  # in-process workers report from their writer thread

    def __enter__(self) -> Progress:
        if self.enabled:
            from tqdm import tqdm

            self._bar = tqdm(
                total=None,
                unit="sample",
                desc="extract",
                file=sys.stderr,
                dynamic_ncols=True,
                smoothing=0.1,
            )
        return self

    def __exit__(self, *exc: Any) -> None:
        if self._bar is not None:
            self._bar.close()

    def handle(self, event: tuple[str, int, dict[str, Any]]) -> None:
        kind, rank, payload = event
        with self._lock:
            if kind == "plan":
                self.planned[rank] = int(payload["samples"])
                if self._bar is not None:
                    self._bar.total = sum(self.planned.values())
                    self._bar.refresh()
            elif kind == "written":
                self.tokens += int(payload["tokens"])
                self.bytes += int(payload["bytes"])
                if self._bar is not None:
                    elapsed = max(time.perf_counter() - self._t0, 1e-9)
                    self._bar.set_postfix(
                        tok_s=f"{self.tokens / elapsed:,.0f}",
                        raw_GB=f"{self.bytes / 1e9:.3f}",
                        refresh=False,
                    )
                    self._bar.update(int(payload["samples"]))
