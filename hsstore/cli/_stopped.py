"""How a long command (extract, convert) ends when it stops before its end: one line saying
what is kept and how to go on.

Ctrl-C (SIGINT) and SIGTERM interrupt it the same way (SIGTERM is turned into the interrupt
Ctrl-C raises, so the command commits what it completed, as on Ctrl-C); a full disk and an
object store that stops answering (lost credentials, an outage) fail it. Every commit is kept
in each case, so the same command run again resumes where the last commit left off. Exit codes:
128 + the signal's number after a signal (130, 143), else 2 as for any error.
"""

from __future__ import annotations

import errno
import functools
import os
import signal
import sys
import threading
from collections.abc import Callable
from typing import Any

import click

from hsstore.cli._common import EXIT_USAGE, F
from hsstore.errors import StorageError
from hsstore.storage.object_store import UNREACHABLE

RESUME = "rerun the same command to resume"


class Terminated(KeyboardInterrupt):
    """SIGTERM, raised where Ctrl-C's interrupt would be."""


def _terminate(signum: int, frame: Any) -> None:
    raise Terminated()


def kept(dest: str, count: bool = True) -> str:
    """What of ``dest`` is kept: the samples committed there (counted when it opens, unless
    ``count`` is off: a store that cannot be reached would take its retries again)."""
    import hsstore
    from hsstore.errors import NotADatasetError

    if not count:
        return f"the samples committed to {dest} before it are kept"
    try:
        count = len(hsstore.open(dest))
    except NotADatasetError:  # an export writes files, each whole once it is there
        if os.path.isdir(dest) and os.listdir(dest):
            return f"the files written to {dest} are kept"
        return f"nothing was committed to {dest} yet"
    except Exception:  # a store that does not answer
        return f"the samples committed to {dest} before it are kept"
    return f"{count} samples committed in {dest} are kept"


def resumable(dest_of: Callable[[dict[str, Any]], str]) -> Callable[[F], F]:
    """Make a long command end with one line of what is kept and how to go on, when it is
    interrupted or the disk or the storage fails it; ``dest_of`` picks the destination from
    the command's arguments. Goes under `handle_errors`, which reports everything else."""

    def wrap(func: F) -> F:
        @functools.wraps(func)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            dest = dest_of(kwargs)
            main = threading.current_thread() is threading.main_thread()
            previous = signal.signal(signal.SIGTERM, _terminate) if main else None
            try:
                return func(*args, **kwargs)
            except KeyboardInterrupt as exc:
                signum = signal.SIGTERM if isinstance(exc, Terminated) else signal.SIGINT
                click.echo(f"interrupted ({signum.name}): {kept(dest)}; {RESUME}", err=True)
                sys.exit(128 + signum)
            except OSError as exc:
                if exc.errno != errno.ENOSPC:
                    raise
                where = f"{exc.filename}: " if exc.filename else ""
                click.echo(f"error: {where}no space left on device; {kept(dest)}; free some "
                           f"space, then {RESUME}", err=True)  # fmt: skip
                sys.exit(EXIT_USAGE)
            except StorageError as exc:
                what = kept(dest, count=UNREACHABLE not in exc.message)
                click.echo(f"error: {exc}; {what}; {RESUME} once the storage answers", err=True)
                sys.exit(EXIT_USAGE)
            finally:
                if previous is not None:
                    signal.signal(signal.SIGTERM, previous)

        return wrapper  # type: ignore[return-value]

    return wrap
