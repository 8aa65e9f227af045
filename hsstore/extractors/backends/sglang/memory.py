"""SGLang's static memory fraction on CPU, where its own default cannot work.

SGLang sizes its KV pool as ``free memory after loading - free memory before * (1 -
mem_fraction_static)`` (sglang 0.5.23 ``mem_cache/kv_cache_configurator.py``
``_profile_available_bytes``). Its default fraction reserves activation room for a GPU
(``arg_groups/memory_hook.py``: 512 MB + 1.5 MB per prefill token, 16,384 tokens by default)
out of the device's memory; on CPU the device is the host, whose total is then spent on that
reserve and the fraction comes out negative. hsstore asks instead for what an extraction
needs: the weights, a KV pool for :data:`KV_TOKENS` tokens, and a margin, as a fraction of the
memory free now.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
from pathlib import Path
from typing import Any

from hsstore.errors import BadInputError

KV_TOKENS = 32768  # two full prefill batches of SGLang's default max_prefill_tokens
MARGIN_BYTES = 1 << 30
MAX_FRACTION = 0.9
_ITEMSIZE = {"float32": 4, "float16": 2, "bfloat16": 2}
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth")


def available_memory() -> int:
    """Bytes of host memory free for a new process (``MemAvailable``), per NUMA node, as
    SGLang counts it (``utils/common.py`` ``get_available_gpu_memory`` for ``cpu``)."""
    total = None
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                total = int(line.split()[1]) * 1024
    except OSError:
        pass
    if total is None:
        total = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    nodes = len(list(Path("/sys/devices/system/node").glob("node[0-9]*"))) or 1
    return total // nodes


def weight_bytes(model_dir: str, text_config: Any, *, checkpoint_dtype: str, dtype: str) -> int:
    """The weights' bytes once loaded in ``dtype``: the checkpoint files' size, rescaled."""
    files = [p for p in Path(model_dir).glob("*") if p.suffix in _WEIGHT_SUFFIXES]
    on_disk = sum(p.stat().st_size for p in files)
    if not on_disk:  # not a local checkpoint: count the parameters of a dense transformer
        h = int(text_config.hidden_size)
        layers = int(text_config.num_hidden_layers)
        inter = int(getattr(text_config, "intermediate_size", 4 * h) or 4 * h)
        vocab = int(getattr(text_config, "vocab_size", 0) or 0)
        return (layers * (4 * h * h + 3 * h * inter) + 2 * vocab * h) * _ITEMSIZE[dtype]
    return on_disk * _ITEMSIZE[dtype] // _ITEMSIZE.get(checkpoint_dtype, 2)


def kv_bytes_per_token(text_config: Any, dtype: str) -> int:
    layers = int(text_config.num_hidden_layers)
    rank = getattr(text_config, "kv_lora_rank", None)
    if rank:  # MLA caches one compressed vector (+ its rope part) per layer
        return (
            layers
            * (int(rank) + int(getattr(text_config, "qk_rope_head_dim", 0) or 0))
            * _ITEMSIZE[dtype]
        )
    heads = int(text_config.num_attention_heads)
    kv_heads = int(getattr(text_config, "num_key_value_heads", None) or heads)
    head_dim = int(getattr(text_config, "head_dim", None) or text_config.hidden_size // heads)
    return layers * 2 * kv_heads * head_dim * _ITEMSIZE[dtype]


def cpu_mem_fraction(
    model_dir: str,
    text_config: Any,
    *,
    checkpoint_dtype: str,
    dtype: str,
    available: int | None = None,
) -> float:
    """The ``mem_fraction_static`` to pass on CPU, or a clear error when the model cannot fit."""
    free = available_memory() if available is None else available
    weights = weight_bytes(model_dir, text_config, checkpoint_dtype=checkpoint_dtype, dtype=dtype)
    kv = kv_bytes_per_token(text_config, dtype) * KV_TOKENS
    need = weights + kv + MARGIN_BYTES
    fraction = need / max(free, 1)
    if fraction > MAX_FRACTION:
        gib = 1 << 30
        raise BadInputError(
            f"the sglang engine needs about {need / gib:.1f} GiB on this CPU (weights "
            f"{weights / gib:.1f} GiB, KV cache for {KV_TOKENS} tokens {kv / gib:.1f} GiB, "
            f"margin 1 GiB) but {free / gib:.1f} GiB is free; free memory or pass "
            "--mem-fraction",
            path=model_dir,
        )
    return round(max(fraction, 0.01) + 0.0005, 3)


def engine_start_lock_path() -> str:
    """The file whose lock `engine_start_lock` takes: one per host (its temporary directory)."""
    return os.path.join(tempfile.gettempdir(), "hsstore-sglang-cpu-engine-start.lock")


@contextlib.contextmanager
def engine_start_lock():
    """Held while one SGLang engine starts on CPU; engine starts on one host take turns.

    SGLang measures free memory before and after loading the weights and counts the difference
    as the model's (``_profile_available_bytes``, see above); on CPU that memory is the host's,
    so a second engine starting meanwhile (another ``--workers`` worker) has its KV pool counted
    against the first, which then refuses to start. The lock is a file lock, released by the
    kernel if its holder dies.
    """
    import fcntl

    with open(engine_start_lock_path(), "a") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)
