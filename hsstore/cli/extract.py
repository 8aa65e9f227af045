"""``hsstore extract``: run a target model over prompts and store its hidden states.

The work is done by the ``hsstore.extractors`` package; this module only maps options to it.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any

import click

from hsstore.cli._common import emit_json, handle_errors
from hsstore.cli._stopped import resumable
from hsstore.extractors.options import cli_fields


def _option_flags(command: Callable) -> Callable:
    """One click option per field of ExtractOptions that the command line sets."""
    for name, default, flag in reversed(cli_fields()):
        kw: dict[str, Any] = {"help": flag.help}
        if default is ...:
            kw["required"] = True
        else:
            kw["default"] = default
            kw["show_default"] = default is not None and default is not False
        if flag.choices is not None:
            kw["type"] = click.Choice(flag.choices)
        elif flag.kind is not None:
            kw["type"] = flag.kind
        elif isinstance(default, bool) and "/" not in flag.flag:
            kw["is_flag"] = True
        command = click.option(flag.flag, name, **kw)(command)
    return command


@click.command("extract")
@_option_flags
@click.option(
    "--tp-size", type=int, default=None, help="sglang, vllm: tensor parallel size per worker."
)
@click.option(
    "--mem-fraction",
    type=float,
    default=None,
    help="sglang: mem_fraction_static; vllm: gpu_memory_utilization.",
)
@click.option("--json", "as_json", is_flag=True, help="Print the summary as JSON.")
@handle_errors
@resumable(lambda given: given["out"])
def command(tp_size: int | None, mem_fraction: float | None, as_json: bool, **given: Any) -> None:
    """Extract hidden states of every prompt token into an hsstore dataset (resumable)."""
    from hsstore.codec.tiers import checked
    from hsstore.extractors.runner import ExtractOptions, run_extract

    checked(given.get("tier"))  # an unknown name fails before any model is loaded

    backend_options = {}
    if given["backend"] in ("sglang", "vllm"):
        if tp_size is not None:
            backend_options["tp_size"] = tp_size
        if mem_fraction is not None:
            backend_options["mem_fraction_static"] = mem_fraction
    elif tp_size is not None or mem_fraction is not None:
        raise click.UsageError(
            "--tp-size and --mem-fraction apply to --backend sglang or vllm only"
        )
    summary = run_extract(ExtractOptions(**given, backend_options=backend_options))
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
