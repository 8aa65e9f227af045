"""Fault injection around the real storage backends.

`FaultyStorage` wraps a real `LocalStorage` or `ObjectStorage` (the real backend does every
piece of work underneath) and, at any call a test chooses, can:

- ``fail``: raise before the call reaches the backend (nothing happened);
- ``lose``: let the call take effect, then raise as a dropped connection would (the caller
  cannot tell whether it happened);
- ``resend``: let the call take effect twice and return the second answer, as a client that
  retries after a lost reply does (a conditional create then sees its own object: 412);
- ``delay``: sleep before the call;
- ``pause``: block the caller until the test releases it (a GC pause, a SIGSTOP);
- ``outage``: lose this reply, then fail every call for a while (`seeded` only).

`clock_shift` moves the process's wall clock (``time.time``), standing in for a machine whose
clock runs ahead or behind. Which call gets which fault is decided by a function of the call
(`Call`), so a test names an exact point, and the explorer draws them from a seeded generator.
"""

from __future__ import annotations

import contextlib
import errno
import os
import random
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hsstore.errors import StorageError
from hsstore.storage.object_store import ObjectStorage
from hsstore.storage.store import ObjectInfo, Storage

KINDS = ("fail", "lose", "resend", "delay", "pause", "outage")


class InjectedFault(OSError):
    """What a local backend raises for an injected fault (an I/O error naming the file)."""


class InjectedStorageFault(StorageError):
    """What an object-store backend raises for an injected fault (as a dropped connection)."""


@dataclass(frozen=True)
class Call:
    verb: str
    key: str
    n: int  # the how-many-th call of this storage object


@dataclass
class Fault:
    kind: str
    seconds: float = 0.0  # delay
    release: threading.Event | None = None  # pause: blocks until set
    reached: threading.Event | None = None  # pause: set when the caller is blocked


@dataclass
class Tally:
    """Faults injected, by kind (the explorer reports these)."""

    counts: dict[str, int] = field(default_factory=lambda: dict.fromkeys(KINDS, 0))
    lock: threading.Lock = field(default_factory=threading.Lock)

    def add(self, kind: str) -> None:
        with self.lock:
            self.counts[kind] += 1


Plan = Callable[[Call], Fault | None]


def _verb(name: str) -> Callable[..., Any]:
    def call(self: FaultyStorage, key: str, *args: Any, **kwargs: Any) -> Any:
        return self._run(name, key, lambda: getattr(self.inner, name)(key, *args, **kwargs))

    call.__name__ = name
    return call


class FaultyStorage(Storage):
    """A real storage with faults at the calls ``plan`` picks (None: no fault)."""

    def __init__(self, inner: Storage, plan: Plan | None = None, *, tally: Tally | None = None):
        self.inner = inner
        self.root = inner.root
        self.clock_resolution_s = inner.clock_resolution_s
        self.worker_start_method = inner.worker_start_method
        self.plan = plan
        self.tally = tally or Tally()
        self._n = 0
        self._lock = threading.Lock()
        # An object store's client resends any request whose reply it lost; a local
        # filesystem call is never sent twice, but the verbs whose object-store twin resends
        # are modelled the same way.
        self._resendable = ("put", "put_if_absent", "delete") + (
            ("write_file",) if isinstance(inner, ObjectStorage) else ()
        )

    def _error(self, call: Call, what: str) -> Exception:
        if isinstance(self.inner, ObjectStorage):
            return InjectedStorageFault(
                f"cannot reach the storage endpoint ({what}, injected)",
                path=self.inner.path_of(call.key),
            )
        return InjectedFault(errno.EIO, f"{what} (injected)", self.inner.path_of(call.key))

    def _run(self, verb: str, key: str, do: Callable[[], Any]) -> Any:
        with self._lock:
            self._n += 1
            call = Call(verb, key, self._n)
        fault = self.plan(call) if self.plan is not None else None
        if fault is None:
            return do()
        self.tally.add(fault.kind)
        if fault.kind == "fail":
            raise self._error(call, "request failed before it was sent")
        if fault.kind == "delay":
            time.sleep(fault.seconds)
            return do()
        if fault.kind == "pause":
            if fault.reached is not None:
                fault.reached.set()
            if fault.release is not None:
                fault.release.wait(fault.seconds or 30)
            else:
                time.sleep(fault.seconds)
            return do()
        result = do()
        if fault.kind in ("lose", "outage"):  # an outage starts with the reply in flight
            raise self._error(call, "reply lost after the request took effect")
        if fault.kind == "resend" and verb in self._resendable:
            return do()
        return result

    read_bytes = _verb("read_bytes")

    def read_ranges(self, key: str, ranges: Any, into: Any = None) -> Iterator[memoryview]:
        # Taken whole inside the call, so a fault lands where the request would fail; copied,
        # since a backend may reuse a view's memory for the next range.
        def read() -> list[memoryview]:
            views = self.inner.read_ranges(key, ranges, into)
            return list(views) if into is not None else [memoryview(bytes(v)) for v in views]

        return iter(self._run("read_ranges", key, read))

    size = _verb("size")
    exists = _verb("exists")

    def write_file(self, key: str, pieces: Iterable[bytes | memoryview]) -> int:
        parts = [bytes(p) for p in pieces]  # a resend sends the same bytes again
        return self._run("write_file", key, lambda: self.inner.write_file(key, parts))

    put_if_absent = _verb("put_if_absent")
    put = _verb("put")
    stat = _verb("stat")
    delete = _verb("delete")
    delete_tree = _verb("delete_tree")

    def list(self, prefix: str) -> list[str]:
        return self._run("list", prefix, lambda: self.inner.list(prefix))

    def walk(self, prefix: str) -> Iterator[ObjectInfo]:
        return iter(self._run("walk", prefix, lambda: list(self.inner.walk(prefix))))

    def sync(self, keys: Iterable[str]) -> None:
        keys = list(keys)
        self._run("sync", keys[0] if keys else "", lambda: self.inner.sync(keys))

    def check_root(self) -> None:
        self.inner.check_root()

    def close(self) -> None:
        self.inner.close()

    # `now` is the base class's probe (a put, a stat and a delete): each can be faulted.


def at(verb: str, key_part: str, fault: Fault, *, times: int = 1) -> Plan:
    """A plan that faults the first ``times`` calls of ``verb`` on a key containing
    ``key_part``."""
    left = [times]
    lock = threading.Lock()

    def plan(call: Call) -> Fault | None:
        if call.verb != verb or key_part not in call.key:
            return None
        with lock:
            if left[0] <= 0:
                return None
            left[0] -= 1
        return fault

    return plan


def seeded(rng: random.Random, rate: float, *, pause_s: float = 0.05) -> Plan:
    """A plan drawing a fault for a ``rate`` share of calls: fail, lose, resend, delay, short
    pauses (pauses longer than a lease's ttl are how gc comes to judge a live writer dead), and
    outages (every call fails for up to ``pause_s``: an outcome may then stay unknown)."""
    lock = threading.Lock()
    outage_until = [0.0]

    def plan(call: Call) -> Fault | None:
        with lock:
            if time.monotonic() < outage_until[0]:
                return Fault("fail")
            if rng.random() >= rate:
                return None
            kind = rng.choice(KINDS)
            seconds = rng.uniform(0, pause_s)
            if kind == "outage":
                outage_until[0] = time.monotonic() + seconds
                return Fault("outage")
        if kind in ("delay", "pause"):
            return Fault(kind, seconds=seconds)
        return Fault(kind)

    return plan


_real_time = time.time


@contextlib.contextmanager
def clock_shift(seconds: float) -> Iterator[None]:
    """This process's wall clock runs ``seconds`` ahead (behind, if negative) meanwhile."""
    time.time = lambda: _real_time() + seconds  # type: ignore[assignment]
    try:
        yield
    finally:
        time.time = _real_time  # type: ignore[assignment]


def faketime_env(seconds: float, env: dict[str, str] | None = None) -> dict[str, str]:
    """The environment of a child process whose wall clock (and every clock it reads:
    ``time.time``, the clocks of obstore's Rust code, request signatures) runs ``seconds`` ahead
    (behind, if negative), by libfaketime's preload library, which the dev extra installs
    (the PyPI package ``libfaketime`` bundles it). File times stay the kernel's: as on a
    machine whose clock is off, the storage stamps what it stores with its own clock."""
    import importlib.util

    spec = importlib.util.find_spec("libfaketime")
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError("libfaketime is not installed: run scripts/install.sh (dev extra)")
    lib = f"{spec.submodule_search_locations[0]}/vendor/libfaketime/src/libfaketime.so.1"
    out = dict(os.environ if env is None else env)
    out["LD_PRELOAD"] = lib + (":" + out["LD_PRELOAD"] if out.get("LD_PRELOAD") else "")
    out["FAKETIME"] = f"{seconds:+g}s"
    return out


def sitecustomize_env(
    folder: Path, source: str, env: dict[str, str] | None = None
) -> dict[str, str]:
    """The environment of a child Python whose start-up runs ``source`` (written to
    ``folder``/sitecustomize.py, ``folder`` put first on its PYTHONPATH): how a test stalls a
    real CLI or trainer process at a chosen point without a seam in the code it runs."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "sitecustomize.py").write_text(source)
    out = dict(os.environ if env is None else env)
    out["PYTHONPATH"] = os.pathsep.join(p for p in (str(folder), out.get("PYTHONPATH")) if p)
    return out


def stopped_at(
    inner: Storage,
    verb: str,
    key_part: str,
    run: Callable[[Storage], Any],
    meanwhile: Callable[[], None],
) -> Any:
    """``run(storage)`` (``inner`` wrapped) on a thread, stopped at its first ``verb`` call on a
    key containing ``key_part`` while ``meanwhile()`` runs here; returns what ``run`` returned
    (or raises what it raised)."""
    reached, release = threading.Event(), threading.Event()
    faulty = FaultyStorage(
        inner, at(verb, key_part, Fault("pause", release=release, reached=reached))
    )
    result: dict[str, Any] = {}

    def target() -> None:
        try:
            result["value"] = run(faulty)
        except BaseException as exc:  # noqa: BLE001 - handed to the caller
            result["error"] = exc

    thread = threading.Thread(target=target)
    thread.start()
    try:
        assert reached.wait(30), f"never reached {verb} {key_part}"
        meanwhile()
    finally:
        release.set()
        thread.join(60)
    if "error" in result:
        raise result["error"]
    return result["value"]
