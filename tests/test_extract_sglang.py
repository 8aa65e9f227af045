"""The SGLang adapter against a fake engine whose rules are read from the real sglang wheel.

``FakeSGLangEngine`` (tests/sglang_fake.py) stands in for ``sglang.Engine`` 0.5.23: it accepts
only the wheel's server arguments, captures the layers the named model class's own
``set_eagle3_layers_to_capture`` (executed from the wheel's source) captures for the ids it is
sent, runs hsstore's forward hook as SGLang would, and answers in SGLang's response shapes. Its
maths comes from the tiny HF model, so stored states can be checked against the transformers
backend. The backend itself is the real one: only the engine is fake.
"""

from __future__ import annotations

import json

import pytest
import torch
from sglang_fake import FakeSGLangEngine, counted, factory

import hsstore
from hsstore.demo_model import build_tiny_model
from hsstore.errors import BadInputError
from hsstore.extractors.backends.sglang.backend import (
    SGLangBackend,
    SGLangResponseError,
    check_sglang_version,
    plan_capture,
    rows_from_response,
)
from hsstore.extractors.chat_tokens import TokenizedPrompt
from hsstore.extractors.layer_select import parse_layers
from hsstore.extractors.runner import ExtractOptions, WorkerFailedError, run_extract
from hsstore.spec.layers import LayerSpec

N = 6
# Model classes of the wheel with each capture rule, including the ones issue 10 is about.
ARCHITECTURES = [
    "LlamaForCausalLM",
    "Qwen3ForCausalLM",
    "GptOssForCausalLM",
    "DeepseekV3ForCausalLM",
    "KimiK25ForConditionalGeneration",
    "GlmMoeDsaForCausalLM",
    "MistralLarge3ForCausalLM",
]


def batch_of(tiny, n=2):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny)
    texts = ["The quick brown fox jumps.", "Hidden states of a language model", "Hi"]
    out = []
    for i, text in enumerate(texts[:n]):
        ids = torch.tensor(tok(text)["input_ids"], dtype=torch.int64)
        out.append(TokenizedPrompt(f"s{i}", i, ids, torch.ones_like(ids), "x", False))
    return out


def hf_states(tiny, batch, layers):
    from hsstore.extractors.backends.transformers import TransformersBackend

    backend = TransformersBackend(str(tiny), layers, torch_dtype="float32")
    try:
        return backend.run(batch)
    finally:
        backend.close()


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("tiny"), layers=N)


@pytest.fixture(scope="module")
def prompts(tmp_path_factory):
    path = tmp_path_factory.mktemp("p") / "p.jsonl"
    rows = [
        [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello!"}],
        [
            {"role": "user", "content": "The capital of France?"},
            {"role": "assistant", "content": "Paris."},
        ],
        [
            {"role": "user", "content": "Add 2 and 2."},
            {"role": "assistant", "content": "That is 4, of course."},
        ],
    ]
    path.write_text("".join(json.dumps({"messages": m}) + "\n" for m in rows))
    return path


def sglang_options(tiny, prompts, out, engine_factory, **extra) -> ExtractOptions:
    """Options for a run of the SGLang backend on the fake engine (float32, no progress)."""
    return ExtractOptions(
        model=str(tiny),
        data=str(prompts),
        out=str(out),
        backend="sglang",
        dtype="float32",
        progress=False,
        backend_options={"engine_factory": engine_factory},
        **extra,
    )


def test_one_engine_with_the_wheels_server_arguments(tiny):
    layers = [LayerSpec(2), LayerSpec(3), LayerSpec(5), LayerSpec(N, final_norm=True)]
    backend = SGLangBackend(str(tiny), layers, engine_factory=factory(), dtype="float32")
    engine = backend.engine
    assert isinstance(engine, FakeSGLangEngine)
    assert engine.args["disable_radix_cache"] is True
    assert engine.args["chunked_prefill_size"] == -1
    assert engine.args["disable_prefill_cuda_graph"] is True
    assert engine.args["dtype"] == "float32"
    assert "mem_fraction_static" not in engine.args  # one engine: SGLang's own default
    assert engine.args["return_aux_hidden_state_layer_ids"][0] == 1
    assert engine.capture == [2, 3, 5]
    backend.close()
    assert engine.shut


@pytest.fixture(scope="module")
def every_depth(tiny):
    """Depths 1..N-1, final and final-prenorm of a fixed batch, from the transformers backend."""
    layers = [LayerSpec(d) for d in range(1, N)] + [LayerSpec(N, final_norm=True), LayerSpec(N)]
    return batch_of(tiny), hf_states(tiny, batch_of(tiny), layers)


@pytest.mark.parametrize("architecture", ARCHITECTURES)
@pytest.mark.parametrize("text", ["5,3,2", "3,1", "4", "final", "final-prenorm,3,final"])
def test_requested_depths_stored_under_every_rule(tiny, every_depth, architecture, text):
    """Kimi-K2.5, GLM-5 and Mistral Large 3 (DeepSeek rule) store what was asked for, the final
    norm's input (final-prenorm) included."""
    layers = parse_layers(text, N)
    batch, all_states = every_depth
    backend = SGLangBackend(
        str(tiny), layers, engine_factory=factory(architecture=architecture), dtype="float32"
    )
    try:
        got = backend.run(batch)
    finally:
        backend.close()
    columns = [s.depth - 1 if s.depth < N or s.final_norm else N for s in layers]
    want = [states[:, columns] for states in all_states]
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-4)  # batched vs one by one


def test_eagle3_final_is_one_engine_and_one_forward_per_batch(tiny, prompts, tmp_path):
    counts = tmp_path / "counts"
    summary = run_extract(
        sglang_options(tiny, prompts, tmp_path / "ds", factory(counts=str(counts)), batch_size=2)
    )
    assert summary["layers"] == ["after 2", "after 3", "after 6"]  # eagle3,final-prenorm
    assert summary["samples_written"] == 3
    assert counted(counts) == {"engine": 1, "forward": 2}  # 3 prompts in batches of 2
    # the engine lived in a worker process, never in this one
    pids = {int(line.split()[1]) for line in counts.read_text().splitlines()}
    import os

    assert os.getpid() not in pids and len(pids) == 1


def test_adapter_matches_transformers_backend(tiny, prompts, tmp_path):
    common = dict(model=str(tiny), data=str(prompts), layers="1,2,4,5,final", progress=False)
    run_extract(ExtractOptions(out=str(tmp_path / "hf"), batch_size=1, **common))
    run_extract(
        ExtractOptions(
            out=str(tmp_path / "sg"),
            backend="sglang",
            dtype="float32",
            backend_options={"engine_factory": factory(architecture="DeepseekV3ForCausalLM")},
            **common,
        )
    )
    hf, sg = hsstore.open(tmp_path / "hf"), hsstore.open(tmp_path / "sg")
    assert sorted(hf.sample_ids) == sorted(sg.sample_ids) and len(hf) == 3
    assert [s.label for s in hf.layers] == [s.label for s in sg.layers]
    for sid in hf.sample_ids:
        a, b = hf.get(sid), sg.get(sid)
        assert torch.equal(a.input_ids, b.input_ids)
        assert torch.equal(a.loss_mask, b.loss_mask)
        torch.testing.assert_close(b.hidden, a.hidden, rtol=1e-5, atol=1e-5)


def test_closing_the_engine_never_takes_down_the_parent(tiny, prompts, tmp_path):
    # the fake's shutdown SIGKILLs the process that holds the engine, as SGLang's can
    summary = run_extract(
        sglang_options(tiny, prompts, tmp_path / "ds", factory(faults={"kill_on_shutdown": True}))
    )
    assert summary["samples_written"] == 3
    assert len(hsstore.open(tmp_path / "ds")) == 3


def sample_ids_of(tiny, prompts) -> list[str]:
    from transformers import AutoTokenizer

    from hsstore.extractors.chat_tokens import ChatTokenizer
    from hsstore.extractors.prompts import read_prompts

    chat = ChatTokenizer(AutoTokenizer.from_pretrained(tiny))
    return [chat.encode(prompt).sample_id for prompt in read_prompts(prompts)]


def test_dead_worker_is_reported_with_its_samples_and_rerun_finishes(tiny, prompts, tmp_path):
    out = tmp_path / "ds"
    die = factory(faults={"die_once_file": str(tmp_path / "died")})
    with pytest.raises(WorkerFailedError) as exc:
        run_extract(sglang_options(tiny, prompts, out, die, batch_size=8))
    message = str(exc.value)
    assert "died (exit code 17)" in message
    for sample_id in sample_ids_of(tiny, prompts):
        assert sample_id in message
    assert len(hsstore.open(out)) == 0
    summary = run_extract(sglang_options(tiny, prompts, out, die, batch_size=8))
    assert summary["samples_written"] == 3


def test_dead_worker_names_the_samples_it_computed_but_had_not_committed(tiny, prompts, tmp_path):
    """Batches of one, none committed yet (the default --commit-every): the worker dies in its
    third forward, and the first two, handed to its writer, are lost with it and named too."""
    out = tmp_path / "ds"
    faults = {"die_once_file": str(tmp_path / "died"), "die_after_forwards": 2}
    with pytest.raises(WorkerFailedError) as exc:
        run_extract(sglang_options(tiny, prompts, out, factory(faults=faults), batch_size=1))
    message = str(exc.value)
    assert "died (exit code 17) while extracting samples " in message
    named = message.split("while extracting samples ")[1].split(" (not stored)")[0].split(", ")
    assert sorted(named) == sorted(sample_ids_of(tiny, prompts))  # not only the one in the model
    assert len(hsstore.open(out)) == 0


def test_prenorm_state_in_place_of_aux_is_refused(tiny):
    batch = batch_of(tiny, 1)
    for layers in ([LayerSpec(2)], [LayerSpec(N, final_norm=True)], [LayerSpec(3), LayerSpec(4)]):
        backend = SGLangBackend(
            str(tiny),
            layers,
            engine_factory=factory(faults={"prenorm_instead_of_aux": True}),
            dtype="float32",
        )
        with pytest.raises(SGLangResponseError, match="pre-norm final state") as exc:
            backend.run(batch)
        assert exc.value.sample_id == "s0"
        backend.close()


def test_plan_always_starts_with_id_1_and_captures_two_layers():
    n = 32
    layers = [LayerSpec(29), LayerSpec(2), LayerSpec(n, final_norm=True), LayerSpec(16)]
    plan = plan_capture(layers, n)
    assert plan.aux_ids == [1, 15, 28]
    assert plan.captured_depths == [2, 16, 29]
    assert plan.slots == [1, 3, 0, 2]  # ascending captures, then the final state
    only_final = plan_capture([LayerSpec(n, final_norm=True)], n)
    assert only_final.aux_ids == [1, 0] and only_final.slots == [None, None, 0]
    assert plan_capture([LayerSpec(7)], n).aux_ids == [1, 6]
    both = plan_capture([LayerSpec(n), LayerSpec(2), LayerSpec(n, final_norm=True)], n)
    assert both.prenorm and both.blocks == 4  # depths 1 and 2, final, then the norm's input
    assert both.layout == [3, 1, 2] and both.slots == [None, 1, 2, 0]
    with pytest.raises(BadInputError, match="at least 3 decoder layers"):
        plan_capture([LayerSpec(1)], 2)


def test_unsupported_layers_refused(tiny):
    with pytest.raises(BadInputError, match="depth 0"):
        SGLangBackend(str(tiny), [LayerSpec(0), LayerSpec(2)], engine_factory=factory())


def test_final_norm_that_no_hook_sees_is_refused(tiny):
    """A model whose final norm bypasses the module (a fused terminal norm) leaves no pre-norm
    state: the sample is named, never stored without it; post-norm runs are unaffected."""
    batch = batch_of(tiny, 1)
    bypassed = factory(faults={"norm_bypassed": True})
    backend = SGLangBackend(str(tiny), [LayerSpec(2), LayerSpec(N)], engine_factory=bypassed)
    try:
        with pytest.raises(SGLangResponseError, match="final norm hook ran 0 times") as exc:
            backend.run(batch)
        assert exc.value.sample_id == "s0"
    finally:
        backend.close()
    backend = SGLangBackend(
        str(tiny), [LayerSpec(2), LayerSpec(N, final_norm=True)], engine_factory=bypassed
    )
    try:
        assert backend.run(batch)[0].shape[1] == 2
    finally:
        backend.close()


def test_untested_sglang_versions_refused(monkeypatch):
    check_sglang_version("0.5.23")
    monkeypatch.delenv("HSSTORE_SGLANG_UNTESTED", raising=False)
    with pytest.raises(BadInputError, match="SGLang 0.5.22 is not a version") as exc:
        check_sglang_version("0.5.22")
    assert "--check-against transformers" in str(exc.value)
    monkeypatch.setenv("HSSTORE_SGLANG_UNTESTED", "1")
    check_sglang_version("0.6.0")


def response(rows, **meta):
    base = {"prompt_tokens": 3, "cached_tokens": 0, "hidden_states": [rows]}
    base.update(meta)
    return {"output_ids": [1], "meta_info": base}


@pytest.mark.parametrize(
    "resp, match",
    [
        ({"text": ""}, "no meta_info"),
        (response([[0.0, 1.0]] * 3, hidden_states=None), "no hidden_states"),
        (response([[0.0, 1.0]] * 4, prompt_tokens=4), "prompt_tokens 4 != 3 sent"),
        (response([[0.0, 1.0]] * 2), "truncated: 2 rows of hidden states for 3 prompt tokens"),
        (response([[0.0, 1.0]] * 3, cached_tokens=2), "prefix cache"),
        (response([[0.0, 1.0], [0.0], [1.0, 2.0]]), "ragged"),
        (response([[0.0, 1.0, 2.0]] * 3), "width 3, expected 2"),
        (response([0.0, 1.0, 2.0]), "shape"),
        (response([[0.0, float("nan")]] * 3), "non-finite"),
        (
            response([[0.0, 1.0]] * 3, finish_reason={"type": "abort", "message": "oom"}),
            "aborted: oom",
        ),
    ],
)
def test_bad_responses_fail_loudly(resp, match):
    with pytest.raises(SGLangResponseError, match=match) as exc:
        rows_from_response(resp, num_tokens=3, width=2, sample_id="s-1")
    assert exc.value.sample_id == "s-1"


def test_missing_final_state_named():
    rows = [[0.0] * 4] * 3  # two aux blocks of H=2, the final block missing
    with pytest.raises(SGLangResponseError, match="final state was not appended"):
        rows_from_response(response(rows), num_tokens=3, width=6, sample_id="s", hidden_size=2)


def test_good_response_shape():
    rows = [[float(i), float(i) + 0.5] for i in range(4)]
    got = rows_from_response(response(rows, prompt_tokens=4), num_tokens=4, width=2, sample_id="s")
    assert got.shape == (4, 2) and got.dtype == torch.float32
    assert got[3, 1].item() == 3.5


def test_missing_response_fails(tiny):
    backend = SGLangBackend(
        str(tiny), [LayerSpec(2)], engine_factory=factory(faults={"drop_response": True})
    )
    with pytest.raises(SGLangResponseError, match="1 responses for 2 prompts"):
        backend.run(batch_of(tiny, 2))


def test_cli_without_sglang_is_a_clear_error(tiny, prompts, tmp_path):
    import importlib.util

    from click.testing import CliRunner

    from hsstore.cli import main

    assert importlib.util.find_spec("sglang") is None, "this test needs sglang NOT installed"
    out = tmp_path / "ds"
    args = ["extract", "--model", str(tiny), "--data", str(prompts), "--out", str(out)]
    result = CliRunner().invoke(main, [*args, "--backend", "sglang"])
    assert result.exit_code == 2
    assert "needs SGLang" in result.output
    assert not out.exists()


def test_failure_mid_run_keeps_earlier_batches_and_resumes(tiny, prompts, tmp_path):
    from transformers import AutoTokenizer

    from hsstore.extractors.chat_tokens import ChatTokenizer
    from hsstore.extractors.prompts import read_prompts

    chat = ChatTokenizer(AutoTokenizer.from_pretrained(tiny))
    encoded = [chat.encode(p) for p in read_prompts(prompts)]
    shortest = min(encoded, key=lambda p: p.num_tokens)  # batches run longest first
    out = tmp_path / "ds"
    opts = dict(layers="2,final", batch_size=1, commit_every=1000)
    bad = factory(faults={"truncate_rows": 1, "truncate_len": shortest.num_tokens})
    with pytest.raises(WorkerFailedError, match="truncated") as exc:
        run_extract(sglang_options(tiny, prompts, out, bad, **opts))
    assert shortest.sample_id in str(exc.value)
    ds = hsstore.open(out)
    assert sorted(ds.sample_ids) == sorted(p.sample_id for p in encoded if p is not shortest)
    summary = run_extract(sglang_options(tiny, prompts, out, factory(), **opts))
    assert summary["samples_already_present"] == 2 and summary["samples_written"] == 1
    assert shortest.sample_id in hsstore.open(out)


def test_check_against_transformers_passes_and_catches_a_wrong_layer(tiny, prompts, tmp_path):
    common = dict(layers="1,2,3,final", limit=2, check_against="transformers")
    good = run_extract(sglang_options(tiny, prompts, tmp_path / "ok", factory(), **common))
    check = good["check"]
    assert check["ok"] and check["samples"] == 2 and check["problems"] == []
    assert max(check["max_rel_err"]) < 1e-4
    wrong = factory(faults={"wrong_layer": True})
    bad = run_extract(sglang_options(tiny, prompts, tmp_path / "bad", wrong, **common))["check"]
    assert not bad["ok"]
    assert any("after 2: " in p and "a wrong layer?" in p for p in bad["problems"])


def test_cli_check_against_on_cpu(tiny, prompts, tmp_path):
    from click.testing import CliRunner

    from hsstore.cli import main

    args = ["extract", "--model", str(tiny), "--data", str(prompts), "--out", str(tmp_path / "d")]
    result = CliRunner().invoke(
        main, [*args, "--check-against", "transformers", "--limit", "2", "--no-progress"]
    )
    assert result.exit_code == 0, result.output
    assert "check against transformers on 2 samples: OK" in result.output
    assert "max relative error 0," in result.output


def test_list_fallback_warns_and_stores_the_same(tiny, every_depth):
    batch, all_states = every_depth
    layers = [LayerSpec(2), LayerSpec(4), LayerSpec(N), LayerSpec(N, final_norm=True)]
    with pytest.warns(UserWarning, match="Python lists"):
        backend = SGLangBackend(
            str(tiny), layers, engine_factory=factory(), dtype="float32", capture="lists"
        )
    try:
        got = backend.run(batch)
    finally:
        backend.close()
    for g, w in zip(got, all_states):
        torch.testing.assert_close(g, w[:, [1, 3, N, N - 1]], rtol=1e-4, atol=1e-4)


def test_prefix_cache_hit_is_refused(tiny):
    backend = SGLangBackend(
        str(tiny), [LayerSpec(2)], engine_factory=factory(faults={"cached_tokens": 2})
    )
    try:
        with pytest.raises(SGLangResponseError, match="prefix cache"):
            backend.run(batch_of(tiny, 1))
    finally:
        backend.close()


def test_cpu_memory_fraction_is_positive_and_refuses_what_cannot_fit(tiny):
    from transformers import AutoConfig

    from hsstore.extractors.backends.sglang.memory import cpu_mem_fraction

    config = AutoConfig.from_pretrained(tiny)
    gib = 1 << 30
    kw = dict(checkpoint_dtype="float32", dtype="bfloat16")
    small = cpu_mem_fraction(str(tiny), config, available=20 * gib, **kw)
    assert 0.0 < small < 0.1
    with pytest.raises(BadInputError, match="GiB is free"):
        cpu_mem_fraction(str(tiny), config, available=gib, **kw)
    backend = SGLangBackend(str(tiny), [LayerSpec(2)], engine_factory=factory(), device="cpu")
    try:
        assert 0.0 < backend.engine.args["mem_fraction_static"] <= 0.9
        assert backend.engine.args["attention_backend"] == "torch_native"
    finally:
        backend.close()
