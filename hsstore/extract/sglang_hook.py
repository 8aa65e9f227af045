"""The forward hook SGLang runs inside its scheduler to return the final state with the aux ones.

Loaded by SGLang itself from the ``forward_hooks`` server argument (sglang 0.5.23,
``model_executor/hook_manager.py``: ``hook_factory(config)`` is called in every TP worker and the
hook registered with ``register_forward_hook`` on the modules named ``logits_processor``).
It must stay importable without hsstore's heavy dependencies.

With aux capture on, ``LogitsProcessorOutput.hidden_states`` holds the packed aux captures
``[T, K*H]`` and ``last_hidden_states`` the state the model handed the LM head ``[T, H]``
(``layers/logits_processor.py``: ``_get_hidden_states_to_store`` and
``_get_last_hidden_states_to_store``, FULL capture mode). The hook appends the second to the first,
so the response carries ``[T, (K+1)*H]``. Anything unexpected (no last state, a width other than
``K*H`` because the model substituted its pre-norm state) leaves the output untouched: the
response then has the wrong width and hsstore refuses it, naming the sample.
"""

from __future__ import annotations

from typing import Any


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


def final_state_hook(config: dict[str, Any]):
    """The hook factory named in the server arguments (``config``: ``{"aux_width": K*H}``)."""
    aux_width = int(config["aux_width"])

    def hook(module: Any, args: Any, output: Any) -> None:
        append_final_state(output, aux_width)

    return hook
