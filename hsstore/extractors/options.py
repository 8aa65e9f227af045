"""The options of one extraction, defined once.

``ExtractOptions`` is what ``hsstore extract`` builds from its command line (its click options
are generated from the fields' ``cli`` metadata, see :mod:`hsstore.cli.extract`), what
``run_extract`` takes, and what every worker receives unchanged, beside its own slice of the
work (``hsstore.extractors.worker.WorkerSpec``).
"""

from __future__ import annotations

from dataclasses import MISSING, dataclass, field, fields
from typing import Any

from hsstore.codec.codecs import CODEC_NAMES, DEFAULT_CODEC

BACKENDS = ("transformers", "sglang", "vllm")
DTYPES = ("auto", "float32", "float16", "bfloat16")


@dataclass(frozen=True)
class Flag:
    """How a field of `ExtractOptions` appears on the command line."""

    flag: str  # "--name", or "--name/--no-name" for a switch
    help: str = ""
    kind: type | None = None  # int or float for a typed value; None: text, or a switch
    choices: tuple[str, ...] | None = None


def _cli(flag: str, help: str = "", **kw: Any) -> dict[str, Flag]:
    return {"cli": Flag(flag, help, **kw)}


@dataclass(frozen=True)
class ExtractOptions:
    """Options of one ``hsstore extract`` run (each field's help is listed below)."""

    model: str = field(metadata=_cli("--model", "Model directory (or hub id) to run."))
    data: str = field(
        metadata=_cli(
            "--data",
            "Prompts: .jsonl (messages / conversations / text), .txt, or a datasets directory.",
        )
    )
    out: str = field(metadata=_cli("--out", "Dataset to create or add to."))
    backend: str = field(
        default="transformers", metadata=_cli("--backend", "Model runner.", choices=BACKENDS)
    )
    workers: int = field(
        default=1, metadata=_cli("--workers", "Worker processes (one per GPU).", kind=int)
    )
    shard: str | None = field(
        default=None, metadata=_cli("--shard", "i/N: this node's share of the input (multi-node).")
    )
    layers: str | None = field(
        default=None,
        metadata=_cli(
            "--layers",
            "Canonical layers: depths 0..N, 'final', 'final-prenorm', 'eagle3', or CONV:ids "
            "(default: eagle3,final-prenorm, which every exporter and trainer takes; "
            "an existing --out keeps its own layers).",
        ),
    )
    max_length: int | None = field(
        default=None,
        metadata=_cli("--max-length", "Truncate prompts to this many tokens.", kind=int),
    )
    limit: int | None = field(
        default=None, metadata=_cli("--limit", "Only use the first N input rows.", kind=int)
    )
    batch_size: int = field(
        default=8, metadata=_cli("--batch-size", "Prompts per batch.", kind=int)
    )
    max_batch_tokens: int = field(
        default=16384, metadata=_cli("--max-batch-tokens", "Padded tokens per batch.", kind=int)
    )
    device: str = field(default="auto", metadata=_cli("--device", "cpu, cuda, cuda:K or auto."))
    dtype: str = field(
        default="auto",
        metadata=_cli("--dtype", "Compute and storage dtype (auto: the model's).", choices=DTYPES),
    )
    codec: str = field(
        default=DEFAULT_CODEC,
        metadata=_cli("--codec", "Codec of a new dataset.", choices=CODEC_NAMES),
    )
    tier: str | None = field(
        default=None,
        metadata=_cli(
            "--tier",
            "Lossy tier to store the states in: lossless (default), fp8-token, fp8-token-layer, "
            "bf16-m0..bf16-m6 or bf16-mK-final-mJ (docs/CONVERT.md, Lossy tiers).",
        ),
    )
    commit_every: int = field(
        default=512, metadata=_cli("--commit-every", "Samples per commit.", kind=int)
    )
    commit_seconds: float = field(
        default=300.0,
        metadata=_cli("--commit-seconds", "...or commit after this many seconds.", kind=float),
    )
    max_queue: int = 4  # batches a worker's writer thread may hold (not a command-line option)
    progress: bool = field(default=True, metadata=_cli("--progress/--no-progress", "Progress bar."))
    # Keyword arguments of the backend's constructor: ``--tp-size`` and ``--mem-fraction``
    # (sglang's tp_size and mem_fraction_static), or anything a program passes.
    backend_options: dict[str, Any] = field(default_factory=dict)
    trust_remote_code: bool = field(
        default=False,
        metadata=_cli(
            "--trust-remote-code",
            "Run the model's own config/tokenizer/model code (e.g. Kimi-K2.x); only for models "
            "you trust.",
        ),
    )
    check_against: str | None = field(
        default=None,
        metadata=_cli(
            "--check-against",
            "Also extract the same prompts with this backend (into a temporary dataset) and "
            "compare every stored layer; exit 1 if they disagree. Use with --limit.",
            choices=BACKENDS,
        ),
    )
    check_tolerance: float | None = field(
        default=None,
        metadata=_cli(
            "--check-tolerance",
            "--check-against: largest relative error per layer (default 0.05).",
            kind=float,
        ),
    )


def cli_fields() -> list[tuple[str, Any, Flag]]:
    """(name, default, flag) of every field the command line sets, in declaration order;
    the default is ``...`` for a required one."""
    out = []
    for f in fields(ExtractOptions):
        if "cli" in f.metadata:
            default = ... if f.default is MISSING else f.default
            out.append((f.name, default, f.metadata["cli"]))
    return out


ExtractOptions.__doc__ = (
    (ExtractOptions.__doc__ or "")
    + "\n\n"
    + "\n".join(f"    {name} ({flag.flag}): {flag.help}" for name, _, flag in cli_fields())
)
