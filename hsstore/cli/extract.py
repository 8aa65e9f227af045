"""``hsstore extract``: run a target model over prompts and store its hidden states.

The work is done by the ``hsstore.extract`` package; this module only maps options to it.
"""

from __future__ import annotations

import sys

import click

from hsstore.cli._common import emit_json, handle_errors
from hsstore.format.codecs import CODEC_NAMES, DEFAULT_CODEC


@click.command("extract")
@click.option("--model", "model", required=True, help="Model directory (or hub id) to run.")
@click.option(
    "--data",
    required=True,
    help="Prompts: .jsonl (messages / conversations / text), .txt, or a datasets directory.",
)
@click.option("--out", required=True, help="Dataset to create or add to.")
@click.option(
    "--backend",
    type=click.Choice(["transformers", "sglang"]),
    default="transformers",
    show_default=True,
)
@click.option(
    "--workers", type=int, default=1, show_default=True, help="Worker processes (one per GPU)."
)
@click.option("--shard", default=None, help="i/N: this node's share of the input (multi-node).")
@click.option(
    "--layers",
    default=None,
    help="Canonical layers: depths 0..N, 'final', 'final-prenorm', 'eagle3', or CONV:ids "
    "(default: eagle3,final).",
)
@click.option("--max-length", type=int, default=None, help="Truncate prompts to this many tokens.")
@click.option("--limit", type=int, default=None, help="Only use the first N input rows.")
@click.option("--batch-size", type=int, default=8, show_default=True)
@click.option(
    "--max-batch-tokens",
    type=int,
    default=16384,
    show_default=True,
    help="Padded tokens per batch.",
)
@click.option("--device", default="auto", show_default=True, help="cpu, cuda, cuda:K or auto.")
@click.option(
    "--dtype",
    type=click.Choice(["auto", "float32", "float16", "bfloat16"]),
    default="auto",
    show_default=True,
    help="Compute and storage dtype (auto: the model's).",
)
@click.option("--codec", type=click.Choice(CODEC_NAMES), default=DEFAULT_CODEC, show_default=True)
@click.option(
    "--commit-every", type=int, default=512, show_default=True, help="Samples per commit."
)
@click.option("--commit-seconds", type=float, default=300.0, show_default=True)
@click.option("--tp-size", type=int, default=None, help="sglang: tensor parallel size per worker.")
@click.option("--mem-fraction", type=float, default=None, help="sglang: mem_fraction_static.")
@click.option(
    "--trust-remote-code",
    is_flag=True,
    help="Run the model's own config/tokenizer/model code (e.g. Kimi-K2.x); only for models "
    "you trust.",
)
@click.option(
    "--check-against",
    type=click.Choice(["transformers", "sglang"]),
    default=None,
    help="Also extract the same prompts with this backend (into a temporary dataset) and "
    "compare every stored layer; exit 1 if they disagree. Use with --limit.",
)
@click.option(
    "--check-tolerance",
    type=float,
    default=None,
    help="--check-against: largest relative error per layer (default 0.05).",
)
@click.option("--no-progress", is_flag=True, help="No progress bar.")
@click.option("--json", "as_json", is_flag=True, help="Print the summary as JSON.")
@handle_errors
def command(
    model: str,
    data: str,
    out: str,
    backend: str,
    workers: int,
    shard: str | None,
    layers: str | None,
    max_length: int | None,
    limit: int | None,
    batch_size: int,
    max_batch_tokens: int,
    device: str,
    dtype: str,
    codec: str,
    commit_every: int,
    commit_seconds: float,
    tp_size: int | None,
    mem_fraction: float | None,
    trust_remote_code: bool,
    check_against: str | None,
    check_tolerance: float | None,
    no_progress: bool,
    as_json: bool,
) -> None:
    """Extract hidden states of every prompt token into an hsstore dataset (resumable)."""
    from hsstore.extract.runner import ExtractOptions, run_extract

    backend_options = {}
    if backend == "sglang":
        if tp_size is not None:
            backend_options["tp_size"] = tp_size
        if mem_fraction is not None:
            backend_options["mem_fraction_static"] = mem_fraction
    elif tp_size is not None or mem_fraction is not None:
        raise click.UsageError("--tp-size and --mem-fraction apply to --backend sglang only")
    summary = run_extract(
        ExtractOptions(
            model=model,
            data=data,
            out=out,
            backend=backend,
            workers=workers,
            shard=shard,
            layers=layers,
            max_length=max_length,
            limit=limit,
            batch_size=batch_size,
            max_batch_tokens=max_batch_tokens,
            device=device,
            dtype=dtype,
            codec=codec,
            commit_every=commit_every,
            commit_seconds=commit_seconds,
            progress=not no_progress,
            backend_options=backend_options,
            trust_remote_code=trust_remote_code,
            check_against=check_against,
            check_tolerance=check_tolerance,
        )
    )
    check = summary.get("check")
    if as_json:
        emit_json(summary)
        if check is not None and not check["ok"]:
            sys.exit(1)
        return
    click.echo(
        f"{summary['samples_written']} samples ({summary['tokens_written']} tokens) written to "
        f"{summary['dataset']}; {summary['samples_already_present']} already there; "
        f"{summary['skipped_total']} rows skipped"
    )
    for reason, count in sorted(summary["skipped"].items()):
        click.echo(f"  skipped {count}: {reason}")
    click.echo(
        f"{summary['tokens_per_s']:,.0f} tokens/s overall, "
        f"{summary['extract_tokens_per_s']:,.0f} tokens/s in the model; "
        f"writer busy {summary['writer_busy_share']:.0%} of the time, "
        f"extraction waited {summary['writer_stall_s']:.1f}s on it"
    )
    if check is not None:
        _echo_check(check)
        if not check["ok"]:
            sys.exit(1)


def _echo_check(check: dict) -> None:
    click.echo(
        f"check against {check['against']} on {check['samples']} samples: "
        + ("OK" if check["ok"] else "FAILED")
    )
    for label, err, cos, sep in zip(
        check["layers"],
        check["max_rel_err"],
        check["min_cosine"],
        check["min_rel_distance_to_other_layers"],
    ):
        click.echo(
            f"  {label}: max relative error {err:.3g}, min cosine {cos:.6f}, "
            f"nearest other layer {sep:.3g}"
        )
    for problem in check["problems"]:
        click.echo(f"  problem: {problem}")
