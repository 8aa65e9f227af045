"""`hsstore inspect PATH`: audit a dataset (or a foreign directory) before training on it.

Exit codes: 0 when no check FAILs, 1 when any does, 2 on usage or I/O errors.
"""

from __future__ import annotations

import sys

import click

from hsstore.cli._common import EXIT_CHECK_FAILED, EXIT_OK, emit_json, handle_errors


def _parse_ids(ctx: click.Context, param: click.Parameter, text: str | None) -> list[int] | None:
    if text is None:
        return None
    try:
        return [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise click.BadParameter(f"expected comma-separated integers, got {text!r}") from None


@click.command(name="inspect")
@click.argument("path", type=click.Path(path_type=str))
@click.option(
    "--sample",
    "sample_tokens",
    type=click.IntRange(min=1),
    default=16384,
    show_default=True,
    help="Tokens to read, in samples drawn uniformly per token.",
)
@click.option(
    "--full", is_flag=True, help="Read every sample (exact statistics; slow on big data)."
)
@click.option("--seed", type=int, default=0, show_default=True, help="Seed of the sample draw.")
@click.option(
    "--lm-head",
    "lm_head",
    type=click.Path(path_type=str),
    default=None,
    help="Local HF model directory: check token/norm alignment against its lm_head.",
)
@click.option(
    "--model",
    "model",
    type=click.Path(path_type=str),
    default=None,
    help="Local HF model directory: recompute a few samples with the model and check that each "
    "stored layer is the state its label names (implies --lm-head MODEL).",
)
@click.option(
    "--model-samples",
    type=click.IntRange(min=1),
    default=2,
    show_default=True,
    help="Samples --model recomputes (their first 128 tokens).",
)
@click.option(
    "--lm-head-tokens",
    type=click.IntRange(min=1),
    default=512,
    show_default=True,
    help="Loss tokens the lm-head check scores.",
)
@click.option(
    "--layer-ids",
    default=None,
    callback=_parse_ids,
    help="Foreign directories without a config: the source's layer ids, e.g. 2,16,29,31.",
)
@click.option(
    "--num-hidden-layers",
    type=click.IntRange(min=1),
    default=None,
    help="Foreign directories: the model's decoder layer count, when not recorded.",
)
@click.option(
    "--reference",
    type=str,
    default=None,
    help="A dataset holding the same samples at full precision: report the lossy tier's "
    "measured error per layer (and, with --lm-head, the head's top-1 agreement).",
)
@click.option("--json", "as_json", is_flag=True, help="Print the report as JSON (docs/INSPECT.md).")
@click.option(
    "--plot",
    "plot",
    type=click.Path(dir_okay=False, path_type=str),
    default=None,
    help="Write per-layer magnitude and length histograms to this PNG.",
)
@handle_errors
def command(
    path: str,
    sample_tokens: int,
    full: bool,
    seed: int,
    lm_head: str | None,
    model: str | None,
    model_samples: int,
    lm_head_tokens: int,
    layer_ids: list[int] | None,
    num_hidden_layers: int | None,
    reference: str | None,
    as_json: bool,
    plot: str | None,
) -> None:  # fmt: skip
    """Audit PATH (an hsstore dataset, or a directory `convert` reads) for silent data faults."""
    from hsstore.audit import AuditOptions, Verdict, open_audit_source, run_audit
    from hsstore.audit.lossy import source_report
    from hsstore.audit.report import to_json, to_text

    src = open_audit_source(path, layer_ids=layer_ids, num_hidden_layers=num_hidden_layers)
    opts = AuditOptions(sample_tokens=sample_tokens, full=full, seed=seed,
                        lm_head=lm_head or model, lm_head_tokens=lm_head_tokens, model=model,
                        model_samples=model_samples)  # fmt: skip
    result = run_audit(src, opts)
    lossy = source_report(src, reference, opts)
    if as_json:
        emit_json(to_json(result) | ({} if lossy is None else {"lossy": lossy}))
    else:
        click.echo(to_text(result))
        from hsstore.audit.lossy import to_text as lossy_text

        if lossy is not None and lossy_text(lossy):
            click.echo("\n".join(lossy_text(lossy)))
    if plot:  # after the report, which a plot that cannot be drawn leaves whole
        import numpy as np

        from hsstore.audit.plot import save_plot

        lengths = src.lengths()
        if lengths is None:
            lengths = np.array(result.read_lengths)
        save_plot(result, lengths, plot)
    sys.exit(EXIT_CHECK_FAILED if result.verdict is Verdict.FAIL else EXIT_OK)
