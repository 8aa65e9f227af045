"""`hsstore verify PATH`: full integrity scan (every checksum, every committed file).

Exit codes: 0 when everything checks out, 1 on any corruption, 2 on usage or I/O errors
(missing path, not a dataset).
"""

from __future__ import annotations

import sys
import threading
import warnings

import click

from hsstore.cli._common import EXIT_CHECK_FAILED, EXIT_OK, emit_json, handle_errors

SCHEMA_ID = "hsstore.verify/1"
SHOW_SAMPLES = 8


def _progress_bar(enabled: bool | None):
    """A thread-safe (bytes done, bytes total) callback driving a tqdm bar, and the bar."""
    from tqdm import tqdm

    bar = tqdm(
        desc="verify", unit="B", unit_scale=True, disable=None if enabled is None else not enabled
    )
    lock = threading.Lock()

    def progress(done: int, total: int) -> None:
        with lock:
            if bar.total != total:
                bar.total = total
            bar.update(done - bar.n)

    return bar, progress


def _text(report) -> str:
    lines = [
        f"hsstore verify {report.path}" + (f" (version {report.version})" if report.version else "")
    ]
    lines.append(
        f"  checked {report.files_checked} files and {report.samples_checked:,} samples, "
        f"{report.bytes_read / 1e9:.3f} GB in {report.seconds:.2f} s ({report.gb_per_s:.2f} GB/s)"
    )
    if report.history:
        lines.append(f"  manifests: {report.history}")
    lines += [f"  note: {note}" for note in report.notes]
    for seg_id, why in report.unreadable_segments.items():
        lines.append(f"  UNREADABLE segment {seg_id}: {why}")
    for p in report.problems:
        ids = ""
        if p.sample_ids:
            more = (
                f" (+{len(p.sample_ids) - SHOW_SAMPLES} more)"
                if len(p.sample_ids) > SHOW_SAMPLES
                else ""
            )
            ids = f"; samples {', '.join(p.sample_ids[:SHOW_SAMPLES])}{more}"
        lines.append(f"  BAD {p.kind:<8} {p.where}: {p.reason}{ids}")
    bad = report.bad_samples
    if bad:
        lines.append(f"  bad samples ({len(bad)}):")
        lines += [f"    {sid}: {why}" for sid, why in bad.items()]
    verdict = (
        "OK" if report.ok else f"CORRUPT ({len(report.problems)} problems, {len(bad)} bad samples)"
    )
    lines.append(f"verdict: {verdict}")
    return "\n".join(lines)


@click.command(name="verify")
@click.argument("path", type=click.Path(path_type=str))
@click.option("--workers", type=click.IntRange(min=1), default=None,
              help="Parallel readers (default: one per core).")  # fmt: skip
@click.option("--full", is_flag=True,
              help="Also read every older version file and checkpoint (the whole history and "
                   "its hash chain), not only the files that make the latest version.")  # fmt: skip
@click.option("--json", "as_json", is_flag=True, help="Print the report as JSON.")
@handle_errors
def command(path: str, workers: int | None, full: bool, as_json: bool) -> None:
    """Re-read everything committed in PATH and check every checksum.

    Of the manifests it reads those that make the latest version (its checkpoint and the
    deltas after it); --full reads the whole history."""
    import hsstore
    from hsstore.dataset.segment_set import DamageWarning
    from hsstore.errors import HsstoreError, NotADatasetError

    try:
        with warnings.catch_warnings():  # the report below says what is damaged
            warnings.simplefilter("ignore", DamageWarning)
            hsstore.open(path)  # tells "not a dataset" (usage error) from a damaged one
    except NotADatasetError:
        raise
    except HsstoreError:
        pass  # damaged: verify reports exactly what is wrong
    bar, progress = _progress_bar(None)
    try:
        report = hsstore.verify(path, workers=workers, progress=progress, full=full)
    finally:
        bar.close()
    if as_json:
        emit_json({"schema": SCHEMA_ID, **report.to_json()})
    else:
        click.echo(_text(report))
    sys.exit(EXIT_OK if report.ok else EXIT_CHECK_FAILED)
