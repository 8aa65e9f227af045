"""The SGLang adapter against a fake engine that answers in SGLang's exact shapes.

SGLang itself needs a GPU and is not installed here. ``FakeSGLangEngine`` stands in for
``sglang.Engine`` (0.5.23): it takes the same server arguments, applies SGLang's layer-id rules
(models/llama.py: capture the residual entering layer ``id + 1``; models/deepseek_v2.py: ``+1``
only when the first id is 1), returns the aux captures concatenated ``[T, K*H]`` in layer order
in place of the final state, and builds ``meta_info`` as tokenizer_manager.py does, with
``hidden_states`` = ``[prefill rows as nested lists]``. Its maths comes from the tiny HF model,
so the adapter's output can be checked against the transformers backend.
"""

from __future__ import annotations

import json
import uuid

import pytest
import torch

import hsstore
from extractors.runner import ExtractOptions, run_extract
from extractors.sglang_backend import (
    SGLangBackend,
    SGLangResponseError,
    plan_layers,
    rows_from_response,
)
from hsstore.errors import BadInputError
from hsstore.format.layers import LayerSpec
from tools.tiny_model import build_tiny_model

N = 6
# Server arguments of sglang 0.5.23 (srt/arg_groups/fields/*.py) the adapter may pass.
KNOWN_SERVER_ARGS = {
    "model_path", "skip_tokenizer_init", "disable_radix_cache", "chunked_prefill_size",
    "tp_size", "dtype", "random_seed", "log_level", "mem_fraction_static",
    "enable_return_aux_hidden_states", "speculative_algorithm",
    "return_aux_hidden_state_layer_ids", "enable_return_hidden_states",
}  # fmt: skip


class FakeSGLangEngine:
    created: list[FakeSGLangEngine] = []

    def __init__(self, *, rule: str = "llama", faults: dict | None = None, **server_args):
        from transformers import AutoModelForCausalLM

        unknown = set(server_args) - KNOWN_SERVER_ARGS
        assert not unknown, f"not sglang server args: {unknown}"
        self.args = server_args
        self.faults = faults or {}
        self.model = AutoModelForCausalLM.from_pretrained(
            server_args["model_path"], dtype=torch.float32
        ).eval()
        n = self.model.config.num_hidden_layers
        self.capture: list[int] | None = None
        if server_args.get("enable_return_aux_hidden_states"):
            # srt/arg_groups/validation_hook.py: handle_aux_hidden_state_capture
            assert server_args.get("speculative_algorithm") == "EAGLE3"
            ids = server_args.get("return_aux_hidden_state_layer_ids")
            assert ids and len(set(ids)) == len(ids) and min(ids) >= 0 and max(ids) < n
            if rule == "llama" or ids[0] == 1:  # models/llama.py, models/deepseek_v2.py
                self.capture = [v + 1 for v in ids]
            else:
                self.capture = list(ids)
        else:
            assert server_args.get("enable_return_hidden_states")
        self.shut = False
        FakeSGLangEngine.created.append(self)

    def shutdown(self) -> None:
        self.shut = True

    @torch.inference_mode()
    def generate(self, *, input_ids, sampling_params, return_hidden_states):
        assert sampling_params["max_new_tokens"] == 1 and return_hidden_states is True
        responses = []
        for ids in input_ids:
            out = self.model.model(
                input_ids=torch.tensor([ids]), output_hidden_states=True, use_cache=False
            )
            hs = out.hidden_states  # hs[i] = residual entering layer i; hs[N] = normed final
            if self.capture is not None:
                # the model loop captures in layer order whatever order the ids came in
                rows = torch.cat([hs[i][0] for i in sorted(self.capture)], dim=-1)
            else:
                rows = out.last_hidden_state[0]
            responses.append(self._response(ids, rows))
        if self.faults.get("drop_response"):
            responses.pop()
        return responses

    def _response(self, ids, rows: torch.Tensor) -> dict:
        nested = rows.tolist()
        meta = {
            "id": uuid.uuid4().hex,
            "finish_reason": {"type": "length", "length": 1},
            "prompt_tokens": len(ids),
            "weight_version": "default",
            "num_retractions": 0,
            "reasoning_tokens": 0,
            "completion_tokens": 1,
            "cached_tokens": 0,
            "hidden_states": [nested],
        }
        cut = self.faults.get("truncate_rows")
        if cut and len(ids) == self.faults.get("truncate_len", len(ids)):
            meta["hidden_states"] = [nested[:-cut]]  # what chunked prefill / a cache hit gives
        return {"output_ids": [0], "meta_info": meta}


def factory(**fake_kwargs):
    def make(**server_args):
        return FakeSGLangEngine(**fake_kwargs, **server_args)

    return make


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


def test_engine_arguments(tiny):
    FakeSGLangEngine.created.clear()
    layers = [LayerSpec(2), LayerSpec(N // 2), LayerSpec(N - 3 + 2), LayerSpec(N, final_norm=True)]
    backend = SGLangBackend(str(tiny), layers, engine_factory=factory(), dtype="float32")
    aux, final = FakeSGLangEngine.created
    for engine in (aux, final):
        assert engine.args["disable_radix_cache"] is True
        assert engine.args["chunked_prefill_size"] == -1
        assert engine.args["skip_tokenizer_init"] is True
        assert engine.args["dtype"] == "float32"
        assert engine.args["mem_fraction_static"] == 0.4
    assert aux.args["enable_return_aux_hidden_states"] is True
    assert aux.args["speculative_algorithm"] == "EAGLE3"
    # sglang-llama ids are depth - 1 (captured at the input of layer id + 1)
    assert sorted(aux.args["return_aux_hidden_state_layer_ids"]) == [1, 2, 4]
    assert sorted(aux.capture) == [2, 3, 5]
    assert "enable_return_aux_hidden_states" not in final.args
    backend.close()
    assert aux.shut and final.shut


def test_adapter_matches_transformers_backend(tiny, prompts, tmp_path):
    layers = "1,2,4,5,final"
    common = dict(model=str(tiny), data=str(prompts), layers=layers, batch_size=1, progress=False)
    run_extract(ExtractOptions(out=str(tmp_path / "hf"), **common))
    run_extract(
        ExtractOptions(
            out=str(tmp_path / "sg"),
            backend="sglang",
            dtype="float32",
            backend_options={"engine_factory": factory()},
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


def test_layer_order_and_deepseek_rule():
    n = 32
    layers = [LayerSpec(29), LayerSpec(2), LayerSpec(n, final_norm=True), LayerSpec(16)]
    ids, positions, want_final = plan_layers(layers, n, ["LlamaForCausalLM"])
    assert want_final
    assert sorted(v + 1 for v in ids) == [2, 16, 29]
    # sglang returns captures in ascending depth: stored positions of depths 2, 16, 29
    assert positions == [1, 3, 0]

    def deepseek_capture(passed):  # models/deepseek_v2.py set_eagle3_layers_to_capture
        return sorted(v + 1 for v in passed) if passed[0] == 1 else sorted(passed)

    for depths in ([2, 16, 29], [1, 16, 29], [3, 9], [1, 2]):
        ids, _, _ = plan_layers([LayerSpec(d) for d in depths], n, ["DeepseekV3ForCausalLM"])
        assert deepseek_capture(ids) == sorted(depths), (depths, ids)


def test_unsupported_layers_refused(tiny):
    for layers, match in (
        ([LayerSpec(N)], "final-prenorm"),
        ([LayerSpec(0), LayerSpec(2)], "depth 0"),
    ):
        with pytest.raises(BadInputError, match=match):
            SGLangBackend(str(tiny), layers, engine_factory=factory())


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
        rows_from_response(resp, num_tokens=3, width=2, sample_id="s-1", what="aux")
    assert exc.value.sample_id == "s-1"


def test_good_response_shape():
    rows = [[float(i), float(i) + 0.5] for i in range(4)]
    got = rows_from_response(
        response(rows, prompt_tokens=4), num_tokens=4, width=2, sample_id="s", what="final"
    )
    assert got.shape == (4, 2) and got.dtype == torch.float32
    assert got[3, 1].item() == 3.5


def test_truncated_response_stores_nothing(tiny, prompts, tmp_path):
    out = tmp_path / "ds"
    opts = ExtractOptions(
        model=str(tiny),
        data=str(prompts),
        out=str(out),
        backend="sglang",
        dtype="float32",
        layers="2,final",
        batch_size=4,
        progress=False,
        backend_options={"engine_factory": factory(faults={"truncate_rows": 1})},
    )
    with pytest.raises(SGLangResponseError, match="truncated") as exc:
        run_extract(opts)
    assert exc.value.sample_id is not None
    assert len(hsstore.open(out)) == 0


def test_missing_response_fails(tiny):
    backend = SGLangBackend(
        str(tiny), [LayerSpec(2)], engine_factory=factory(faults={"drop_response": True})
    )
    from extractors.chat_tokens import TokenizedPrompt

    batch = [
        TokenizedPrompt(f"s{i}", i, torch.arange(5), torch.ones(5, dtype=torch.int64), "x", False)
        for i in range(2)
    ]
    with pytest.raises(SGLangResponseError, match="1 responses for 2 prompts"):
        backend.run(batch)


def test_cli_without_sglang_is_a_clear_error(tiny, prompts, tmp_path):
    import importlib.util

    from click.testing import CliRunner

    from hsstore.cli import main

    if importlib.util.find_spec("sglang") is not None:
        pytest.skip("sglang is installed here")
    out = tmp_path / "ds"
    result = CliRunner().invoke(
        main,
        [
            "extract",
            "--model",
            str(tiny),
            "--data",
            str(prompts),
            "--out",
            str(out),
            "--backend",
            "sglang",
        ],
    )
    assert result.exit_code == 2
    assert "needs SGLang" in result.output
    assert not out.exists()


def test_failure_mid_run_keeps_earlier_batches_and_resumes(tiny, prompts, tmp_path):
    from transformers import AutoTokenizer

    from extractors.chat_tokens import ChatTokenizer
    from extractors.prompts import read_prompts

    chat = ChatTokenizer(AutoTokenizer.from_pretrained(tiny))
    encoded = [chat.encode(p) for p in read_prompts(prompts)]
    shortest = min(encoded, key=lambda p: p.num_tokens)  # batches run longest first
    out = tmp_path / "ds"
    opts = dict(
        model=str(tiny),
        data=str(prompts),
        out=str(out),
        backend="sglang",
        dtype="float32",
        layers="2,final",
        batch_size=1,
        commit_every=1000,
        progress=False,
    )
    bad = factory(faults={"truncate_rows": 1, "truncate_len": shortest.num_tokens})
    with pytest.raises(SGLangResponseError, match="truncated") as exc:
        run_extract(ExtractOptions(**opts, backend_options={"engine_factory": bad}))
    assert exc.value.sample_id == shortest.sample_id
    ds = hsstore.open(out)
    assert sorted(ds.sample_ids) == sorted(p.sample_id for p in encoded if p is not shortest)
    summary = run_extract(ExtractOptions(**opts, backend_options={"engine_factory": factory()}))
    assert summary["samples_already_present"] == 2 and summary["samples_written"] == 1
    assert shortest.sample_id in hsstore.open(out)
