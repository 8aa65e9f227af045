"""Layer-id conventions map to canonical (depth, final_norm) and back, exactly."""

from __future__ import annotations

import itertools

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from hsstore.spec import conventions
from hsstore.spec.conventions import (
    CONVENTIONS,
    ConventionError,
    from_canonical,
    normalize_convention,
    to_canonical,
)
from hsstore.spec.layers import LayerSpec


def depths(conv: str, ids: list[int], n: int) -> list[tuple[int, bool]]:
    return [(s.depth, s.final_norm) for s in to_canonical(conv, ids, n)]


# ---------------------------------------------------------------- the documented semantics


@pytest.mark.parametrize("n", [4, 32, 61])
def test_defaults_of_each_producer_name_the_same_residual_positions(n):
    """Each producer's default picks (ids from its source) land on sglang's default depths."""
    sglang_default = [2, n // 2, n - 3]  # layers_to_capture when no ids are passed (no +1)
    # speculators v0.4 default [2, N//2, N-3, N-1]: output of layer v -> depth v + 1.
    assert depths("speculators", [2, n // 2, n - 3, n - 1], n) == [
        (3, False),
        (n // 2 + 1, False),
        (n - 2, False),
        (n, False),
    ]
    # SpecForge default aux ids [1, N//2 - 1, N - 4] go through sglang's +1.
    assert [d for d, _ in depths("specforge", [1, n // 2 - 1, n - 4], n)] == sglang_default
    assert [d for d, _ in depths("sglang-llama", [1, n // 2 - 1, n - 4], n)] == sglang_default
    # speculators 0.5+ launch_vllm default [2, N//2, N-3, N]: vLLM ids are depths.
    assert depths("vllm", [2, n // 2, n - 3, n], n) == [
        (2, False),
        (n // 2, False),
        (n - 3, False),
        (n, False),
    ]


def test_hf_last_state_is_post_norm_and_negative_ids_count_from_the_end():
    assert depths("hf", [0, 3, 8], 8) == [(0, False), (3, False), (8, True)]
    assert depths("hf", [-1, -2, -9], 8) == [(8, True), (7, False), (0, False)]


def test_sglang_deepseek_shifts_only_when_the_first_id_is_1():
    assert [d for d, _ in depths("sglang-deepseek", [1, 16, 29], 32)] == [2, 17, 30]
    assert [d for d, _ in depths("sglang-deepseek", [2, 16, 29], 32)] == [2, 16, 29]
    # The rule looks at the first id only, not at whether 1 appears at all.
    assert [d for d, _ in depths("sglang-deepseek", [3, 1], 32)] == [3, 1]


def test_specforge_final_state_is_id_n_post_norm():
    specs = to_canonical("specforge", [1, 15, 28, 32], 32)
    assert [(s.depth, s.final_norm) for s in specs] == [
        (2, False),
        (16, False),
        (29, False),
        (32, True),
    ]
    assert all(s.source_convention == "specforge" for s in specs)
    assert [s.source_id for s in specs] == [1, 15, 28, 32]


def test_provenance_is_kept():
    (spec,) = to_canonical("speculators", [7], 8)
    assert spec == LayerSpec(
        depth=8, final_norm=False, source_convention="speculators", source_id=7
    )


# ---------------------------------------------------------------- round trips, exhaustively


# Every id each convention accepts for a model of n layers (deepseek needs list context).
def valid_ids(conv: str, n: int) -> list[int]:
    return {
        "hf": list(range(0, n + 1)),
        "vllm": list(range(0, n + 1)),
        "speculators": list(range(0, n)),
        "sglang-llama": list(range(-1, n)),
        "specforge": list(range(-1, n + 1)),
        "sglang-deepseek": list(range(0, n + 1)),
    }[conv]


@pytest.mark.parametrize("conv", CONVENTIONS)
@pytest.mark.parametrize("n", range(1, 13))
def test_every_single_id_round_trips(conv, n):
    for v in valid_ids(conv, n):
        if conv == "sglang-deepseek" and v == 1:
            continue  # a lone 1 is shifted to depth 2, whose id is then 2 (checked below)
        specs = to_canonical(conv, [v], n)
        assert 0 <= specs[0].depth <= n
        assert from_canonical(conv, specs, n) == [v]


@pytest.mark.parametrize("n", range(2, 10))
def test_every_pair_round_trips_through_deepseek(n):
    checked = 0
    for ids in itertools.permutations(range(0, n + 1), 2):
        try:
            specs = to_canonical("sglang-deepseek", list(ids), n)
        except ConventionError:
            assert ids[0] == 1 and n in ids  # only the shift can push an id past the model
            continue
        checked += 1
        back = from_canonical("sglang-deepseek", specs, n)
        # Not always the same ids (1,... and 2,... can name the same depths), but always
        # ids that sglang maps to the same depths.
        assert [s.depth for s in to_canonical("sglang-deepseek", back, n)] == [
            s.depth for s in specs
        ]
    assert checked >= n * (n - 1)


@pytest.mark.parametrize("conv", CONVENTIONS)
@pytest.mark.parametrize("n", range(1, 9))
def test_every_expressible_canonical_state_round_trips(conv, n):
    """from_canonical then to_canonical is the identity wherever from_canonical succeeds."""
    for depth in range(0, n + 1):
        for norm in [False, True] if depth == n else [False]:
            spec = LayerSpec(depth=depth, final_norm=norm)
            try:
                ids = from_canonical(conv, [spec], n)
            except ConventionError:
                continue
            (again,) = to_canonical(conv, ids, n)
            assert (again.depth, again.final_norm) == (depth, norm)


@settings(max_examples=60, deadline=None)
@given(
    n=st.integers(1, 80),
    conv=st.sampled_from([c for c in CONVENTIONS if c != "sglang-deepseek"]),
    data=st.data(),
)
def test_random_id_lists_round_trip(n, conv, data):
    pool = valid_ids(conv, n)
    ids = data.draw(st.lists(st.sampled_from(pool), min_size=1, max_size=6, unique=True))
    assert from_canonical(conv, to_canonical(conv, ids, n), n) == ids


# ---------------------------------------------------------------- refusals


@pytest.mark.parametrize(
    ("conv", "ids", "n"),
    [
        ("speculators", [8], 8),  # output of layer 8 does not exist in an 8-layer model
        ("speculators", [-1], 8),
        ("vllm", [9], 8),
        ("vllm", [-1], 8),
        ("hf", [9], 8),
        ("hf", [-10], 8),
        ("sglang-llama", [8], 8),
        ("specforge", [9], 8),
    ],
)
def test_out_of_range_ids_are_refused(conv, ids, n):
    with pytest.raises(ConventionError, match="outside a model with 8 decoder layers"):
        to_canonical(conv, ids, n)


@pytest.mark.parametrize(
    ("conv", "spec", "why"),
    [
        ("vllm", LayerSpec(8, True), "before the final norm"),
        ("speculators", LayerSpec(8, True), "before the final norm"),
        ("sglang-llama", LayerSpec(8, True), "before the final norm"),
        ("sglang-deepseek", LayerSpec(8, True), "before the final norm"),
        ("speculators", LayerSpec(0), "first decoder layer"),
        ("hf", LayerSpec(8, False), "after the final norm"),
        ("sglang-deepseek", LayerSpec(1), "cannot come first"),
    ],
)
def test_states_a_convention_cannot_name_are_refused(conv, spec, why):
    with pytest.raises(ConventionError, match=why):
        from_canonical(conv, [spec], 8)


def test_bad_arguments():
    with pytest.raises(ConventionError, match="unknown layer convention"):
        to_canonical("megatron", [1], 8)
    with pytest.raises(ConventionError, match="num_hidden_layers"):
        to_canonical("hf", [1], 0)
    with pytest.raises(ConventionError, match="exceeds"):
        from_canonical("vllm", [LayerSpec(9)], 8)
    with pytest.raises(ConventionError, match="only meaningful"):
        from_canonical("hf", [LayerSpec(3, True)], 8)
    assert normalize_convention("Speculators_V1") == "speculators"
    assert normalize_convention("SGLang") == "sglang-llama"


# ---------------------------------------------------------------- against a real model


def test_canonical_depth_matches_a_real_llama_forward():
    """depth d is HF hidden_states[d]; speculators' capture of layer v's output is depth v + 1.

    speculators' worker records ``hidden_states + residual`` after decoder layer v, which in HF
    is the decoder layer's output; the last one is taken before the final norm.
    """
    import transformers  # a dev dependency: missing must fail, not skip

    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(
        vocab_size=64,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=4,
        num_attention_heads=2,
        num_key_value_heads=2,
    )
    model = transformers.LlamaForCausalLM(cfg).eval()
    outputs: dict[int, torch.Tensor] = {}
    hooks = [
        layer.register_forward_hook(
            lambda m, i, o, k=k: outputs.__setitem__(k, o[0] if isinstance(o, tuple) else o)
        )
        for k, layer in enumerate(model.model.layers)
    ]
    with torch.no_grad():
        out = model.model(torch.randint(0, 64, (1, 7)), output_hidden_states=True)
    for h in hooks:
        h.remove()
    hf = out.hidden_states
    n = cfg.num_hidden_layers
    for v in range(n):  # speculators id v = output of layer v
        (spec,) = to_canonical("speculators", [v], n)
        if spec.depth < n:
            assert torch.equal(outputs[v], hf[spec.depth])
        else:  # the last capture is pre-norm; hf's last entry is post-norm
            assert not spec.final_norm
            assert torch.equal(model.model.norm(outputs[v]), hf[n])
    for k in range(n + 1):  # hf id k
        (spec,) = to_canonical("hf", [k], n)
        assert spec.depth == k and spec.final_norm == (k == n)


@pytest.mark.parametrize("n", [3, 8])
def test_sglang_ids_capture_exactly_the_depths_under_the_targets_rule(n):
    for k in range(1, n):
        for depths in itertools.combinations(range(1, n), k):
            for rule in (conventions.SGLANG_LLAMA, conventions.SGLANG_DEEPSEEK):
                if list(depths) == [1] and rule == conventions.SGLANG_DEEPSEEK:
                    with pytest.raises(ConventionError, match="depth 1 alone"):
                        conventions.sglang_ids(depths, n, rule)
                    continue
                ids = conventions.sglang_ids(depths, n, rule)
                got = sorted(s.depth for s in conventions.to_canonical(rule, ids, n))
                assert got == sorted(depths), (rule, depths, ids)
                if 2 in depths:  # a list led by id 1 reads the same under either rule
                    assert conventions.sglang_ids(depths, n) == ids
