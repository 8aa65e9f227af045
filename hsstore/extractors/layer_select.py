"""Parsing ``--layers`` into canonical LayerSpecs, and the default EAGLE-3 choice.

Syntax (comma separated; the full description is in docs/EXTRACT.md):

* ``K`` (an integer 0..N): the residual stream after K decoder layers (0 = embeddings,
  N = after the last layer, before the final norm);
* ``final``: after the last layer *and* the model's final norm (what HF returns as
  ``hidden_states[N]`` and what the LM head reads);
* ``final-prenorm``: the same as ``N``;
* ``eagle3``: the standard EAGLE-3 aux layers (see :func:`eagle3_aux_layers`);
* ``CONVENTION:ids`` (e.g. ``sglang-llama:1,15,28``): ids in another framework's convention,
  translated by :mod:`hsstore.spec.conventions` (every other token after the prefix is an id
  in that convention).

The default (:func:`default_layers`) is ``eagle3,final-prenorm``: the final state before the
norm, which every peer can use (docs/LAYERS.md, "Which final state is stored"), for every
backend. All translation
between conventions goes through :mod:`hsstore.spec.conventions`; nothing here knows another
framework's numbering except the default aux choice, which is defined as vLLM/SGLang define it
(ids of the residual entering decoder layer ``2, N//2, N-3``) and translated from there.
"""

from __future__ import annotations

from hsstore.errors import BadInputError
from hsstore.spec import conventions
from hsstore.spec.layers import LayerSpec

# The final state before the norm serves every consumer: speculators' trainers (v1 files and
# Arrow) apply the target's final norm to the last stored layer themselves, and SpecForge's
# post-norm state is that norm applied on export. The reverse is impossible: RMSNorm discards
# each token's scale, so a post-norm state cannot be turned back into the pre-norm one.
DEFAULT_LAYERS = "eagle3,final-prenorm"


def default_layers(backend: str) -> str:
    """The ``--layers`` value a run of ``backend`` uses when none is given: every backend
    captures the pre-norm final state (SGLang's through a hook on the final norm)."""
    return DEFAULT_LAYERS


def eagle3_aux_layers(num_hidden_layers: int) -> list[LayerSpec]:
    """The EAGLE-3 aux layers vLLM, SGLang and SpecForge capture by default.

    vLLM's ``get_eagle3_aux_hidden_state_layers`` and SGLang's ``set_eagle3_layers_to_capture``
    both capture the residual entering decoder layers ``(2, N//2, N-3)``: canonical depths
    2, N//2 and N-3. For very shallow models the ids are clamped to 1..N-1 and de-duplicated.
    """
    n = num_hidden_layers
    ids = sorted({min(max(v, 1), max(n - 1, 1)) for v in (2, n // 2, n - 3)})
    specs = conventions.to_canonical(conventions.VLLM, ids, n)
    # The canonical meaning is what we store; provenance of the default is not a user's id.
    return [LayerSpec(depth=s.depth) for s in specs]


def parse_layers(text: str | None, num_hidden_layers: int) -> list[LayerSpec]:
    """Parse a ``--layers`` value for a model with ``num_hidden_layers`` decoder layers."""
    n = num_hidden_layers
    text = DEFAULT_LAYERS if text is None or not text.strip() else text
    tokens = [t.strip() for t in text.split(",") if t.strip()]
    out: list[LayerSpec] = []
    for i, token in enumerate(tokens):
        if ":" in token:
            out.extend(_foreign(token, tokens[i + 1 :], n))
            break
        out.extend(_canonical(token, n))
    if not out:
        raise BadInputError("--layers names no layer")
    seen: set[tuple[int, bool]] = set()
    for spec in out:
        key = (spec.depth, spec.final_norm)
        if key in seen:
            raise BadInputError(f"--layers names {spec.label} twice")
        seen.add(key)
    return out


def _canonical(token: str, n: int) -> list[LayerSpec]:
    low = token.lower()
    if low == "final":
        return [LayerSpec(depth=n, final_norm=True)]
    if low in ("final-prenorm", "final_prenorm"):
        return [LayerSpec(depth=n)]
    if low == "eagle3":
        return eagle3_aux_layers(n)
    value = _int(token, n)
    if not 0 <= value <= n:
        raise BadInputError(
            f"--layers: depth {value} is outside 0..{n} for a model with {n} layers"
        )
    return [LayerSpec(depth=value)]


def _foreign(first: str, rest: list[str], n: int) -> list[LayerSpec]:
    """``CONV:id,id,...``: the whole id list is translated at once (sglang-deepseek needs it)."""
    name, head = (part.strip() for part in first.split(":", 1))
    ids = [_int(t, n) for t in ([head] if head else []) + rest]
    try:
        return conventions.to_canonical(conventions.normalize_convention(name), ids, n)
    except conventions.ConventionError as exc:
        raise BadInputError(f"--layers: {exc}") from exc


def _int(token: str, n: int) -> int:
    try:
        return int(token)
    except ValueError:
        raise BadInputError(
            f"--layers: {token!r} is not a layer (use integers 0..{n}, 'final', "
            "'final-prenorm', 'eagle3' or CONVENTION:id,id,...)"
        ) from None
