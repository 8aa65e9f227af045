"""The forward hook SGLang runs inside its scheduler to hand hsstore the states as tensors.

Loaded by SGLang itself from the ``forward_hooks`` server argument (sglang 0.5.23,
``model_executor/hook_manager.py``: ``hook_factory(config)`` is called in every TP worker and the
hook registered with ``register_forward_hook`` on the modules named ``logits_processor``).
It must stay importable without hsstore's heavy dependencies.

With aux capture on, SGLang captures hidden states in FULL mode for every forward
(``arg_groups/serving_hook.py`` ``handle_return_hidden_states_mode`` sets the server's mode to
``full``): ``LogitsProcessorOutput.hidden_states`` holds the packed aux captures ``[N, K*H]`` of
all N tokens of the batch and ``last_hidden_states`` the state the model handed the LM head
``[N, H]`` (``layers/logits_processor.py``: ``_get_hidden_states_to_store`` and
``_get_last_hidden_states_to_store``). The hook reads the batch's layout from the
``ForwardBatch`` the model passes its logits processor (``rids``, ``extend_seq_lens_cpu``,
``extend_prefix_lens_cpu``) and, for each request whose id starts with hsstore's prefix,
writes its rows into a slot of the worker's capture directory
(:mod:`hsstore.extractors.backends.sglang.capture`), already in stored layer order: at once on the CPU
(:class:`HostSink`), or on a GPU through an asynchronous copy into a pinned buffer that a
thread moves into the slot once the copy's event has completed (:class:`DeviceSink`). Requests ask for no hidden states, so the scheduler itself turns
none into lists (``managers/scheduler_components/batch_result_processor.py``
``_append_prefill_hidden_states`` returns early) and copies none to the host
(``managers/utils.py`` ``copy_to_cpu``).

Only TP rank 0 writes: under tensor parallelism every rank holds the full residual stream
after each layer's all-reduce, so one copy is enough.

The pre-norm final state (``final-prenorm``) is the input of the model's final norm: a second
hook (:func:`final_norm_hook`) on that module keeps a copy of the state each time the norm runs
(``layers/layer_boundary/residual/access.py:40`` ``final_norm_pair``: with a residual, the
fused ``norm(hidden, residual)`` returns ``(normed, hidden + residual)``, ``layers/layernorm.py``
``forward_native`` and ``forward_cpu`` alike, and the CUDA kernel updates the residual in place;
without one, the norm's input is the state), and the logits-processor hook, which runs next in
the same forward, takes it. Every logits-processor call takes what the norm left, so a state
never outlives its forward; a forward in which the norm hook did not run exactly once is a
problem receipt, never a guess.

Mode ``append`` is the list fallback: it appends the final state (and the pre-norm one) to
``hidden_states`` so that a request with ``return_hidden_states=True`` carries
``[T, (K+1)*H]`` (``[T, (K+2)*H]``) as nested lists.
"""

from __future__ import annotations

import queue
import threading
import time
from typing import Any

import numpy as np

from hsstore.extractors.backends.sglang.capture import SlotWriter, bits, dtype_name, write_capture

# Where the model classes of the wheel keep their final norm: the base model's ``norm``, under
# the causal LM (``models/llama.py:460`` ``self.model.norm``) or under a class that delegates to
# one (``*.model.norm``, ``model.language_model.norm``).
FINAL_NORM_MODULES = ("model.norm", "*.model.norm", "model.language_model.norm")
# The final norm's inputs since the last logits-processor call of this process (one TP worker).
_PRENORM: list[Any] = []


def final_norm_hook(config: dict[str, Any]):
    """The hook factory for the model's final norm: keeps a copy of the state entering it."""

    def hook(module: Any, args: Any, output: Any) -> None:
        # fused with the residual add: the updated residual (hidden + residual) is the input
        fused = isinstance(output, tuple) and len(output) >= 2
        state = output[1] if fused else args[0]
        # a copy: the residual's storage is borrowed and may be reused before the logits run
        _PRENORM.append(state.detach().clone())

    return hook


def take_prenorm() -> list[Any]:
    """What the final norm hook kept since the last call (called once per logits forward)."""
    kept = list(_PRENORM)
    _PRENORM.clear()
    return kept


def prenorm_state(kept: list[Any], rows: int) -> tuple[Any, str | None]:
    """(the pre-norm final state of a forward's ``rows`` tokens, None) or (None, why not)."""
    if len(kept) != 1:
        return None, (
            f"the model's final norm hook ran {len(kept)} times in this forward, expected once "
            f"(the final norm is no module named {' or '.join(FINAL_NORM_MODULES)}, or a fused "
            "kernel bypasses it), so there is no pre-norm final state; use --layers "
            "eagle3,final or the transformers backend"
        )
    state = kept[0]
    if state.dim() != 2 or state.shape[0] != rows:
        return None, f"a pre-norm final state of shape {tuple(state.shape)} for {rows} rows"
    return state, None


def append_final_state(output: Any, aux_width: int, prenorm: bool = False) -> bool:
    """Append ``output.last_hidden_states`` (and with ``prenorm`` the final norm's input) to
    ``output.hidden_states`` in place; True if done."""
    import torch

    kept = take_prenorm()
    aux = getattr(output, "hidden_states", None)
    final = getattr(output, "last_hidden_states", None)
    if not isinstance(aux, torch.Tensor) or not isinstance(final, torch.Tensor):
        return False
    if aux.dim() != 2 or final.dim() != 2 or aux.shape[0] != final.shape[0]:
        return False
    if aux.shape[1] != aux_width:
        return False
    blocks = [aux, final.to(aux.dtype)]
    if prenorm:
        state, _ = prenorm_state(kept, int(aux.shape[0]))
        if state is None:  # the worker refuses the narrower rows, naming the sample
            return False
        blocks.append(state.to(aux.dtype))
    output.hidden_states = torch.cat(blocks, dim=-1)
    return True


def _tp_rank() -> int:
    try:
        from sglang.srt.distributed import get_tensor_model_parallel_rank
    except ImportError:  # not inside SGLang (the tests' stand-in engine): a single rank
        return 0
    return int(get_tensor_model_parallel_rank())


def _forward_batch(args: tuple) -> Any:
    for arg in args:
        if hasattr(arg, "rids") and hasattr(arg, "extend_seq_lens_cpu"):
            return arg
    return None


def capture_states(output: Any, args: tuple, config: dict[str, Any], sink: Any) -> int:
    """Hand ``sink`` (:class:`HostSink` or :class:`DeviceSink`) the capture of every hsstore
    request in this forward; returns how many."""
    import torch

    kept = take_prenorm() if config.get("prenorm") else []
    batch = _forward_batch(args)
    if batch is None or not batch.rids:
        return 0
    mode = getattr(batch, "forward_mode", None)
    if mode is None or not mode.is_extend():
        return 0
    prefix = config["rid_prefix"]
    ours = [i for i, rid in enumerate(batch.rids) if str(rid).startswith(prefix)]
    if not ours:
        return 0
    hidden, aux_width, layout = (
        int(config["hidden_size"]),
        int(config["aux_width"]),
        config["layout"],
    )
    lens = [int(n) for n in batch.extend_seq_lens_cpu]
    prefixes = [int(n) for n in (batch.extend_prefix_lens_cpu or [0] * len(lens))]
    aux = getattr(output, "hidden_states", None)
    final = getattr(output, "last_hidden_states", None)
    problem, width = None, None
    if not isinstance(aux, torch.Tensor) or aux.dim() != 2:
        problem = "the logits processor output holds no hidden states"
    elif not isinstance(final, torch.Tensor):
        problem = "the logits processor output holds no last_hidden_states"
        width = int(aux.shape[1])
    elif aux.shape[1] != aux_width or aux.shape[0] != final.shape[0]:
        width = int(aux.shape[1])
        problem = f"aux states of width {aux.shape[1]}, expected {aux_width}"
    elif aux.shape[0] != sum(lens):
        problem = f"{aux.shape[0]} rows of states for the forward's {sum(lens)} tokens"
    prenorm = None
    if not problem and config.get("prenorm"):
        prenorm, problem = prenorm_state(kept, int(aux.shape[0]))
    n_aux = aux_width // hidden
    starts = [sum(lens[:i]) for i in range(len(lens))]
    for i in ours:
        rid, start, rows = str(batch.rids[i]), starts[i], lens[i]
        if problem:
            sink.problem(rid, prefixes[i], problem, width)
            continue
        blocks = []
        for j in layout:  # stored layer order: block j of the aux states, final, pre-norm
            if j < n_aux:
                src = aux[start : start + rows, j * hidden : (j + 1) * hidden]
            else:
                src = (final if j == n_aux else prenorm)[start : start + rows]
            blocks.append(src.to(aux.dtype))
        try:
            sink.write(rid, prefixes[i], blocks)
        except Exception as exc:  # never the scheduler's crash: the worker names the sample
            sink.problem(rid, prefixes[i], f"the capture failed: {type(exc).__name__}: {exc}")
    return len(ours)


class HostSink:
    """States already in host memory (SGLang's CPU engine): copied into a slot at once."""

    def __init__(self, directory: str):
        self.writer = SlotWriter(directory)

    def write(self, rid: str, prefix: int, blocks: list[Any]) -> None:
        write_capture(self.writer, rid, prefix=prefix, blocks=blocks)

    def problem(self, rid: str, prefix: int, problem: str, width: int | None = None) -> None:
        write_capture(self.writer, rid, prefix=prefix, blocks=[], problem=problem, width=width)


class DeviceSink(HostSink):
    """States on a GPU: gathered on the device, copied asynchronously into a pinned host
    buffer, and moved into the slot by a thread once the copy's event has completed, so the
    forward never waits for the device-to-host copy. The slot is claimed at once (its
    temporary name tells the worker the capture is on its way)."""

    def __init__(self, directory: str):
        super().__init__(directory)
        self._queue: queue.Queue = queue.Queue()
        self._pinned: list[Any] = []  # free pinned buffers, reused
        self._lock = threading.Lock()
        threading.Thread(target=self._finish, name="hsstore-capture", daemon=True).start()

    def write(self, rid: str, prefix: int, blocks: list[Any]) -> None:
        import torch

        t0 = time.perf_counter()
        stacked = torch.stack(blocks, dim=1)  # [rows, layers, hidden], contiguous on the device
        nbytes = stacked.numel() * stacked.element_size()
        slot = self.writer.claim(rid, prefix, nbytes)
        buf = self._buffer(nbytes)
        host = buf[:nbytes].view(stacked.dtype).view(stacked.shape)
        host.copy_(stacked, non_blocking=True)
        done = torch.cuda.Event()
        done.record()
        self._queue.put((done, stacked, buf, host, slot, rid, prefix, t0))

    def _buffer(self, nbytes: int) -> Any:
        import torch

        with self._lock:
            fits = [b for b in self._pinned if b.numel() >= nbytes]
            if fits:
                buf = min(fits, key=lambda b: b.numel())
                self._pinned.remove(buf)
                return buf
        return torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)

    def _finish(self) -> None:
        while True:
            done, stacked, buf, host, slot, rid, prefix, t0 = self._queue.get()
            rows, layers, hidden = host.shape
            header = {"rid": rid, "prefix": prefix, "problem": None, "width": None}
            try:
                done.synchronize()
                c0 = time.thread_time()
                np.copyto(bits(slot.view(rows, layers, hidden, host.dtype)), bits(host))
                header.update(rows=rows, layers=layers, hidden=hidden, dtype=dtype_name(host.dtype))
                header["write_s"] = time.perf_counter() - t0
                header["write_cpu_s"] = time.thread_time() - c0
                self.writer.publish(slot, header)
            except Exception as exc:  # the worker waits for this receipt: name the failure
                header.update(rows=0, layers=0, hidden=0, dtype="float32", write_s=0.0)
                header["write_cpu_s"] = 0.0
                header["problem"] = f"the device-to-host copy failed: {type(exc).__name__}: {exc}"
                self.writer.publish(slot, header)
            del stacked, host
            with self._lock:
                self._pinned.append(buf)


def sink_for(states: Any, directory: str) -> HostSink:
    """The sink for states where ``states`` lie: a GPU's, or the host's."""
    return (DeviceSink if getattr(states, "is_cuda", False) else HostSink)(directory)


def capture_hook(config: dict[str, Any]):
    """The hook factory named in the server arguments.

    ``config``: ``mode`` (``shm`` or ``append``), ``aux_width`` (K*H), and for ``shm``:
    ``dir`` (the capture directory), ``rid_prefix``, ``hidden_size`` and ``layout`` (for each
    stored layer, its block: 0..K-1 an aux capture, K the final state, K+1 the pre-norm one);
    ``prenorm``: whether :func:`final_norm_hook` runs on the final norm.
    """
    aux_width = int(config["aux_width"])
    if config.get("mode", "shm") == "append":
        prenorm = bool(config.get("prenorm"))

        def append(module: Any, args: Any, output: Any) -> None:
            append_final_state(output, aux_width, prenorm)

        return append
    state: dict[str, Any] = {}

    def hook(module: Any, args: Any, output: Any) -> None:
        if not state:  # distributed state exists once the model runs, not when hooks load
            state["rank"] = _tp_rank()
        if state["rank"] != 0:
            take_prenorm()  # this rank's copy, never stored
            return
        if "sink" not in state:
            state["sink"] = sink_for(getattr(output, "hidden_states", None), config["dir"])
        capture_states(output, args, config, state["sink"])

    return hook
