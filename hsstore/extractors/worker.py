"""One extraction worker: its rows of the input, one model, one writer thread.

A worker is self-contained (it re-reads the input and opens the dataset by path), so it runs
the same in the parent process (``--workers 1``) or in a spawned process, and several nodes can
run ``--shard i/N`` against one dataset. It never redoes a committed sample: ids already in the
dataset are skipped when batches are run, although batches themselves are planned over all of
the worker's rows (see :mod:`hsstore.extractors.batching`).
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from hsstore.cores import usable_core_ids
from hsstore.extractors.batching import owner, plan_batches
from hsstore.extractors.chat_tokens import ChatTokenizer, TokenizedPrompt
from hsstore.extractors.options import ExtractOptions
from hsstore.extractors.process_group import die_with_group, lead_own_group
from hsstore.extractors.prompts import SkippedRow, read_prompts
from hsstore.extractors.writer_thread import WriterThread
from hsstore.spec.layers import LayerSpec
from hsstore.tuning import space_collections

Event = tuple[str, int, dict[str, Any]]  # (kind, rank, payload)


@dataclass(frozen=True)
class WorkerSpec:
    """One worker's job, picklable for spawn: the run's options as given, and its slice."""

    options: ExtractOptions
    layers: tuple[LayerSpec, ...]  # parsed from options.layers against the model
    rank: int  # global rank = shard * workers + worker
    world: int
    device: str  # options.device resolved: cpu, cuda or cuda:K
    dtype: str  # options.dtype resolved against the model's config
    torch_threads: int | None
    encode_threads: int | None


def load_tokenizer(model: str, *, trust_remote_code: bool = False) -> Any:
    from transformers import AutoTokenizer

    from hsstore.errors import BadInputError

    try:
        return AutoTokenizer.from_pretrained(model, trust_remote_code=trust_remote_code)
    except (OSError, ValueError) as exc:
        raise BadInputError(
            f"cannot load the tokenizer: {remote_code_hint(exc, trust_remote_code)}", path=model
        ) from exc


def remote_code_hint(exc: BaseException, trust_remote_code: bool) -> str:
    """transformers' error, plus the flag to pass when the model ships its own code."""
    text = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    if not trust_remote_code and "trust_remote_code" in str(exc):
        text += " (the model ships its own code; pass --trust-remote-code if you trust it)"
    return text


def tokenize_rows(
    spec: WorkerSpec, tokenizer: Any
) -> tuple[list[TokenizedPrompt], list[SkippedRow]]:
    """This worker's rows, tokenised, plus the rows it had to skip."""
    opts = spec.options
    chat = ChatTokenizer(tokenizer, max_length=opts.max_length, path=opts.model)
    samples: list[TokenizedPrompt] = []
    skipped: list[SkippedRow] = []
    for row in read_prompts(opts.data):
        if opts.limit is not None and row.index >= opts.limit:
            break
        if owner(row.index, world=spec.world) != spec.rank:
            continue
        got = row if isinstance(row, SkippedRow) else chat.encode(row)
        (skipped if isinstance(got, SkippedRow) else samples).append(got)
    return samples, skipped


def make_backend(spec: WorkerSpec) -> Any:
    opts = spec.options
    layers = list(spec.layers)
    if opts.backend == "transformers":
        from hsstore.extractors.backends.transformers import TransformersBackend

        return TransformersBackend(
            opts.model,
            layers,
            device=spec.device,
            torch_dtype=spec.dtype,
            trust_remote_code=opts.trust_remote_code,
            **opts.backend_options,
        )
    if opts.backend == "sglang":
        from hsstore.extractors.backends.sglang.backend import SGLangBackend

        return SGLangBackend(
            opts.model,
            layers,
            dtype=spec.dtype,
            device=spec.device,
            trust_remote_code=opts.trust_remote_code,
            **opts.backend_options,
        )
    if opts.backend == "vllm":
        from hsstore.extractors.backends.vllm.backend import VLLMBackend

        return VLLMBackend(
            opts.model,
            layers,
            dtype=spec.dtype,
            device=spec.device,
            trust_remote_code=opts.trust_remote_code,
            max_num_batched_tokens=opts.max_batch_tokens,
            # two engines on one host must not bind the same cores; one keeps vLLM's own binding
            cpu_cores=worker_cores(spec) if spec.device == "cpu" and opts.workers > 1 else None,
            **opts.backend_options,
        )
    raise ValueError(f"unknown backend {opts.backend!r}")


def worker_cores(spec: WorkerSpec) -> list[int]:
    """The cores this worker's engine may bind its threads to: its share of this process's."""
    cores = usable_core_ids()
    workers = spec.options.workers
    per = max(1, len(cores) // workers)
    mine = cores[(spec.rank % workers) * per :][:per]
    return mine or cores


def run_worker(
    spec: WorkerSpec, emit: Callable[[Event], None], *, tokenizer: Any = None
) -> dict[str, Any]:
    """Extract this worker's share into the dataset; returns its statistics. ``tokenizer``:
    the model's, already loaded by the caller (else the worker loads it).

    The outcome is reported through ``emit`` (``done`` with the statistics, or ``error``)
    *before* the model backend is closed: closing an SGLang engine may take its whole process
    down (sglang ``entrypoints/engine.py`` ``shutdown`` kills the process's children, and a
    watchdog that sees them gone sends SIGQUIT), and the parent must still learn the result.
    """
    backends: list[Any] = []
    try:
        result = _extract(spec, emit, backends, tokenizer)
        emit(("done", spec.rank, result))
        return result
    except BaseException as exc:
        emit(("error", spec.rank, error_payload(exc)))
        raise
    finally:
        for backend in backends:
            backend.close()


def error_payload(exc: BaseException) -> dict[str, Any]:
    from hsstore.errors import HsstoreError

    kind = "hsstore" if isinstance(exc, HsstoreError | OSError) else "crash"
    return {"kind": kind, "message": str(exc), "type": type(exc).__name__}


def _extract(
    spec: WorkerSpec, emit: Callable[[Event], None], backends: list[Any], tokenizer: Any
) -> dict:
    import torch

    import hsstore

    opts = spec.options
    if spec.torch_threads:
        torch.set_num_threads(spec.torch_threads)
    t_start = time.perf_counter()
    if tokenizer is None:
        tokenizer = load_tokenizer(opts.model, trust_remote_code=opts.trust_remote_code)
    t_tokenize = time.perf_counter()
    samples, skipped = tokenize_rows(spec, tokenizer)
    tokenize_s = time.perf_counter() - t_tokenize
    ds = hsstore.open(opts.out)
    already = {p.sample_id for p in samples if p.sample_id in ds}
    todo = [p for p in samples if p.sample_id not in already]
    recorded = {s.get("name") for s in ds.manifest.provenance.get("skipped", [])}
    new_skips = [(f"{s.source}#{s.index}", s.reason) for s in skipped]
    new_skips = [(n, r) for n, r in new_skips if n not in recorded]
    emit(
        (
            "plan",
            spec.rank,
            {
                "samples": len(todo),
                "tokens": sum(p.num_tokens for p in todo),
                "already": len(already),
                "skipped": dict(Counter(s.reason for s in skipped)),
            },
        )
    )
    batches = [
        b
        for b in plan_batches(
            samples, batch_size=opts.batch_size, max_batch_tokens=opts.max_batch_tokens
        )
        if any(p.sample_id not in already for p in b)
    ]
    writer = WriterThread(
        ds,
        commit_every=opts.commit_every,
        commit_seconds=opts.commit_seconds,
        max_queue=opts.max_queue,
        encode_threads=spec.encode_threads,
        on_written=lambda n, t, b: emit(
            ("written", spec.rank, {"samples": n, "tokens": t, "bytes": b})
        ),
        on_committed=lambda ids: emit(("committed", spec.rank, {"samples": ids})),
        skipped=new_skips,
    )
    backend = make_backend(spec) if batches else None
    if backend is not None:
        backends.append(backend)
    extract_s = 0.0
    t_batches = time.perf_counter()  # the engine is up: from here on, the per-token work
    failed: BaseException | None = None
    writer.start()
    try:
        for batch in batches:
            # the parent names these if this process dies before they are committed
            held = [p.sample_id for p in batch if p.sample_id not in already]
            emit(("batch", spec.rank, {"samples": held}))
            t0 = time.perf_counter()
            states = backend.run(batch)
            extract_s += time.perf_counter() - t0
            writer.put([(p, h) for p, h in zip(batch, states) if p.sample_id not in already])
    except BaseException as exc:  # keep what was already handed over, then fail
        failed = exc
    stats = writer.finish()  # commits every complete sample it was given
    batches_s = time.perf_counter() - t_batches
    if failed is not None:
        raise failed
    wall = time.perf_counter() - t_start
    return {
        "rank": spec.rank,
        "samples_written": stats.samples,
        "tokens_written": stats.tokens,
        "raw_bytes": stats.raw_bytes,
        "samples_already_present": len(already),
        "skipped": dict(Counter(s.reason for s in skipped)),
        "commits": stats.commits,
        "wall_s": wall,
        "extract_s": extract_s,
        "tokenize_s": tokenize_s,
        "batches_s": batches_s,
        "writer_busy_s": stats.busy_s,
        "writer_stall_s": stats.stall_s,
    }


def worker_process_main(spec: WorkerSpec, events: Any) -> None:
    """Entry point of a spawned worker: report through the pipe ``events`` (whose ``send``
    has handed each event over when it returns, so none is lost if this process dies right
    after), die with the parent. The worker leads its own process group, which the runner
    kills when it ends (:mod:`hsstore.extractors.process_group`)."""
    lead_own_group()
    _exit_with_parent()
    space_collections()  # a program of hsstore's own, as the command line that spawned it
    # the model thread and the writer thread both report: one event at a time on the pipe
    # (a send larger than the pipe's atomic write would otherwise interleave with another)
    lock = threading.Lock()

    def send(event: Event) -> None:
        with lock:
            events.send(event)

    # an error was already reported to the parent, which owns the exit code
    with contextlib.suppress(BaseException):
        run_worker(spec, send)


def _exit_with_parent() -> None:
    """A worker whose parent was killed (kill -9 of the run) stops instead of running on, and
    takes the engine processes it started with it."""
    parent = os.getppid()

    def watch() -> None:
        while True:
            time.sleep(0.5)
            if os.getppid() != parent:
                die_with_group(3)

    threading.Thread(target=watch, name="hsstore-parent-watch", daemon=True).start()
