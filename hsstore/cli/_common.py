"""What every subcommand shares: error reporting, exit codes and JSON output."""

from __future__ import annotations

import functools
import json
import sys
from collections.abc import Callable
from typing import Any, TypeVar

import click

from hsstore.errors import HsstoreError, NotADatasetError

EXIT_OK = 0
EXIT_CHECK_FAILED = 1  # the command ran and found a problem in the data
EXIT_USAGE = 2  # bad arguments, unreadable input, not a dataset

F = TypeVar("F", bound=Callable[..., Any])


def handle_errors(func: F) -> F:
    """Turn library and OS errors into one line on stderr and exit code 2, never a traceback."""

    @functools.wraps(func)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return func(*args, **kwargs)
        except HsstoreError as exc:
            click.echo(f"error: {exc}{_dataset_below(exc)}", err=True)
            sys.exit(EXIT_USAGE)
        except OSError as exc:
            name = f"{exc.filename}: " if exc.filename else ""
            click.echo(f"error: {name}{exc.strerror or exc}", err=True)
            sys.exit(EXIT_USAGE)

    return wrapper  # type: ignore[return-value]


def _dataset_below(exc: HsstoreError) -> str:
    """Where the dataset is, when the folder around it was named instead."""
    from hsstore.storage.locations import datasets_below

    below = datasets_below(exc.path) if isinstance(exc, NotADatasetError) and exc.path else []
    if not below:
        return ""
    more = f" (and {len(below) - 1} more below {exc.path})" if len(below) > 1 else ""
    return f"; the dataset is at {below[0]}{more}: name that folder instead"


def emit_json(obj: Any) -> None:
    """Print one JSON document on stdout (what `--json` promises scripts)."""
    click.echo(json.dumps(obj, indent=2, sort_keys=False, default=str))
