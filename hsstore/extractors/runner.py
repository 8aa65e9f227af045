"""``hsstore extract`` orchestration: check inputs, create the dataset, run the workers.

The parent validates everything that can be validated without a model forward (model config,
tokenizer, layers, an existing dataset's compatibility) so bad input fails before any worker
starts. It then runs ``--workers`` workers (in-process when there is one, spawned processes
otherwise; each spawned worker gets its own GPU(s) through CUDA_VISIBLE_DEVICES and leads its
own process group, killed once the worker ends: see :mod:`hsstore.extractors.process_group`) and
renders one progress bar from their events. Each worker writes and commits its own segments, so the dataset
is usable, and a crash loses only uncommitted work, at any moment.
"""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import multiprocessing.connection as mp_connection
import os
import signal
import time
from collections import Counter
from dataclasses import replace
from pathlib import Path
from typing import Any

from hsstore.commits.runs import input_identity, run_record
from hsstore.cores import usable_cores
from hsstore.errors import BadInputError, ConflictError, HsstoreError, no_such_path
from hsstore.extractors.backends.sglang.models import refuse_wrong_capture
from hsstore.extractors.batching import parse_shard
from hsstore.extractors.devices import environ_set, resolve_device, visible_gpus
from hsstore.extractors.extra import require_extract_extra
from hsstore.extractors.layer_select import default_layers, parse_layers
from hsstore.extractors.options import BACKENDS, ExtractOptions
from hsstore.extractors.process_group import end_group, signal_group, wait_exited
from hsstore.extractors.progress import Progress
from hsstore.extractors.worker import WorkerSpec, load_tokenizer, run_worker, worker_process_main
from hsstore.spec.layers import LayerSpec, layers_option

# Backends whose engine runs in processes of its own: always in a spawned worker, whose process
# group takes them down with it (closing an SGLang engine kills its process's children).
ENGINE_BACKENDS = ("sglang", "vllm")
# how long interrupted workers get to commit what they completed before they are killed
INTERRUPT_GRACE_S = 60.0
# Backends whose engine processes are left out of an interrupt: vLLM's, on a SIGINT of their own,
# end without releasing their shared memory (Python's resource tracker then warns after the
# command's last line), while the worker's closing of its engine ends them cleanly.
INTERRUPT_WORKER_ALONE = ("vllm",)


class WorkerFailedError(HsstoreError):
    """A worker stopped with an error; what it committed before stays committed."""


__all__ = ["ExtractOptions", "WorkerFailedError", "run_extract"]


def run_extract(opts: ExtractOptions) -> dict[str, Any]:
    """Run an extraction end to end; returns the summary printed by the CLI.

    With ``check_against``, the same prompts are then extracted by that backend into a
    temporary dataset and compared layer by layer (``summary["check"]``, see hsstore/extractors/check.py).
    """
    require_extract_extra("hsstore extract")
    summary = _run_extract(opts)
    if opts.check_against:
        summary["check"] = _check_against(opts)
    return summary


def _check_against(opts: ExtractOptions) -> dict[str, Any]:
    import tempfile

    import hsstore
    from hsstore.extractors.check import DEFAULT_TOLERANCE, compare_datasets, verdict

    stored = hsstore.open(opts.out)
    with tempfile.TemporaryDirectory(prefix="hsstore-check-") as tmp:
        reference = replace(
            opts,
            backend=opts.check_against,
            # the states the checked run stored, whichever default chose them
            layers=layers_option(stored.layers, stored.manifest.model.num_hidden_layers),
            out=str(Path(tmp) / "reference"),
            dtype=stored.manifest.dtype,
            check_against=None,
            workers=1,
            backend_options={},
            progress=False,
        )
        _run_extract(reference)
        report = compare_datasets(reference.out, opts.out)
    tolerance = opts.check_tolerance if opts.check_tolerance is not None else DEFAULT_TOLERANCE
    return {"against": opts.check_against, **verdict(report, tolerance)}


def _run_extract(opts: ExtractOptions) -> dict[str, Any]:
    for backend in (opts.backend, opts.check_against):
        if backend is not None and backend not in BACKENDS:
            raise BadInputError(f"unknown backend {backend!r}; use {', '.join(BACKENDS)}")
    for name, value in (
        ("--workers", opts.workers),
        ("--batch-size", opts.batch_size),
        ("--max-batch-tokens", opts.max_batch_tokens),
        ("--commit-every", opts.commit_every),
        ("--max-length", opts.max_length),
        ("--limit", opts.limit),
    ):
        if value is not None and value < 1:
            raise BadInputError(f"{name} must be >= 1, got {value}")
    try:
        shard_i, shards = parse_shard(opts.shard)
    except ValueError as exc:
        raise BadInputError(str(exc)) from None
    if not os.path.exists(opts.data):
        raise no_such_path(opts.data)
    if opts.backend == "vllm":
        from hsstore.extractors.backends.vllm.backend import check_vllm_version, installed_version

        version = installed_version()
        if version is None:
            raise BadInputError("--backend vllm needs vLLM: pip install '.[vllm]'")
        check_vllm_version(version)
    full_config = _load_config(opts.model, opts.trust_remote_code)
    if opts.backend == "sglang":
        refuse_wrong_capture(full_config, opts.model)
        if not _sglang_engine_factory_given(opts):
            import importlib.util

            if importlib.util.find_spec("sglang") is None:
                raise BadInputError("--backend sglang needs SGLang: pip install '.[sglang]'")
    config = getattr(full_config, "text_config", None) or full_config
    n, h = int(config.num_hidden_layers), int(config.hidden_size)
    layers = _layers(opts, n)
    if "sglang" in (opts.backend, opts.check_against):
        from hsstore.extractors.backends.sglang.backend import plan_capture

        plan_capture(layers, n)  # what SGLang cannot capture is refused before any model runs
    dtype = _store_dtype(opts, config)
    tokenizer = load_tokenizer(opts.model, trust_remote_code=opts.trust_remote_code)
    device = resolve_device(opts.device)
    folder_was_there = os.path.exists(opts.out)
    created = _ensure_dataset(opts, config, tokenizer, layers, h, dtype)
    # Segments of a crashed (kill -9) run are debris; gc never touches a live writer's segment
    # (it holds a lease on it) nor anything committed, so this is safe next to other nodes.
    import hsstore

    debris = hsstore.gc(opts.out).removed_segments
    job = input_identity(opts.data, limit=opts.limit, max_length=opts.max_length)
    _record_run(opts.out, run_record("started", job, shard_i, shards))
    gpus = visible_gpus() if device.startswith("cuda") else []
    specs = worker_specs(opts, layers, shard_i, shards, device=device, dtype=dtype)
    t0 = time.perf_counter()
    with Progress(enabled=opts.progress, workers=opts.workers) as progress:
        # an engine never lives in this process: closing an SGLang one kills its process's
        # children and can take the process itself down (see hsstore/extractors/worker.py)
        if opts.workers == 1 and opts.backend not in ENGINE_BACKENDS:
            # the tokenizer checked above, not a second one loaded from the same files
            results = [run_worker(specs[0], progress.handle, tokenizer=tokenizer)]
        else:
            results = _run_spawned(specs, progress, gpus, opts)
    wall = time.perf_counter() - t0
    summary = _summary(opts, layers, results, wall, shard_i, shards)
    summary["debris_segments_removed"] = len(debris)
    nothing = summary["samples_written"] + summary["samples_already_present"] == 0
    # a shard of a tiny input may own no rows at all; a shard whose rows were all bad may not
    if nothing and (shards == 1 or summary["skipped_total"] > 0):
        reasons = "; ".join(f"{n} x {r}" for r, n in sorted(summary["skipped"].items()))
        if created and shards == 1:  # no other node writes to it: leave nothing behind
            _remove_empty(opts.out, folder_was_there)
        raise BadInputError(f"no usable rows for this run ({reasons or 'no rows'})", path=opts.data)
    done = summary["samples_written"] + summary["samples_already_present"]
    _record_run(opts.out, run_record("finished", job, shard_i, shards, samples=done))
    return summary


def threads_per_worker(workers: int) -> int:
    """Threads of each worker process: ``OMP_NUM_THREADS`` where the user set it (a per-process
    count, as torch and OpenMP read it), else the cores this process may run on, shared out."""
    given = os.environ.get("OMP_NUM_THREADS", "").strip()
    if given.isdigit() and int(given) > 0:
        return int(given)
    return max(1, usable_cores() // workers)


def worker_specs(
    opts: ExtractOptions,
    layers: list[LayerSpec],
    shard_i: int,
    shards: int,
    *,
    device: str,
    dtype: str,
) -> list[WorkerSpec]:
    """This node's workers: each gets ``opts`` unchanged, its own slice of the work and
    `threads_per_worker` threads."""
    threads = threads_per_worker(opts.workers)
    return [
        WorkerSpec(
            options=opts,
            layers=tuple(layers),
            rank=shard_i * opts.workers + w,
            world=shards * opts.workers,
            device=device,
            dtype=dtype,
            torch_threads=threads if device == "cpu" else None,
            encode_threads=threads,
        )
        for w in range(opts.workers)
    ]


def _record_run(out: str, record: dict[str, Any]) -> None:
    """Commit a start or finish record (readers tell a finished extraction by them)."""
    import hsstore

    with hsstore.open(out).writer() as w:
        w.record_run(record)


def _sglang_engine_factory_given(opts: ExtractOptions) -> bool:
    """Tests hand the sglang backend a fake engine; then SGLang itself is not needed."""
    return "engine_factory" in opts.backend_options


def _load_config(model: str, trust_remote_code: bool = False) -> Any:
    from transformers import AutoConfig

    from hsstore.extractors.worker import remote_code_hint
    from hsstore.model_folder import read_config

    folder = os.path.expanduser(model)
    looks_local = model.startswith(("/", "./", "../", "~")) or os.path.isabs(model)
    if looks_local and not os.path.isdir(folder):
        raise no_such_path(model)
    if os.path.isdir(folder):  # a local folder: its config.json named if it lacks one
        read_config(Path(folder))
    try:
        config = AutoConfig.from_pretrained(model, trust_remote_code=trust_remote_code)
    except (OSError, ValueError) as exc:
        hint = remote_code_hint(exc, trust_remote_code)
        raise BadInputError(f"cannot load a model config: {hint}", path=model) from exc
    return config


def _layers(opts: ExtractOptions, num_hidden_layers: int) -> list[LayerSpec]:
    """``--layers``; left out, the layers of the dataset at ``--out`` when there is one (a
    resumed run or another shard stores the same states), else the backend's default."""
    if opts.layers is not None and opts.layers.strip():
        return parse_layers(opts.layers, num_hidden_layers)
    import hsstore
    from hsstore.errors import NotADatasetError

    try:
        return list(hsstore.open(opts.out).layers)
    except (FileNotFoundError, NotADatasetError):
        return parse_layers(default_layers(opts.backend), num_hidden_layers)


def _store_dtype(opts: ExtractOptions, config: Any) -> str:
    """The dtype states are computed and stored in: never a silent cast between the two."""
    if opts.dtype not in ("auto", "float32", "float16", "bfloat16"):
        raise BadInputError(f"unknown --dtype {opts.dtype!r}")
    if opts.dtype != "auto":
        return opts.dtype
    cfg = getattr(config, "dtype", None) or getattr(config, "torch_dtype", None)
    name = str(cfg).replace("torch.", "") if cfg is not None else "float32"
    if opts.backend in ENGINE_BACKENDS:
        from hsstore.extractors.backends.sglang.backend import resolve_dtype

        return resolve_dtype("auto", name)
    return name if name in ("float32", "float16", "bfloat16") else "float32"


def _ensure_dataset(
    opts: ExtractOptions, config: Any, tokenizer: Any, layers: list[LayerSpec], h: int, dtype: str
) -> bool:
    """Open a compatible dataset at ``--out`` or create it (True); refuse a mismatching one."""
    import hashlib

    import hsstore
    from hsstore.errors import NotADatasetError

    try:
        ds = hsstore.open(opts.out)
    except (FileNotFoundError, NotADatasetError):
        ds = None
    if ds is None:
        template = getattr(tokenizer, "chat_template", None) or ""
        try:
            hsstore.create(
                opts.out,
                layers=layers,
                hidden_size=h,
                dtype=dtype,
                model={
                    "name": opts.model,
                    "num_hidden_layers": int(config.num_hidden_layers),
                    "hidden_size": h,
                    "vocab_size": int(config.vocab_size),
                },
                tokenizer={
                    "name": opts.model,
                    "chat_template_sha256": hashlib.sha256(template.encode()).hexdigest(),
                },
                codec=opts.codec,
                provenance={
                    "created_by": "extract",
                    "backend": opts.backend,
                    "source": os.path.basename(os.path.normpath(opts.data)),
                    "max_length": opts.max_length,
                },
                exist_ok=True,  # another node's --shard may have created it meanwhile
                tier=opts.tier,
            )
        except ConflictError as exc:
            raise BadInputError(f"{exc.message}; use another --out", path=opts.out) from None
        return True
    from hsstore.codec import tiers

    tier = tiers.checked(opts.tier)
    tiers.check_same(ds.manifest.tier, tier, path=opts.out)  # first: it decides the dtype
    ds.manifest.check_compatible(
        layers,
        hidden_size=h,
        dtype=dtype if tier is None else tier.dtype,
        num_hidden_layers=int(config.num_hidden_layers),
        path=opts.out,
    )
    return False


def _remove_empty(out: str, folder_was_there: bool) -> None:
    """Remove the dataset this run created at ``out`` if it holds no sample (its versions only
    record the run and its skipped rows), and the folder too if the run made it."""
    import hsstore
    from hsstore.spec import paths
    from hsstore.storage.locations import is_url, open_storage
    from hsstore.storage.store import CLOCK_PREFIX

    if len(hsstore.open(out)) > 0:
        return
    storage = open_storage(out)
    for prefix in (paths.SEGMENTS, paths.MANIFESTS, CLOCK_PREFIX):
        storage.delete_tree(prefix)
    storage.delete(paths.ROOT_ZARR_JSON)
    if not is_url(out) and not folder_was_there:
        with contextlib.suppress(OSError):  # only if empty: nothing but what the run wrote
            os.rmdir(out)


def _run_spawned(
    specs: list[WorkerSpec], progress: Progress, gpus: list[str], opts: ExtractOptions
) -> list[dict[str, Any]]:
    """Run one spawned process per spec; each reports through its own pipe.

    A pipe, unlike a multiprocessing queue, hands each event to the kernel before ``send``
    returns, so the batch a worker announced is known here even if the worker dies the next
    instant (a queue's feeder thread would lose it).
    """
    ctx = mp.get_context("spawn")
    per_worker = max(1, int(opts.backend_options.get("tp_size", 1)))
    pipes: dict[Any, int] = {}  # read end -> rank
    running: dict[int, Any] = {}  # rank -> the worker, until it has ended with its group
    results: dict[int, dict[str, Any]] = {}
    errors: list[str] = []
    try:
        for w, spec in enumerate(specs):
            visible = None
            if gpus:
                mine = [gpus[(w * per_worker + k) % len(gpus)] for k in range(per_worker)]
                visible = ",".join(mine)
                spec = replace(spec, device="cuda:0") if spec.device.startswith("cuda") else spec
            reader, writer = ctx.Pipe(duplex=False)
            with environ_set(CUDA_VISIBLE_DEVICES=visible):
                p = ctx.Process(target=worker_process_main, args=(spec, writer), daemon=False)
                p.start()
            writer.close()  # the worker holds the only write end: its death closes the pipe
            running[spec.rank] = p
            pipes[reader] = spec.rank
        _collect(pipes, running, results, errors, progress)
    except KeyboardInterrupt:
        # An interrupt (Ctrl-C) reaches this process alone, as each worker leads its own group:
        # pass it on, so each worker commits what it completed, as on an interrupt of its own.
        for p in running.values():
            if opts.backend in INTERRUPT_WORKER_ALONE:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(p.pid, signal.SIGINT)
            else:
                signal_group(p.pid, signal.SIGINT)
        wait_exited(list(running.values()), timeout=INTERRUPT_GRACE_S)
        raise
    finally:
        for p in running.values():  # a worker still running is killed, with its engine
            end_group(p)
    if errors:
        raise WorkerFailedError(
            "; ".join(errors) + " (committed samples are kept; re-run to resume)", path=opts.out
        )
    return [results[s.rank] for s in specs]


def _collect(
    pipes: dict[Any, int],
    running: dict[int, Any],
    results: dict[int, dict[str, Any]],
    errors: list[str],
    progress: Progress,
) -> None:
    """Read the workers' events until every pipe is closed; end each worker's process group
    once the worker has exited (its engine's processes go with it)."""
    finished: set[int] = set()
    # the samples each worker has taken into its model and not yet committed, in order
    held: dict[int, dict[str, None]] = {}
    while pipes:
        for conn in mp_connection.wait(list(pipes), timeout=1.0):
            rank = pipes[conn]
            try:
                kind, _, payload = conn.recv()
            except EOFError:  # the worker is gone; everything it sent has been read
                del pipes[conn]
                conn.close()
                proc = running[rank]
                wait_exited([proc], timeout=None)
                end_group(running.pop(rank))
                if rank not in finished:
                    finished.add(rank)
                    errors.append(
                        f"worker {rank} died (exit code {proc.exitcode})"
                        + _holding(list(held.get(rank, ())))
                    )
                continue
            if kind == "done":
                results[rank] = payload
                finished.add(rank)
            elif kind == "error":
                errors.append(
                    f"worker {rank}: {payload['message']}" + _holding(list(held.get(rank, ())))
                )
                finished.add(rank)
            elif kind == "batch":
                held.setdefault(rank, {}).update(dict.fromkeys(payload["samples"]))
            elif kind == "committed":
                for sample_id in payload["samples"]:
                    held.get(rank, {}).pop(sample_id, None)
            else:
                progress.handle((kind, rank, payload))


def _holding(samples: list[str]) -> str:
    if not samples:
        return ""
    shown = ", ".join(samples[:8]) + (f" and {len(samples) - 8} more" if len(samples) > 8 else "")
    return f" while extracting samples {shown} (not stored)"


def _summary(
    opts: ExtractOptions,
    layers: list[LayerSpec],
    results: list[dict[str, Any]],
    wall: float,
    shard_i: int,
    shards: int,
) -> dict[str, Any]:
    skipped: Counter = Counter()
    for r in results:
        skipped.update(r["skipped"])
    tokens = sum(r["tokens_written"] for r in results)
    # workers run side by side, so their model throughputs add up
    model_rate = sum(r["tokens_written"] / r["extract_s"] for r in results if r["extract_s"] > 0)
    busy = sum(r["writer_busy_s"] for r in results)
    worker_wall = sum(r["wall_s"] for r in results)
    return {
        "dataset": opts.out,
        "backend": opts.backend,
        "workers": opts.workers,
        "shard": f"{shard_i}/{shards}",
        "layers": [s.label for s in layers],
        "samples_written": sum(r["samples_written"] for r in results),
        "samples_already_present": sum(r["samples_already_present"] for r in results),
        "tokens_written": tokens,
        "skipped": dict(skipped),
        "skipped_total": sum(skipped.values()),
        "commits": sum(r["commits"] for r in results),
        "raw_gb": sum(r["raw_bytes"] for r in results) / 1e9,
        "seconds": wall,
        "tokens_per_s": tokens / wall if wall > 0 else 0.0,
        "extract_tokens_per_s": model_rate,
        "writer_busy_share": busy / worker_wall if worker_wall > 0 else 0.0,
        "writer_stall_s": sum(r["writer_stall_s"] for r in results),
        # start-up left out: tokenising, then the batches through the engine to the last commit
        "tokenize_s": max((r["tokenize_s"] for r in results), default=0.0),
        "batches_s": max((r["batches_s"] for r in results), default=0.0),
    }
