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
writes its rows into the worker's capture directory (:mod:`hsstore.extract.sglang_capture`),
already in stored layer order. Requests ask for no hidden states, so the scheduler itself turns
none into lists (``managers/scheduler_components/batch_result_processor.py``
``_append_prefill_hidden_states`` returns early) and copies none to the host
(``managers/utils.py`` ``copy_to_cpu``).

Only TP rank 0 writes: under tensor parallelism every rank holds the full residual stream
after each layer's all-reduce, so one copy is enough.

Mode ``append`` is the list fallback: it appends the final state to ``hidden_states`` so that a
request with ``return_hidden_states=True`` carries ``[T, (K+1)*H]`` as nested lists.
"""

from __future__ import annotations

from typing import Any

from hsstore.extract.sglang_capture import write_capture


def append_final_state(output: Any, aux_width: int) -> bool:
    """Append ``output.last_hidden_states`` to ``output.hidden_states`` in place; True if done."""
    import torch

    aux = getattr(output, "hidden_states", None)
    final = getattr(output, "last_hidden_states", None)
    if not isinstance(aux, torch.Tensor) or not isinstance(final, torch.Tensor):
        return False
    if aux.dim() != 2 or final.dim() != 2 or aux.shape[0] != final.shape[0]:
        return False
    if aux.shape[1] != aux_width:
        return False
    output.hidden_states = torch.cat([aux, final.to(aux.dtype)], dim=-1)
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


def capture_states(output: Any, args: tuple, config: dict[str, Any]) -> int:
    """Write the capture of every hsstore request in this forward; returns how many."""
    import torch

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
    starts = [sum(lens[:i]) for i in range(len(lens))]
    for i in ours:
        rid, start, rows = str(batch.rids[i]), starts[i], lens[i]
        if problem:
            write_capture(
                config["dir"], rid, prefix=prefixes[i], blocks=[], problem=problem, width=width
            )
            continue
        blocks = []
        for j in layout:  # stored layer order: block j of the aux states, or the final state
            if j * hidden >= aux_width:
                src = final[start : start + rows]
            else:
                src = aux[start : start + rows, j * hidden : (j + 1) * hidden]
            blocks.append(src.to(aux.dtype))
        write_capture(config["dir"], rid, prefix=prefixes[i], blocks=blocks)
    return len(ours)


def capture_hook(config: dict[str, Any]):
    """The hook factory named in the server arguments.

    ``config``: ``mode`` (``shm`` or ``append``), ``aux_width`` (K*H), and for ``shm``:
    ``dir`` (the capture directory), ``rid_prefix``, ``hidden_size`` and ``layout`` (for each
    stored layer, its block: 0..K-1 an aux capture, K the final state).
    """
    aux_width = int(config["aux_width"])
    if config.get("mode", "shm") == "append":

        def append(module: Any, args: Any, output: Any) -> None:
            append_final_state(output, aux_width)

        return append
    rank: list[int] = []

    def hook(module: Any, args: Any, output: Any) -> None:
        if not rank:  # distributed state exists once the model runs, not when hooks load
            rank.append(_tp_rank())
        if rank[0] == 0:
            capture_states(output, args, config)

    return hook
