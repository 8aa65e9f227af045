"""`hsstore convert SRC DST`: foreign hidden states into hsstore, or an hsstore dataset out.

An hsstore dataset (DST of an import, SRC of an export) may be a URL (s3://, gs://, az://).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import click

from hsstore.cli._common import emit_json, handle_errors
from hsstore.cli._stopped import resumable
from hsstore.codec.codecs import CODEC_NAMES, DEFAULT_CODEC
from hsstore.interop.formats import ALL_FORMATS, EXPORT_FORMATS, FORMATS, HSSTORE, FormatOption


def _parse_ids(value: str | None) -> list[int] | None:
    if value is None:
        return None
    try:
        return [int(v) for v in value.replace(",", " ").split()]
    except ValueError:
        raise click.BadParameter(f"expected integers like 2,16,29,31, got {value!r}") from None


def _format_options(command: Callable) -> Callable:
    """Each format's own flags, as its module declares them (``--to X:``/``--from X:`` in help).

    An option two formats share is one flag whose help names both.
    """
    scopes: dict[str, list[str]] = {}
    options: dict[str, FormatOption] = {}
    for f in FORMATS.values():
        for direction, owned in (("from", f.reader_options), ("to", f.writer_options)):
            for option in owned:
                scopes.setdefault(option.name, []).append(f"--{direction} {f.name}")
                options.setdefault(option.name, option)
    for name, option in reversed(options.items()):
        kind: dict[str, Any] = (
            {"is_flag": True} if option.is_flag else {"type": click.Path(path_type=Path)}
        )
        help_text = f"{', '.join(scopes[name])}: {option.help}"
        command = click.option(option.flag, name, help=help_text, **kind)(command)
    return command


@click.command("convert")
@click.argument("src", type=str)
@click.argument("dst", type=str)
@click.option(
    "--from",
    "src_format",
    type=click.Choice(ALL_FORMATS),
    help="Source format (default: detected).",
)
@click.option(
    "--to",
    "dst_format",
    type=click.Choice((HSSTORE, *EXPORT_FORMATS)),
    help="Target format (default: hsstore, or speculators-v1 when SRC is an hsstore dataset "
    "and no --tier is given).",
)
@_format_options
@click.option(
    "--layer-ids",
    help="Source layer ids in the source's own convention, e.g. 2,16,29,31. Required when the "
    "source does not record them (v1 without data_config.json, SpecForge, speculators 0.5+).",
)
@click.option("--num-hidden-layers", type=int, help="Decoder layers of the target model.")
@click.option("--model", "model_name", help="Target model name to record in the manifest.")
@click.option(
    "--codec",
    type=click.Choice(CODEC_NAMES),
    help=f"Codec of a new dataset (default: {DEFAULT_CODEC}, lossless).",
)
@click.option(
    "--tier",
    help="Lossy tier of the new dataset: lossless (default), fp8-token, fp8-token-layer, "
    "bf16-m0..bf16-m6 or bf16-mK-final-mJ (docs/CONVERT.md, Lossy tiers). With an hsstore dataset as SRC (and no "
    "--to), re-encodes it into a new dataset at DST.",
)
@click.option(
    "--workers",
    type=click.IntRange(min=1),
    help="Reader threads (default: one per core, at most 8).",
)
@click.option(
    "--commit-every",
    type=click.IntRange(min=1),
    default=1000,
    show_default=True,
    help="Commit after this many samples.",
)
@click.option(
    "--commit-gb",
    type=click.FloatRange(min=0, min_open=True),
    default=1.0,
    show_default=True,
    help="...or this many GB of states.",
)
@click.option(
    "--on-error",
    type=click.Choice(("fail", "skip")),
    default="fail",
    show_default=True,
    help="fail: list every bad file, then exit 2; skip: leave them out and record them.",
)
@click.option("--progress/--no-progress", default=True, show_default=True)
@click.option("--json", "as_json", is_flag=True, help="Print a JSON summary on stdout.")
@handle_errors
@resumable(lambda given: given["dst"])
def command(
    src: str,
    dst: str,
    src_format: str | None,
    dst_format: str | None,
    layer_ids: str | None,
    num_hidden_layers: int | None,
    model_name: str | None,
    codec: str | None,
    tier: str | None,
    workers: int | None,
    commit_every: int,
    commit_gb: float,
    on_error: str,
    progress: bool,
    as_json: bool,
    **format_options: Any,
) -> None:
    """Convert SRC into DST (resumable: rerun the same command after an interruption)."""
    from hsstore.interop.convert import convert

    def report(name: str, reason: str) -> None:
        label = "skipped" if on_error == "skip" else "bad input"
        click.echo(f"{label}: {Path(src) / name}: {reason}", err=True)

    # With --on-error fail, ConvertFailed reaches handle_errors after report() listed each file.
    result = convert(
        src,
        dst,
        src_format=src_format,
        dst_format=dst_format,
        layer_ids=_parse_ids(layer_ids),
        num_hidden_layers=num_hidden_layers,
        model_name=model_name,
        codec=codec,
        tier=tier,
        workers=workers,
        commit_every=commit_every,
        commit_bytes=max(1, int(commit_gb * 1e9)),
        on_error=on_error,
        progress=progress,
        on_problem=report,
        **format_options,
    )
    if as_json:
        emit_json(result.to_json())
    else:
        rate = result.bytes_read / result.seconds / 1e9 if result.seconds else 0.0
        click.echo(
            f"{result.source_format} -> {result.dest_format}: {result.added} added, "
            f"{result.already_present} already present, {len(result.skipped)} skipped; "
            f"{result.total_samples} samples in {result.dest} ({result.seconds:.1f} s, {rate:.2f} GB/s)"
        )
        for note in result.notes:
            click.echo(f"note: {note}")
