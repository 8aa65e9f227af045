"""The `hsstore` command line: a thin shell over the library.

Subcommands are imported lazily so `hsstore --help` stays fast (torch is heavy to import).
Each subcommand lives in its own module and exposes a click command named `command`.
"""

from __future__ import annotations

import importlib
import warnings
from typing import Any

import click

from hsstore import settings
from hsstore.cli._common import handle_errors
from hsstore.tuning import space_collections, tune_process

_COMMANDS: dict[str, str] = {
    "demo": "hsstore.cli.demo",
    "inspect": "hsstore.cli.inspect",
    "verify": "hsstore.cli.verify",
    "convert": "hsstore.cli.convert",
    "extract": "hsstore.cli.extract",
    "gc": "hsstore.cli.gc",
    "repair": "hsstore.cli.repair",
}


class _LazyGroup(click.Group):
    def list_commands(self, ctx: click.Context) -> list[str]:
        return sorted(_COMMANDS)

    def get_command(self, ctx: click.Context, cmd_name: str) -> click.Command | None:
        module = _COMMANDS.get(cmd_name)
        if module is None:
            return None
        return importlib.import_module(module).command


@click.group(cls=_LazyGroup)
@click.version_option(package_name="hsstore")
def main() -> None:
    """hsstore: LLM hidden states as a first-class dataset."""
    _start()
    warnings.showwarning = _one_line


@handle_errors
def _start() -> None:
    settings.current()  # a malformed HSSTORE_* variable stops every command here, named
    tune_process()  # the command line is a program of hsstore's own: its process settings apply
    space_collections()  # and so is its collector's pace (before a command's heavy imports)


_shown = warnings.showwarning


def _one_line(message: Any, category: type[Warning], *args: Any, **kwargs: Any) -> None:
    """hsstore's warnings on the command line: one line each, without Python's source line."""
    if category.__module__.startswith("hsstore"):
        click.echo(f"warning: {message}", err=True)
    else:
        _shown(message, category, *args, **kwargs)
