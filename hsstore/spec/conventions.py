"""Layer-id conventions of other frameworks, mapped to and from canonical :class:`LayerSpec`.

Frameworks disagree on what "layer i" means, and a stored hidden state is only useful if we know
which residual-stream position it is. Every stored state is therefore described canonically as
``LayerSpec(depth, final_norm)``: how many decoder layers had been applied (0 = the embeddings,
N = every layer) and whether the model's final norm was applied on top. These functions translate
a producer's own ids into that form (keeping the id and convention as provenance) and back.

The mappings (sources cited in docs/LAYERS.md), for a model with N decoder layers; id v maps to:

- ``hf``: ``output_hidden_states[v]`` (v may be negative) -> depth v, final_norm iff v == N.
- ``vllm``: the residual stream entering decoder layer v (vLLM's eagle3 aux ids, speculators
  0.5+) -> depth v, pre-norm, 0 <= v <= N.
- ``speculators``: the output of decoder layer v, 0-based (speculators v1 files)
  -> depth v + 1, pre-norm, 0 <= v < N.
- ``sglang-llama``: the id passed to sglang, which captures the input of layer v + 1
  -> depth v + 1, pre-norm, -1 <= v < N.
- ``sglang-deepseek``: as sglang-llama when the first id is 1, otherwise depth v.
- ``specforge``: aux ids as sglang-llama; id N names the stored final state (post-norm).

The deepseek rule depends on the whole list, so every function takes the whole list of ids.
"""

from __future__ import annotations

from collections.abc import Sequence

from hsstore.errors import ConventionError  # with the other errors; importable from here too
from hsstore.spec.layers import MAX_DEPTH, LayerSpec

HF = "hf"
VLLM = "vllm"
SPECULATORS = "speculators"
SGLANG_LLAMA = "sglang-llama"
SGLANG_DEEPSEEK = "sglang-deepseek"
SPECFORGE = "specforge"

CONVENTIONS: tuple[str, ...] = (HF, VLLM, SPECULATORS, SGLANG_LLAMA, SGLANG_DEEPSEEK, SPECFORGE)

# Spellings users are likely to type; each maps to one canonical name above.
_ALIASES: dict[str, str] = {
    "huggingface": HF,
    "transformers": HF,
    "speculators-v1": SPECULATORS,
    "speculators-arrow": VLLM,
    "sglang": SGLANG_LLAMA,
    "sglang-llama-family": SGLANG_LLAMA,
    "sglang-deepseek-v2": SGLANG_DEEPSEEK,
}


def normalize_convention(name: str) -> str:
    """Return the canonical spelling of a convention name, or raise ConventionError."""
    key = name.strip().lower().replace("_", "-")
    key = _ALIASES.get(key, key)
    if key not in CONVENTIONS:
        raise ConventionError(f"unknown layer convention {name!r}; known: {', '.join(CONVENTIONS)}")
    return key


def _check_n(num_hidden_layers: int) -> None:
    if (
        not isinstance(num_hidden_layers, int)
        or isinstance(num_hidden_layers, bool)
        or not 1 <= num_hidden_layers <= MAX_DEPTH
    ):
        raise ConventionError(
            f"num_hidden_layers must be an int in 1..{MAX_DEPTH}, got {num_hidden_layers!r}"
        )


def _deepseek_shifts(ids: Sequence[int]) -> bool:
    """sglang's deepseek_v2 adds +1 to every id only when the first passed id is 1."""
    return len(ids) > 0 and ids[0] == 1


def to_canonical(convention: str, ids: Sequence[int], num_hidden_layers: int) -> list[LayerSpec]:
    """Translate a producer's layer ids into canonical specs, in the given order.

    The result keeps ``source_convention`` and ``source_id`` so the original naming survives.
    Raises ConventionError for ids that fall outside the model (depth not in 0..N).
    """
    conv = normalize_convention(convention)
    _check_n(num_hidden_layers)
    n = num_hidden_layers
    ids = [int(v) for v in ids]
    shift = _deepseek_shifts(ids) if conv == SGLANG_DEEPSEEK else False
    out: list[LayerSpec] = []
    for v in ids:
        final_norm = False
        if conv == HF:
            depth = v + n + 1 if v < 0 else v
            final_norm = depth == n
        elif conv == VLLM:
            depth = v
        elif conv in (SPECULATORS, SGLANG_LLAMA):
            depth = v + 1
        elif conv == SGLANG_DEEPSEEK:
            depth = v + 1 if shift else v
        else:  # specforge
            if v == n:
                depth, final_norm = n, True
            else:
                depth = v + 1
        if depth < 0 or depth > n or (conv == SPECULATORS and v < 0):
            raise ConventionError(f"{conv} layer id {v} is outside a model with {n} decoder layers")
        out.append(
            LayerSpec(depth=depth, final_norm=final_norm, source_convention=conv, source_id=v)
        )
    return out


def from_canonical(
    convention: str, layers: Sequence[LayerSpec], num_hidden_layers: int
) -> list[int]:
    """Express canonical specs as ids of a convention, in the given order.

    Raises ConventionError when a state has no id in that convention (for example a
    post-norm final state in ``vllm``/``speculators``, whose ids only name pre-norm states).
    """
    conv = normalize_convention(convention)
    _check_n(num_hidden_layers)
    n = num_hidden_layers
    for spec in layers:
        if spec.depth > n:
            raise ConventionError(f"depth {spec.depth} exceeds a model with {n} decoder layers")
        if spec.final_norm and spec.depth != n:
            raise ConventionError(f"final_norm is only meaningful at depth {n}, got {spec.depth}")

    def refuse(spec: LayerSpec, why: str) -> ConventionError:
        return ConventionError(f"{spec.label} has no {conv} layer id: {why}")

    if conv == SGLANG_DEEPSEEK:
        return _deepseek_ids(layers, n, refuse)
    ids: list[int] = []
    for spec in layers:
        if conv == HF:
            if spec.depth == n and not spec.final_norm:
                raise refuse(spec, "hf reports the last state after the final norm")
            ids.append(spec.depth)
            continue
        if spec.final_norm:
            if conv == SPECFORGE:
                ids.append(n)
                continue
            raise refuse(spec, "its ids name states before the final norm")
        if conv == VLLM:
            ids.append(spec.depth)
        else:  # speculators, sglang-llama, specforge: id v means depth v + 1
            if spec.depth == 0 and conv == SPECULATORS:
                raise refuse(spec, "its ids start at the output of the first decoder layer")
            ids.append(spec.depth - 1)  # sglang captures the embeddings (depth 0) for id -1
    return ids


def _deepseek_ids(layers: Sequence[LayerSpec], n: int, refuse) -> list[int]:
    """Pick ids that sglang's deepseek_v2 rule maps back to exactly these depths.

    Unshifted ids (id == depth) work unless the first id would be 1, which sglang shifts;
    then the shifted form (id == depth - 1, first id 1) works only if the first depth is 2.
    """
    for spec in layers:
        if spec.final_norm:
            raise refuse(spec, "its ids name states before the final norm")
    depths = [s.depth for s in layers]
    if not depths or depths[0] != 1:
        return depths
    raise refuse(
        layers[0],
        "a first id of 1 is shifted by sglang, so depth 1 cannot come first",
    )


def sglang_ids(
    depths: Sequence[int], num_hidden_layers: int, convention: str = SGLANG_LLAMA
) -> list[int]:
    """The aux ids that make SGLang capture exactly ``depths`` (pre-norm states).

    A list that starts with id 1 (depth 2) is read the same way under both of SGLang's rules,
    so when depth 2 is among ``depths`` it leads and the ids serve any target. Otherwise
    ``convention`` (the target's rule: sglang-llama or sglang-deepseek) decides, and under
    sglang-deepseek depth 1 never comes first.
    """
    conv = normalize_convention(convention)
    ordered = sorted(depths)
    if 2 in ordered:
        ordered, conv = [2] + [d for d in ordered if d != 2], SGLANG_LLAMA
    elif conv == SGLANG_DEEPSEEK:
        if ordered == [1]:
            raise ConventionError(
                "SGLang cannot capture depth 1 alone under the sglang-deepseek rule: it reads "
                "a leading id 1 as depth 2"
            )
        ordered = [d for d in ordered if d != 1] + [d for d in ordered if d == 1]
    return from_canonical(conv, [LayerSpec(d) for d in ordered], num_hidden_layers)
