"""`hsstore demo OUT`: the whole pipeline on a built-in tiny example."""

from __future__ import annotations

import click

from hsstore.cli._common import emit_json, handle_errors


@click.command("demo")
@click.argument("out", type=click.Path(file_okay=False), default="hsstore_demo")
@click.option("--workers", type=int, default=2, show_default=True, help="Parallel extract workers.")
@click.option("--json", "as_json", is_flag=True, help="Machine-readable summary.")
@handle_errors
def command(out: str, workers: int, as_json: bool) -> None:
    """Build a tiny model, extract its states for built-in prompts, verify, inspect, export to
    speculators v1, and stream one packed batch. Runs on CPU in well under a minute."""
    from hsstore.demo import run_demo

    summary = run_demo(out, workers=workers, progress=not as_json)
    if as_json:
        emit_json(summary)
        return
    click.echo(summary.pop("inspect_report"))
    click.echo("")
    for key, value in summary.items():
        click.echo(f"{key:>16}: {value}")
