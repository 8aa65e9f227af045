"""What the SGLang lane's tests share: the CLI in a child process, prompts, and the reference.

The reference is transformers itself, run here on the same token ids: ``hidden_states[d]`` for
depth ``d < N``, for ``final-prenorm`` the final norm's input (a forward pre-hook on the base
model's ``norm``) and, for ``final``, the tensor the LM head receives (read by a forward pre-hook
on the output embedding, so "final" is checked against what the head really projects).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import psutil
import torch

import hsstore

HERE = Path(__file__).resolve().parent
STUB = HERE / "stub"  # the sgl_kernel stand-in
ROOT = HERE.parent.parent
LOG_ENV = "HSSTORE_SGL_KERNEL_LOG"  # where the stand-in records imports and calls
# no --mem-fraction: every run starts its engine on the fraction hsstore computes for CPU
# (hsstore/extractors/backends/sglang/memory.py), where SGLang's own default is negative
ENGINE_ARGS = ["--backend", "sglang", "--device", "cpu"]
ROWS = [
    {
        "messages": [
            {"role": "user", "content": "Hi there, what is the capital of France?"},
            {"role": "assistant", "content": "The capital of France is Paris."},
        ]
    },
    {"text": "The quick brown fox jumps over the lazy dog."},
    {"text": "def add(a, b):\n    return a + b\n"},
    {
        "conversations": [
            {"from": "human", "value": "Hello! How are you today?"},
            {"from": "gpt", "value": "I am fine, thank you."},
        ]
    },
]
# what two bf16 computations of one dense layer stack may differ by beyond twice transformers'
# own bf16-vs-fp32 distance (measured up to 0.024 on the tiny models: 2^-8 per element, summed)
BF16_REL_TOLERANCE = 0.03
# Ctrl-C's disposition as in a terminal's foreground: a lane started in the background has SIGINT
# ignored, and the CLI and its workers would inherit that.
CLI = (
    "import signal; signal.signal(signal.SIGINT, signal.default_int_handler); "
    "from hsstore.cli import main; main()"
)


def write_prompts(path: Path, rows: list[dict] = ROWS) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def cli(*args: str, env: dict | None = None, **popen) -> subprocess.Popen:
    """`hsstore ...` in a child process of the lane's environment."""
    cmd = [sys.executable, "-c", CLI, *args]
    return subprocess.Popen(
        cmd,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, **(env or {})},
        **popen,
    )


def run_cli(*args: str, timeout: float = 420) -> dict:
    """Run `hsstore extract ... --json` to the end; its summary, or a failure with stderr."""
    proc = cli(*args, "--no-progress", "--json")
    out, err = finish(proc, timeout)
    assert proc.returncode == 0, f"exit {proc.returncode}: {err[-4000:]}"
    return json.loads(out)


def finish(proc: subprocess.Popen, timeout: float) -> tuple[str, str]:
    """The CLI's (stdout, stderr); past ``timeout`` it is killed (its workers, and their
    engines, follow it) and the test fails instead of waiting."""
    try:
        return proc.communicate(timeout=timeout)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate(timeout=60)


def group_members(pgid: int) -> list[psutil.Process]:
    """The processes of process group ``pgid`` (an extraction worker's: itself and its engine's)."""
    out = []
    for p in psutil.process_iter():
        try:
            if os.getpgid(p.pid) == pgid:
                out.append(p)
        except (ProcessLookupError, psutil.NoSuchProcess):
            continue
    return out


class Reference:
    """transformers' own states for the stored token ids, in one dtype."""

    def __init__(self, model_dir: Path, dtype: torch.dtype):
        from transformers import AutoModelForCausalLM

        self.model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).eval()
        self.n = self.model.config.get_text_config().num_hidden_layers

    @torch.no_grad()
    def states(self, input_ids: torch.Tensor) -> tuple[list[torch.Tensor], torch.Tensor]:
        """(hidden_states[0..N] as [T, H] with the final norm's input at N, the LM head's input
        [T, H]) for one sample."""
        seen = {}
        head = self.model.get_output_embeddings()
        hook = head.register_forward_pre_hook(lambda _m, args: seen.setdefault("x", args[0]))
        norm = self.model.get_decoder().norm
        pre = norm.register_forward_pre_hook(lambda _m, args: seen.setdefault("pre", args[0]))
        threads = torch.get_num_threads()
        # one thread: the reduction order of SGLang's CPU engine, so fp32 agrees bit for bit
        torch.set_num_threads(1)
        try:
            out = self.model(input_ids[None], output_hidden_states=True)
        finally:
            torch.set_num_threads(threads)
            hook.remove()
            pre.remove()
        assert len(out.hidden_states) == self.n + 1
        # hidden_states[N] is the normed state; depth N is the norm's input
        return [h[0] for h in out.hidden_states[:-1]] + [seen["pre"][0]], seen["x"][0]


def rel_err(x: torch.Tensor, ref: torch.Tensor) -> float:
    x, ref = x.float(), ref.float()
    return ((x - ref).norm() / ref.norm().clamp_min(1e-12)).item()


def compare(ds_dir: Path, ref: Reference) -> list[dict]:
    """One row per (sample, stored layer): exact equality and relative error vs the reference."""
    ds = hsstore.open(ds_dir)
    rows = []
    for sid in sorted(ds.sample_ids):
        s = ds.get(sid)
        hidden, head_input = ref.states(s.input_ids)
        for j, spec in enumerate(ds.layers):
            expect = head_input if spec.final_norm else hidden[spec.depth]
            got = s.hidden[:, j]
            rows.append(
                {
                    "sample": sid,
                    "layer": spec.label,
                    "depth": spec.depth,
                    "equal": torch.equal(got, expect.to(got.dtype)),
                    "rel_err": rel_err(got, expect),
                    # how far the reference's neighbouring layers are: a capture one layer off
                    # would be at least this far
                    "next_layer_rel": min(
                        (rel_err(hidden[d], expect) for d in (spec.depth - 1, spec.depth + 1)
                         if 0 <= d <= ref.n and d != spec.depth),
                        default=float("inf"),
                    ),
                }
            )  # fmt: skip
    return rows


def stand_in_events() -> tuple[list[str], list[str]]:
    """(imports, calls) the sgl_kernel stand-in recorded so far in this session."""
    path = Path(os.environ[LOG_ENV])
    lines = path.read_text().splitlines() if path.exists() else []
    return [x for x in lines if x.startswith("import ")], [
        x for x in lines if x.startswith("call ")
    ]
