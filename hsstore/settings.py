"""The settings hsstore reads from the environment, all in one place (docs/API.md, "Settings").

`current()` parses every ``HSSTORE_*`` variable into one frozen `Settings`; modules ask for it
where they use a value (when a writer, a storage or an engine is made), never at import, so a
variable set before that point takes effect. A malformed value is one clear error naming the
variable, what it holds and what it takes.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TypeVar

from hsstore.errors import HsstoreError

_T = TypeVar("_T")


class SettingsError(HsstoreError):
    """An ``HSSTORE_*`` environment variable holds a value hsstore cannot use."""


@dataclass(frozen=True)
class Settings:
    """Every ``HSSTORE_*`` variable, parsed; the defaults are what an unset variable means."""

    # Seconds a writer keeps asking whether a create whose outcome it never learned happened,
    # before `CommitUnknownError` (HSSTORE_RESOLVE_TIMEOUT).
    resolve_timeout_s: float = 300.0
    # Seconds a segment lease outlives its last heartbeat, for every writer of the process
    # (HSSTORE_LEASE_TTL); gc reads each lease's own ttl from the lease.
    lease_ttl_s: float = 60.0
    # Attempts per object-storage request and the seconds they may take in all
    # (HSSTORE_STORAGE_RETRIES, HSSTORE_RETRY_TIMEOUT).
    storage_retries: int = 6
    retry_timeout_s: float = 60.0
    # A local folder that keeps copies of segment files read from an object store, and its
    # bound in bytes (HSSTORE_CACHE_DIR, HSSTORE_CACHE_BYTES).
    cache_dir: str | None = None
    cache_bytes: int = 64 << 30
    # Whether `hsstore.tuning.tune_process` may raise glibc's malloc thresholds
    # (HSSTORE_MALLOC_TUNING=0 says no).
    malloc_tuning: bool = True
    # Decode and hash through numcodecs, zstandard and xxhash's Python APIs even where the
    # compiled modules are built (HSSTORE_NO_FAST_DECODE=1).
    no_fast_decode: bool = False
    # Write large local files (shards) around the page cache, where the file system allows
    # it (HSSTORE_DIRECT_WRITES=0 says no: every write goes through the page cache).
    direct_writes: bool = True
    # The SGLang backend: run a release it was not checked against (HSSTORE_SGLANG_UNTESTED=1),
    # and how hidden states come back from the engine (HSSTORE_SGLANG_CAPTURE: shm or lists;
    # unset: the backend's default).
    sglang_untested: bool = False
    sglang_capture: str | None = None


def current(environ: Mapping[str, str] | None = None) -> Settings:
    """The settings ``environ`` (default: the process's environment) holds now."""
    env = os.environ if environ is None else environ
    return Settings(
        resolve_timeout_s=_read(env, "HSSTORE_RESOLVE_TIMEOUT", _seconds, 300.0),
        lease_ttl_s=_read(env, "HSSTORE_LEASE_TTL", _seconds, 60.0),
        storage_retries=_read(env, "HSSTORE_STORAGE_RETRIES", _whole(0), 6),
        retry_timeout_s=_read(env, "HSSTORE_RETRY_TIMEOUT", _seconds, 60.0),
        cache_dir=env.get("HSSTORE_CACHE_DIR") or None,
        cache_bytes=_read(env, "HSSTORE_CACHE_BYTES", _whole(1), 64 << 30),
        malloc_tuning=_read(env, "HSSTORE_MALLOC_TUNING", _switch, True),
        no_fast_decode=_read(env, "HSSTORE_NO_FAST_DECODE", _switch, False),
        direct_writes=_read(env, "HSSTORE_DIRECT_WRITES", _switch, True),
        sglang_untested=_read(env, "HSSTORE_SGLANG_UNTESTED", _switch, False),
        sglang_capture=env.get("HSSTORE_SGLANG_CAPTURE") or None,
    )


def _read(env: Mapping[str, str], name: str, parse: Callable[[str], _T], default: _T) -> _T:
    text = env.get(name, "").strip()
    if not text:
        return default
    try:
        return parse(text)
    except ValueError as err:
        raise SettingsError(f"{name}={text!r}: {err}; unset it or fix the value") from None


def _seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = float("nan")
    if not value > 0:
        raise ValueError("takes a number of seconds above 0")
    return value


def _whole(minimum: int) -> Callable[[str], int]:
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            value = minimum - 1
        if value < minimum:
            raise ValueError(f"takes a whole number of at least {minimum}")
        return value

    return parse


def _switch(text: str) -> bool:
    if text not in ("0", "1"):
        raise ValueError("takes 0 or 1")
    return text == "1"
