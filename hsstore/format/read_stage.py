"""Reading hinted byte ranges into memory on a thread of their own, ahead of the reads that ask
for them.

A loader hands the storage the chunks of its next batch (`Storage.will_read`) before it decodes
the current one. `LocalStorage` then reads them here, in the order they were hinted, into
memory held for them, and a later read of the same range takes the bytes from there instead
of copying them out of the page cache itself: the copy leaves the decoding thread, and the
decoder finds its input freshly read, in the shared cache. What is held stays under a budget:
the stage waits for reads to take what it holds before it reads further. A read that asks for
a range the stage is reading waits for it; one the stage has not got to is dropped from the
stage and read by the caller, so no byte is read twice. The reads are taken to follow the
hints (one thread, in order: `Storage.will_read` with ``stage``), so ranges hinted before the
latest one a read asked for are skipped, or if held give way to those ahead: a batch hinted
and then abandoned holds nothing for long. Staging never changes what a read returns
(committed files do not change), and a range the stage fails to read is left to the read that
asks for it, which reports the error.
"""

from __future__ import annotations

import os
import threading
from collections import deque
from collections.abc import Callable, Sequence

import numpy as np

# What the stage holds at most: enough to stay dozens of chunks ahead of a decoder that reads a
# few hundred KiB per chunk, small beside the batch buffers a loader keeps.
STAGE_BUDGET_BYTES = 16 << 20
# Buffers are kept for reuse in sizes of this granularity: fresh memory costs a page fault per
# page on first touch, and giving it back to the system costs every core a TLB flush.
_SIZE_STEP = 64 << 10

# The stage reads while it holds less than half its budget, then up to the budget, in runs of
# ranges of one file at most this long: few wake-ups of its thread, each worth a long read.
_RUN_BYTES = 4 << 20

_Range = tuple[str, int, int]  # key, offset, bytes


class ReadStage:
    """Ranges hinted for reading, read into memory by one thread, taken by the reads."""

    def __init__(
        self,
        read: Callable[[str, list[tuple[int, int]], list[memoryview]], list[int]],
        budget_bytes: int = STAGE_BUDGET_BYTES,
    ):
        """read(key, ranges, into): fill each buffer of ``into`` from its range of ``key``,
        returning the bytes each got (fewer past the end of the file)."""
        self._read, self._budget = read, budget_bytes
        self._lock = threading.Lock()
        self._changed = threading.Condition(self._lock)
        # Every hinted range gets the next number; the reads are taken to follow the hints, so
        # a range hinted before the last one a read asked for (``_passed``) is not asked for
        # again soon: it is not read, and if held, it gives way to ranges still ahead.
        self._seq = self._passed = 0
        self._queue: deque[tuple[int, _Range]] = deque()  # may hold ranges dropped since
        self._wanted: dict[_Range, int] = {}  # hinted, not yet held or taken
        self._held: dict[_Range, tuple[int, memoryview]] = {}  # in the order read
        self._held_bytes = 0
        self._keys: dict[str, int] = {}  # ranges wanted or held per key: reads skip the rest
        self._spare: dict[int, list[np.ndarray]] = {}  # buffers given back, by size
        self._spare_bytes = 0
        self._reading: set[_Range] = set()  # the ranges the stage is reading now
        self._thread: threading.Thread | None = None
        self.pid = os.getpid()  # a stage serves the process that made it, not a forked child
        self._closed = False

    def hint(self, key: str, ranges: Sequence[tuple[int, int]]) -> None:
        """Read these ranges of ``key`` ahead, after those hinted before."""
        with self._lock:
            if self._closed:
                return
            self._start_thread()
            for offset, nbytes in ranges:
                r = (key, offset, nbytes)
                if r in self._wanted or r in self._held:
                    continue
                self._seq += 1
                self._queue.append((self._seq, r))
                self._wanted[r] = self._seq
                self._keys[key] = self._keys.get(key, 0) + 1
            self._changed.notify_all()

    @property
    def held_bytes(self) -> int:
        """Bytes read ahead and not yet taken."""
        return self._held_bytes

    def may_hold(self, key: str) -> bool:
        """Whether any range of ``key`` is hinted or held (a lock-free look: reads of keys never
        hinted go straight to the storage)."""
        return key in self._keys

    def take(self, key: str, offset: int, nbytes: int) -> memoryview | None:
        """The bytes of the range if the stage holds them, or is reading them now (they leave
        the stage); None after dropping the range from the stage: the caller reads it itself.
        Take a read's ranges one at a time, as each is needed: the stage reads on meanwhile."""
        r = (key, offset, nbytes)
        with self._lock:
            while r in self._reading:
                self._changed.wait()
            held = self._held.pop(r, None)
            if held is not None:
                self._held_bytes -= nbytes
            seq = held[0] if held is not None else self._wanted.pop(r, None)
            if seq is None:
                return None
            self._forget_key(key)
            self._passed = max(self._passed, seq)
            # Wake the stage when it has room again, or when a read found it behind (what it
            # holds from before this range may now give way).
            if held is None or self._held_bytes <= self._budget // 2:
                self._changed.notify_all()
            return None if held is None else held[1]

    def give_back(self, view: memoryview) -> None:
        """A view `take` returned, no longer used: its memory serves a later range."""
        buf = view.obj
        if not isinstance(buf, np.ndarray):
            return
        with self._lock:
            if self._closed or self._spare_bytes + buf.nbytes > self._budget:
                return
            self._spare.setdefault(buf.nbytes, []).append(buf)
            self._spare_bytes += buf.nbytes

    def close(self) -> None:
        """Stop reading ahead and let go of what is held."""
        with self._lock:
            self._closed = True
            self._queue.clear()
            self._wanted.clear()
            self._held.clear()
            self._keys.clear()
            self._spare.clear()
            self._held_bytes = self._spare_bytes = 0
            self._changed.notify_all()

    # --- the staging thread ----------------------------------------------------------------

    def _start_thread(self) -> None:
        if self._thread is None or not self._thread.is_alive():
            self._thread = threading.Thread(target=self._run, name="hsstore-stage", daemon=True)
            self._thread.start()

    def _forget_key(self, key: str) -> None:
        left = self._keys[key] - 1
        if left:
            self._keys[key] = left
        else:
            del self._keys[key]

    def _next(self) -> list[tuple[int, _Range]] | None:
        """The next ranges to read, a run of one file, once there is room (None: closed)."""
        with self._lock:
            while not self._closed:
                while self._queue:
                    seq, r = self._queue[0]
                    if self._wanted.get(r) != seq:
                        self._queue.popleft()  # taken by a read before the stage got to it
                    elif seq < self._passed:
                        self._queue.popleft()  # the reads went past it
                        del self._wanted[r]
                        self._forget_key(r[0])
                    else:
                        break
                if not self._queue:
                    self._changed.wait()
                    continue
                for r, (seq, _) in list(self._held.items()):
                    if self._held_bytes <= self._budget // 2 or seq >= self._passed:
                        break
                    del self._held[r]  # the reads went past it: room for what is ahead
                    self._held_bytes -= r[2]
                    self._forget_key(r[0])
                if self._held and self._held_bytes > self._budget // 2:
                    self._changed.wait()
                    continue
                room = max(self._budget - self._held_bytes, self._queue[0][1][2])
                run, size, key = [], 0, self._queue[0][1][0]
                while self._queue and len(run) < 256:
                    seq, r = self._queue[0]
                    if r[0] != key or size + r[2] > min(room, _RUN_BYTES) and run:
                        break
                    self._queue.popleft()
                    if self._wanted.get(r) == seq:
                        run.append((seq, r))
                        self._reading.add(r)
                        size += r[2]
                return run
        return None

    def _buffer(self, nbytes: int) -> memoryview:
        """``nbytes`` of memory, reused where a buffer of its size was given back."""
        size = -(-nbytes // _SIZE_STEP) * _SIZE_STEP
        with self._lock:
            spare = self._spare.get(size)
            buf = spare.pop() if spare else None
            if buf is not None:
                self._spare_bytes -= size
        if buf is None:
            buf = np.empty(size, np.uint8)
        return memoryview(buf)[:nbytes]

    def _run(self) -> None:
        while (run := self._next()) is not None:
            bufs = [self._buffer(r[2]) for _, r in run]
            try:
                got = self._read(run[0][1][0], [r[1:] for _, r in run], bufs)
            except OSError:  # left to the reads that ask for them
                got = [-1] * len(run)
            with self._lock:
                for (seq, r), buf, n in zip(run, bufs, got, strict=True):
                    self._reading.discard(r)
                    if self._wanted.get(r) != seq:
                        continue  # the stage was closed meanwhile
                    del self._wanted[r]
                    if n != r[2]:
                        self._forget_key(r[0])
                        continue
                    self._held[r] = (seq, buf)
                    self._held_bytes += n
                self._changed.notify_all()
