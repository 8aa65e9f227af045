"""`hsstore repair PATH`: publish a version without the samples that cannot be read.

Exit codes: 0 when the dataset is whole (repaired or already so), 2 on usage or I/O errors.
"""

from __future__ import annotations

import click

from hsstore.cli._common import emit_json, handle_errors


@click.command("repair")
@click.argument("path", type=str)
@click.option("--workers", type=click.IntRange(min=1), default=None,
              help="Parallel readers for the check (default: one per core).")  # fmt: skip
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
@handle_errors
def command(path: str, workers: int | None, as_json: bool) -> None:
    """List again what lost versions committed, rewrite what still reads of damaged segments
    and drop the rest, recording every decision in the new version's provenance."""
    import hsstore

    report = hsstore.repair(path, workers=workers)
    if as_json:
        emit_json(report.__dict__)
        return
    for name in report.files_restored:
        click.echo(f"wrote back {name}")
    if report.version is None:
        hint = " (the version hint was rewritten)" if report.hint_rewritten else ""
        whole = "made whole" if report.files_restored else "nothing to repair in"
        click.echo(f"{whole} {report.path}{hint}")
        return
    click.echo(f"published version {report.version} of {report.path}")
    for r in report.repairs:
        seg = f" segment {r['segment']}" if "segment" in r else ""
        ids = f" ({len(r['sample_ids'])} sample ids recorded)" if r["sample_ids"] else ""
        click.echo(f"  {r['action']}{seg}: {r['num_samples']} samples{ids}: {r['reason']}")
    click.echo(f"  {report.samples_rewritten} samples that still read were written again")
