"""Stopping the loader's background threads before the interpreter tears itself down.

The producer and stager threads are daemons so that a forgotten loader never keeps a process
alive. But a daemon thread still inside a torch or numpy call when the interpreter finalizes
is terminated as it tries to take the GIL back, and unwinding its C++ frames aborts the whole
process ("terminate called without an active exception"): a training script that breaks out
of its loop and exits would die with SIGABRT now and then. Every thread owner registers here;
an ``atexit`` hook, which runs while threads can still finish their call, closes the ones
still open.
"""

from __future__ import annotations

import atexit
import contextlib
import queue
import threading
import weakref
from typing import Protocol

from hsstore import settings


class Closeable(Protocol):
    def close(self) -> None: ...


_open: weakref.WeakSet[Closeable] = weakref.WeakSet()
_lock = threading.Lock()


def close_at_exit(owner: Closeable) -> None:
    """Have ``owner.close()`` called at interpreter exit if it is still alive then."""
    with _lock:
        _open.add(owner)


def _close_all() -> None:
    with _lock:
        owners = list(_open)
    for owner in owners:
        with contextlib.suppress(Exception):
            owner.close()


atexit.register(_close_all)


# How often a thread blocked on a queue looks whether it was asked to stop.
POLL_S = 0.1


def await_stopped(thread: threading.Thread) -> None:
    """Wait, after its owner was asked to stop, for ``thread`` to leave the call it is in: a
    storage call ends within the storage's own retry timeout, and a thread still inside one
    when the interpreter finalizes could abort the process (above). Every ``close`` ends
    with this, so the exit hook's ``close`` of an owner closed earlier waits for it again."""
    if thread is not threading.current_thread():
        thread.join(timeout=settings.current().retry_timeout_s)


def put_unless_stopped(q: queue.Queue, item: object, stop: threading.Event) -> bool:
    """Put into a bounded queue, giving up (False) once ``stop`` is set."""
    while not stop.is_set():
        try:
            q.put(item, timeout=POLL_S)
            return True
        except queue.Full:
            continue
    return False
