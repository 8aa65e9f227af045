"""`hsstore gc PATH`: remove debris left by crashed writers."""

from __future__ import annotations

import click

from hsstore.cli._common import emit_json, handle_errors


@click.command("gc")
@click.argument("path", type=str)
@click.option(
    "--keep-versions",
    type=int,
    default=None,
    help="Also prune manifest versions older than the newest N.",
)
@click.option(
    "--grace",
    type=float,
    default=60.0,
    show_default=True,
    help="Seconds an unreferenced segment must sit untouched (and unleased) before removal.",
)
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
@handle_errors
def command(path: str, keep_versions: int | None, grace: float, as_json: bool) -> None:
    """Remove uncommitted segments whose writer is gone; never touches committed data."""
    import hsstore

    report = hsstore.gc(path, keep_versions=keep_versions, grace_s=grace)
    if as_json:
        emit_json(report.__dict__)
        return
    click.echo(f"removed {len(report.removed_segments)} debris segment(s), "
               f"{len(report.removed_files)} temp file(s), pruned {len(report.pruned_manifests)} "
               f"manifest version(s); {len(report.live_segments)} segment(s) held by live writers")  # fmt: skip
