"""How fast hidden states travel from a real SGLang engine to hsstore, against the list path.

Run inside SGLang's environment (sglang 0.5.23; on CPU with ``SGLANG_USE_CPU_ENGINE=1``), from
the repository root: ``python tools/bench_sglang.py`` (or ``python -m tools.bench_sglang``).
A random Llama of the seed's width (hidden size 7168, 4 layers so that four states are captured: depths 1-3 and the final state;
a small MLP and vocabulary keep the forward cheap), bf16, 512-token prompts in batches of 2.
Each phase runs its engine in its own process (one engine per process):

1. ``capture``: hsstore's backend (forward hook -> shared-memory slots -> tensors), each batch
   paired with the same prompts under request ids the hook ignores; the hook's copy and the
   worker's receipt and check are timed on their own threads (wall and CPU seconds);
2. ``lists``: the backend's list fallback (``return_hidden_states``), paired the same way;
3. ``plain``: the engine with no aux capture and no hook, its forward alone, run before and
   after the extractions;
4. ``hsstore extract --backend sglang`` on 2 and on ``--extract-rows`` prompts: the extra
   prompts' tokens over the difference of the two runs' work (their summaries' ``tokenize_s``
   plus ``batches_s``: tokenising, and the batches through the engine to the last commit), so
   engine start-up, which swings by seconds from run to run, is not counted (the ratio of the
   whole runs' wall times is printed too);
5. ``writer``: batches through the backend in blocks of four, alternately handed to a writer
   thread as ``hsstore extract`` does and dropped, in one engine: what the writer running
   beside the forward costs it.

Phases 3 and 4 alternate over ``--rounds`` rounds (the plain forward, then the two
extractions): a shared machine's pace drifts by 10% and more between processes a minute apart,
so each round's extraction is set against the forward measured just before it, and the median
round is reported.

For each pair: the wall time, the CPU time of every process (this one and the engine's) and
the peak private memory (RssAnon) with capture minus without; the capture's shared memory is
the slot pool's size (each page once).

Last line:

* ``capture_gb_s``: state bytes / CPU seconds of the hook's copy plus the worker's check (each
  on one thread, so this is the rate on one host core, and a machine whose cores are shared
  with other work slows it little);
* ``capture_vs_list``: that over the list path's rate, state bytes / the CPU seconds the list
  path adds to the pair (median pair; the tolist, pickle and unpickle in SGLang's processes
  and the conversion back in hsstore's);
* ``host_us_per_token``: the capture's CPU microseconds per token;
* ``peak_rss_per_sample``: memory the capture adds per in-flight sample (its slot pool plus
  the median private-memory difference), over the sample's state bytes;
* ``extract_vs_forward``: ``hsstore extract``'s tokens/s over the plain forward's, the median
  of the rounds.

The line before it gives the same in other units: wall-clock rates, and the paired
differences per token in CPU and in wall time (the latter need an idle machine). The line
before that splits the median round's extraction, in microseconds per extra token: ``wall``
= ``forward`` (the plain forward's pace) + ``in_engine`` (the rest of the time the worker
waited on the engine: the capture's hook and receipt, which the paired phase measures as
``capture``, the forward's share of the cores that the writer thread takes, which phase 5
measures as ``writer``, and the engine's own aux capture) + ``outside`` (tokenising, the
writer's tail and last commit); every round's ratio; and every round's ratio from the whole
runs' wall times.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # run as a script from anywhere (spawned phases run this again)

from tools.process_meter import PeakMemory, cpu_s, phase, process_tree  # noqa: E402

HIDDEN = 7168
LAYERS = 4
LAYER_SPEC = "1,2,3,final"
TOKENS = 512
BATCH = 2
FEW = 2  # prompts of the shorter extraction; the longer one's extra prompts are what counts
WRITER_BLOCK = 4  # batches written, then as many dropped, in the writer phase


def build_model(out: Path) -> Path:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from hsstore.demo_model import build_tiny_model

    tok = build_tiny_model(out / "tok", hidden=64, layers=1)
    base = json.loads((tok / "config.json").read_text())
    config = LlamaConfig(
        vocab_size=base["vocab_size"],
        hidden_size=HIDDEN,
        intermediate_size=2048,
        num_hidden_layers=LAYERS,
        num_attention_heads=HIDDEN // 128,
        num_key_value_heads=8,
        max_position_embeddings=2048,
        rms_norm_eps=1e-5,
        initializer_range=0.02,
        tie_word_embeddings=False,
        bos_token_id=base.get("bos_token_id"),
        eos_token_id=base.get("eos_token_id"),
        pad_token_id=base.get("pad_token_id"),
    )
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).to(torch.bfloat16).eval()
    path = out / "model"
    model.save_pretrained(path, safe_serialization=True)
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        if (tok / name).exists():
            shutil.copy(tok / name, path / name)
    return path


def prompts(n: int, vocab: int, seed: int = 0) -> list[Any]:
    import torch

    from hsstore.extractors.chat_tokens import TokenizedPrompt

    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        ids = torch.randint(3, vocab, (TOKENS,), generator=g, dtype=torch.int64)
        out.append(TokenizedPrompt(f"b{i}", i, ids, torch.ones_like(ids), "bench", False))
    return out


def _engine_args(model: str) -> dict[str, Any]:
    return {
        "model_path": model,
        "skip_tokenizer_init": True,
        "disable_radix_cache": True,
        "chunked_prefill_size": -1,
        "disable_prefill_cuda_graph": True,
        "disable_decode_cuda_graph": True,
        "dtype": "bfloat16",
        "random_seed": 0,
        "log_level": "error",
        "device": "cpu",
        "attention_backend": "torch_native",
    }


def _plain_generate(engine: Any, batch: list[Any], tag: str) -> None:
    engine.generate(
        input_ids=[p.input_ids.tolist() for p in batch],
        sampling_params={"max_new_tokens": 1, "temperature": 0.0},
        rid=[f"{tag}-{p.sample_id}-{time.monotonic_ns()}" for p in batch],
    )


def phase_plain(model: str, batches: int, vocab: int) -> dict[str, Any]:
    import sglang

    engine = sglang.Engine(**_engine_args(model), mem_fraction_static=_fraction(model))
    try:
        data = prompts(BATCH * (batches + 1), vocab)
        _plain_generate(engine, data[:BATCH], "warm")
        t0 = time.perf_counter()
        for b in range(1, batches + 1):
            _plain_generate(engine, data[b * BATCH : (b + 1) * BATCH], "plain")
        wall = time.perf_counter() - t0
    finally:
        engine.shutdown()
    return {"tokens": batches * BATCH * TOKENS, "wall_s": wall}


def _fraction(model: str) -> float:
    from transformers import AutoConfig

    from hsstore.extractors.backends.sglang.memory import cpu_mem_fraction

    return cpu_mem_fraction(
        model, AutoConfig.from_pretrained(model), checkpoint_dtype="bfloat16", dtype="bfloat16"
    )


def phase_backend(model: str, capture: str, batches: int, vocab: int) -> dict[str, Any]:
    """Batches through hsstore's backend, each paired with the same prompts under request ids
    the capture ignores, in one engine: the pair's difference in wall time, in CPU time of
    every process, and in private memory is what the capture costs."""
    import warnings

    from hsstore.extractors.backends.sglang.backend import SGLangBackend
    from hsstore.extractors.layer_select import parse_layers

    layers = parse_layers(LAYER_SPEC, LAYERS)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        backend = SGLangBackend(model, layers, dtype="bfloat16", device="cpu", capture=capture)
    try:
        data = prompts(BATCH * (batches + 1), vocab)
        _plain_generate(backend.engine, data[:BATCH], "warm")
        return paired_capture(
            backend, data, batches, lambda batch: _plain_generate(backend.engine, batch, "nocap")
        )
    finally:
        backend.close()


def phase_writer(model: str, work: str, blocks: int, vocab: int) -> dict[str, Any]:
    """Batches through hsstore's backend in blocks of WRITER_BLOCK, alternately handed to a
    writer thread as ``hsstore extract`` does (writing into a dataset, committing as it does)
    and dropped, in one engine: the difference of the median batch times is what the writer
    costs the forward it runs beside. The first batch of each block, which the block before
    it still overlaps, is left out."""
    import uuid
    import warnings

    import torch

    import hsstore
    from hsstore.extractors.backends.sglang.backend import SGLangBackend
    from hsstore.extractors.layer_select import parse_layers
    from hsstore.extractors.options import ExtractOptions
    from hsstore.extractors.writer_thread import WriterThread

    layers = parse_layers(LAYER_SPEC, LAYERS)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        backend = SGLangBackend(model, layers, dtype="bfloat16", device="cpu")
    defaults = ExtractOptions(model=model, data="", out="")
    try:
        ds = hsstore.create(Path(work) / f"writer-{uuid.uuid4().hex[:8]}", layers=layers,
                            hidden_size=backend.hidden_size, dtype=torch.bfloat16)  # fmt: skip
        writer = WriterThread(
            ds, commit_every=defaults.commit_every, commit_seconds=defaults.commit_seconds
        ).start()
        data = prompts(BATCH * (2 * blocks * WRITER_BLOCK + 1), vocab)
        backend.run(data[:BATCH])
        times: dict[str, list[float]] = {"write": [], "drop": []}
        for b in range(2 * blocks * WRITER_BLOCK):
            arm = "write" if (b // WRITER_BLOCK) % 2 == 0 else "drop"
            batch = data[(b + 1) * BATCH : (b + 2) * BATCH]
            t0 = time.perf_counter()
            states = backend.run(batch)
            if b % WRITER_BLOCK:
                times[arm].append(time.perf_counter() - t0)
            if arm == "write":
                writer.put(list(zip(batch, states)))
            del states
        writer.finish()
    finally:
        backend.close()
    return {
        "tokens_per_batch": BATCH * TOKENS,
        "write_batch_s": _median(times["write"]),
        "drop_batch_s": _median(times["drop"]),
        "times": times,
    }


def paired_capture(backend: Any, data: list[Any], batches: int, plain: Any) -> dict[str, Any]:
    """``batches`` batches of ``data`` (after its first) through ``backend.run``, each paired
    with ``plain(batch)``, the same prompts under request ids the capture ignores, in the same
    engine (tools/bench_vllm.py measures its backend the same way)."""
    states = backend.run(data[:BATCH])  # first use of the slots: their pages are faulted
    state_bytes = sum(s.numel() * s.element_size() for s in states) // len(states)
    del states
    backend.capture_stats.clear()
    procs = process_tree()
    walls, cpus, anons, shared = [], [], [], 0
    for b in range(1, batches + 1):
        batch = data[b * BATCH : (b + 1) * BATCH]
        with PeakMemory(procs, backend.capture_dir) as without:
            c0, t0 = cpu_s(procs), time.perf_counter()
            plain(batch)
            wall, cpu = time.perf_counter() - t0, cpu_s(procs) - c0
        with PeakMemory(procs, backend.capture_dir) as mem:
            c0, t0 = cpu_s(procs), time.perf_counter()
            states = backend.run(batch)
            walls.append(time.perf_counter() - t0 - wall)
            cpus.append(cpu_s(procs) - c0 - cpu)
            del states  # the writer is done with them: their slots are free again
        anons.append(mem.anon - without.anon)
        shared = max(shared, mem.shared)
    return {
        "tokens": batches * BATCH * TOKENS,
        "wall_diff_s": _median(walls) * batches,
        "cpu_diff_s": _median(cpus) * batches,
        "stats": dict(backend.capture_stats),
        "state_bytes_per_sample": state_bytes,
        # the slots (shared, kept for reuse) and what else the capture allocates, per sample
        "memory_added_per_sample": (shared + max(0, _median(anons))) / BATCH,
        "slot_pool_bytes": shared,
        "private_added_bytes": anons,
    }


def _median(values: list[float]) -> float:
    # The engine's own allocations swing a batch's peak private memory by 100+ MB either way:
    # the middle of several paired batches, not one of them, is what the capture adds.
    return statistics.median(values)


def phase_extract(
    model: str,
    work: str,
    rows: int,
    backend: str = "sglang",
    max_batch_tokens: int = 16384,
    tag: str = "",
) -> dict[str, Any]:
    """``hsstore extract --backend BACKEND`` on ``rows`` chat prompts cut at TOKENS tokens,
    into a fresh dataset named by ``rows``, ``backend`` and ``tag``."""
    from hsstore.extractors.runner import ExtractOptions, run_extract
    from tools.gpu_check_sglang import write_prompts

    data = write_prompts(Path(work) / f"p{rows}.jsonl", rows, seed=1)
    long = Path(work) / f"long{rows}-{backend}.jsonl"
    with long.open("w") as f:  # replies long enough that every prompt is cut at TOKENS
        for line in data.read_text().splitlines():
            row = json.loads(line)
            row["messages"][1]["content"] = " ".join([row["messages"][1]["content"]] * 20)
            f.write(json.dumps(row) + "\n")
    t0 = time.perf_counter()
    summary = run_extract(
        ExtractOptions(
            model=model,
            data=str(long),
            out=str(Path(work) / f"ds{rows}-{backend}{tag}"),
            backend=backend,
            device="cpu",
            dtype="bfloat16",
            layers=LAYER_SPEC,
            max_length=TOKENS,
            batch_size=BATCH,
            max_batch_tokens=max_batch_tokens,
            progress=False,
        )
    )
    tokens = summary["tokens_written"]
    engine_rate = summary["extract_tokens_per_s"]  # tokens over the time spent in backend.run
    return {
        "wall_s": time.perf_counter() - t0,
        "tokens": tokens,
        "engine_s": tokens / engine_rate if engine_rate else 0.0,
        # the run without its start-up: tokenising, and the batches to the last commit
        "work_s": summary["tokenize_s"] + summary["batches_s"],
    }


def extraction_round(
    model: str, work: Path, r: int, extra_batches: int, vocab: int
) -> dict[str, Any]:
    """One round: the plain forward, then the extractions of FEW prompts and of more; the
    extra prompts' tokens/s against the forward's, and where the extra wall time went."""
    plain = phase(f"plain_{r}", phase_plain, model, extra_batches, vocab)
    rows, tag = extra_batches * BATCH + FEW, f"-{r}"
    few = phase(f"extract_few_{r}", phase_extract, model, str(work), FEW, "sglang", 16384, tag)
    many = phase(f"extract_many_{r}", phase_extract, model, str(work), rows, "sglang", 16384, tag)
    tokens = many["tokens"] - few["tokens"]
    # The extractions' work, start-up left out: the engine's start swings by seconds from
    # run to run, more than the extra prompts' whole difference in wall time.
    wall, engine = many["work_s"] - few["work_s"], many["engine_s"] - few["engine_s"]
    plain_tps = plain["tokens"] / plain["wall_s"]
    extract_tps = tokens / max(wall, 1e-3)
    forward_us = 1e6 / plain_tps
    return {
        "plain": plain,
        "few": few,
        "many": many,
        "plain_tokens_s": plain_tps,
        "extract_tokens_s": extract_tps,
        "ratio": extract_tps / plain_tps,
        "wall_us": wall / tokens * 1e6,
        "forward_us": forward_us,
        "in_engine_us": engine / tokens * 1e6 - forward_us,
        "outside_us": (wall - engine) / tokens * 1e6,
        "wall_ratio": tokens / max(many["wall_s"] - few["wall_s"], 1e-3) / plain_tps,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batches", type=int, default=7)
    parser.add_argument("--list-batches", type=int, default=1)
    parser.add_argument("--extract-rows", type=int, default=18)
    parser.add_argument("--rounds", type=int, default=3, help="plain/extraction rounds")
    parser.add_argument("--writer-blocks", type=int, default=2, help="writer phase's blocks")
    parser.add_argument("--out", help="working directory (default: a temporary one)")
    args = parser.parse_args(argv)
    os.environ.setdefault("SGLANG_USE_CPU_ENGINE", "1")
    # the phases' processes and the engines' own import this checkout's hsstore and tools
    path = os.environ.get("PYTHONPATH")
    os.environ["PYTHONPATH"] = str(ROOT) + (os.pathsep + path if path else "")
    work = Path(args.out or tempfile.mkdtemp(prefix="hsstore-bench-sglang-"))
    work.mkdir(parents=True, exist_ok=True)
    model = str(build_model(work))
    vocab = json.loads((Path(model) / "config.json").read_text())["vocab_size"]
    extra_batches = (args.extract_rows - FEW) // BATCH

    report: dict[str, Any] = {}
    report["capture"] = phase("capture", phase_backend, model, "shm", args.batches, vocab)
    report["lists"] = phase("lists", phase_backend, model, "lists", args.list_batches, vocab)
    report["writer"] = phase("writer", phase_writer, model, str(work), args.writer_blocks, vocab)
    # each round: the plain forward (as many batches as the extractions differ by), then both
    report["rounds"] = [
        extraction_round(model, work, r, extra_batches, vocab) for r in range(args.rounds)
    ]
    print(json.dumps(report, indent=2))

    rounds = sorted(report["rounds"], key=lambda r: r["ratio"])
    mid = rounds[len(rounds) // 2]
    plain_tps, extract_tps = mid["plain_tokens_s"], mid["extract_tokens_s"]
    cap, lst = report["capture"], report["lists"]
    cap_bytes = cap["state_bytes_per_sample"] * cap["tokens"] / TOKENS
    # the hook's copy and the worker's check, each on one thread: CPU seconds, so a machine
    # whose cores are shared slows neither figure
    host_s = cap["stats"]["write_cpu_s"] + cap["stats"]["read_cpu_s"]
    capture_gb_s = cap_bytes / host_s / 1e9
    list_bytes = lst["state_bytes_per_sample"] * lst["tokens"] / TOKENS
    list_gb_s = list_bytes / max(lst["cpu_diff_s"], 1e-9) / 1e9
    wall_s = cap["stats"]["write_s"] + cap["stats"]["read_s"]
    capture_wall_us = cap["wall_diff_s"] / cap["tokens"] * 1e6
    wr = report["writer"]
    writer_us = (wr["write_batch_s"] - wr["drop_batch_s"]) / wr["tokens_per_batch"] * 1e6
    print(
        f"wall_us={mid['wall_us']:.0f} forward_us={mid['forward_us']:.0f}"
        f" in_engine_us={mid['in_engine_us']:.0f} capture_us={capture_wall_us:.0f}"
        f" writer_us={writer_us:.0f}"
        f" outside_us={mid['outside_us']:.0f}"
        f" round_ratios={','.join(format(r['ratio'], '.2f') for r in report['rounds'])}"
        f" whole_run_ratios={','.join(format(r['wall_ratio'], '.2f') for r in report['rounds'])}"
    )
    print(
        f"plain_tokens_s={plain_tps:.0f} extract_tokens_s={extract_tps:.0f}"
        f" list_gb_s={list_gb_s:.4f} capture_wall_gb_s={cap_bytes / wall_s / 1e9:.2f}"
        f" capture_cpu_diff_us_per_token={cap['cpu_diff_s'] / cap['tokens'] * 1e6:.1f}"
        f" capture_wall_diff_us_per_token={capture_wall_us:.1f}"
        f" state_kib_per_token={cap['state_bytes_per_sample'] / TOKENS / 1024:.1f}"
    )
    memory = cap["memory_added_per_sample"] / cap["state_bytes_per_sample"]
    print(
        f"capture_gb_s={capture_gb_s:.2f} capture_vs_list={capture_gb_s / list_gb_s:.0f}"
        f" host_us_per_token={host_s / cap['tokens'] * 1e6:.1f}"
        f" peak_rss_per_sample={memory:.2f}x extract_vs_forward={extract_tps / plain_tps:.2f}"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
