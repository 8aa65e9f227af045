"""Contract with the real sglang 0.5.23 wheel: its sources are parsed (ast), never imported.

For every model class that captures EAGLE-3 aux states (own, inherited or delegated
``set_eagle3_layers_to_capture``), the rule it applies is executed from its own source
(tests/sglang_wheel.py). hsstore's extraction ids must capture exactly the requested depths under
every one of them, and the drafter config hsstore writes must make SGLang capture the depths the
drafter was trained on. The mechanism's other premises (server argument names, forward hooks,
``last_hidden_states``) are checked against the same sources.
"""

from __future__ import annotations

import zipfile

import pytest
from sglang_fake import server_arg_fields
from sglang_wheel import SETTER, SGLangModels, Unclassifiable, find_wheel

from hsstore.extractors.backends.sglang.backend import engine_kwargs, plan_capture
from hsstore.extractors.layer_select import eagle3_aux_layers
from hsstore.spec.layers import LayerSpec
from hsstore.trainers.eagle3.checkpoint import DRAFTER_ARCHITECTURE, sglang_layer_ids

# Classes whose capture code is not in the wheel, with why hsstore cannot vouch for them.
OUTSIDE_THE_WHEEL = {
    # delegates to a MindSpore (Ascend) model built from `arch(...)`, outside the wheel
    "MindSporeForCausalLM": "unchanged to self.model, whose class is not constructed",
}
# The classes issue 10 found stored one layer too shallow: they must be in the table.
ISSUE_10_CLASSES = {
    "KimiK25ForConditionalGeneration": "deepseek",
    "GlmMoeDsaForCausalLM": "deepseek",
    "MistralLarge3ForCausalLM": "deepseek",
    "DeepseekV3ForCausalLM": "deepseek",
    "LlamaForCausalLM": "llama",
    "Qwen3ForCausalLM": "llama",
    "GptOssForCausalLM": "gpt-oss",
}
LAYER_COUNTS = [3, 4, 5, 6, 8, 12, 16, 24, 28, 32, 36, 40, 48, 61, 62, 64, 78, 80, 92, 94, 126]


@pytest.fixture(scope="module")
def models() -> SGLangModels:
    try:
        wheel = find_wheel()
    except FileNotFoundError as exc:
        pytest.fail(str(exc))
    return SGLangModels(wheel)


@pytest.fixture(scope="module")
def table(models) -> dict[str, tuple]:
    """class name -> (rule name, rule) for every capturing class of the wheel."""
    out = {}
    for ref in models.capturing_classes():
        if ref.name in OUTSIDE_THE_WHEEL:
            continue
        out[ref.name] = (models.classify(ref), models.rule(ref))
    return out


def requested_sets(n: int) -> list[list[int]]:
    every = list(range(1, n))
    sets = [[d.depth for d in eagle3_aux_layers(n)], every, [every[-1]], [1], [n // 2]]
    sets += [[d] for d in every[:4]] + [[1, n - 1], [3, n - 2] if n > 4 else [1]]
    return sets


def test_every_capturing_class_is_classified(models, table):
    classes = models.capturing_classes()
    assert len(classes) > 60  # 73 in 0.5.23; a parsing regression would find far fewer
    for ref in classes:
        if ref.name in OUTSIDE_THE_WHEEL:
            with pytest.raises(Unclassifiable, match=OUTSIDE_THE_WHEEL[ref.name]):
                models.classify(ref)
    assert set(table) | set(OUTSIDE_THE_WHEEL) == {r.name for r in classes}
    for name, rule in ISSUE_10_CLASSES.items():
        assert table[name][0] == rule, (name, table[name][0])


def test_every_file_defining_a_setter_is_covered(models, table):
    """A plain scan of the sources finds no setter the class analysis missed."""
    covered = {r.module for r in models.capturing_classes()}
    covered |= {r.module for r in models.inner_setters()}
    for module, source in models.sources.items():
        if f"def {SETTER}(" in source:
            assert module in covered, module


def test_inner_setters_store_their_list_verbatim(models):
    for ref in models.inner_setters():
        assert models.inner_stored(ref, [3, 7, 9], 12) == [3, 7, 9], ref.where


@pytest.mark.parametrize("n", LAYER_COUNTS)
def test_hsstore_ids_capture_exactly_the_requested_depths(table, n):
    for name, (_, rule) in table.items():
        for depths in requested_sets(n):
            layers = [LayerSpec(d) for d in depths] + [LayerSpec(n, final_norm=True)]
            plan = plan_capture(layers, n)
            captured = sorted(rule(plan.aux_ids, n))
            assert captured == plan.captured_depths, (name, n, depths, plan.aux_ids, captured)
            assert set(depths) <= set(captured)
            assert len(plan.captured_depths) >= 2  # a pre-norm substitution changes the width
            assert max(plan.aux_ids) < n  # SGLang's range check


def test_server_arguments_exist_in_the_wheel():
    plan = plan_capture([LayerSpec(2), LayerSpec(6, final_norm=True)], 6)
    kwargs = engine_kwargs(
        "m", plan, hidden_size=8, tp_size=1, mem_fraction_static=0.8, dtype="bfloat16"
    )
    assert set(kwargs) <= server_arg_fields()


def test_the_final_state_mechanism_still_holds_in_the_wheel():
    """The premises of one forward for aux + final (paths inside sglang/srt/)."""
    with zipfile.ZipFile(find_wheel()) as zf:
        logits = zf.read("sglang/srt/layers/logits_processor.py").decode()
        hooks = zf.read("sglang/srt/model_executor/hook_manager.py").decode()
        setup = zf.read(
            "sglang/srt/model_executor/model_runner_components/cuda_graph_setup.py"
        ).decode()
    # aux capture keeps the LM head's input as last_hidden_states in FULL mode
    assert "self.keep_last_hidden_states = features.aux_hidden_state_capture is not None" in logits
    assert "last_hidden_states=last_hidden_states_to_store" in logits
    # forward_hooks: hook_factory(config), then register_forward_hook on modules matched by name
    assert "hook = hook_factory(config) if hook_factory else None" in hooks
    assert "module.register_forward_hook(hook)" in hooks
    assert "fnmatch.fnmatch(name, pattern)" in hooks
    assert "register_forward_hooks(model_runner.model, get_observability().forward_hooks)" in setup


def test_the_capture_path_still_holds_in_the_wheel():
    """The premises of states handed over as tensors, never lists (paths inside sglang/srt/)."""
    with zipfile.ZipFile(find_wheel()) as zf:

        def src(path: str) -> str:
            return zf.read(f"sglang/srt/{path}").decode()

        serving = src("arg_groups/serving_hook.py")
        batch_info = src("model_executor/forward_batch_info.py")
        results = src("managers/scheduler_components/batch_result_processor.py")
        utils = src("managers/utils.py")
        scheduler = src("managers/scheduler.py")
        logits = src("layers/logits_processor.py")
        engine = src("entrypoints/engine.py")
        parallel = src("distributed/parallel_state.py")
        parallel_init = src("distributed/__init__.py")
    # aux capture makes every forward capture in FULL mode, whatever the requests ask
    assert "if cfg.enable_return_hidden_states or cfg.enable_return_aux_hidden_states:" in serving
    assert 'return_hidden_states_mode="full",' in serving
    assert (
        "batch.return_hidden_states_mode,\n                    get_server_return_hidden_states_mode(),"
        in batch_info
    )
    # a request that asks for no states gets no lists and no device-to-host copy
    assert "if not store or not req.return_hidden_states:" in results
    assert "req.hidden_states.append(req_hidden_states.cpu().clone().tolist())" in results
    assert "if return_hidden_states and self.logits_output.hidden_states is not None:" in utils
    assert scheduler.count("return_hidden_states=batch.return_hidden_states,") >= 3
    # what the hook reads: the batch layout on ForwardBatch, the states on the output
    for field in (
        "rids: Optional[List[str]] = None",
        "extend_prefix_lens_cpu: Optional[List[int]] = None",
        "extend_seq_lens_cpu: Optional[List[int]] = None",
        "rids=[req.rid for req in batch.reqs],",
        "def is_extend(self",
    ):
        assert field in batch_info, field
    assert "logits_metadata: Union[LogitsMetadata, ForwardBatch]," in logits
    assert "hidden_states_to_store = pack_aux_hidden_states(aux_hidden_states)" in logits
    # hsstore's request ids reach the scheduler; TP rank 0 is known to every worker
    assert "rid: Optional[Union[List[str], str]] = None," in engine
    assert "def get_tensor_model_parallel_rank()" in parallel
    assert "from sglang.srt.distributed.parallel_state import *" in parallel_init or (
        "get_tensor_model_parallel_rank" in parallel_init
    )


def test_every_capturing_model_hands_its_logits_processor_the_forward_batch(models):
    """The hook finds the ForwardBatch among the positional arguments of the logits processor
    (forward hooks see no keyword arguments): every call in a model file that captures aux
    states passes at least input ids, states, LM head and the batch positionally."""
    import ast

    calls = 0
    for module, source in models.sources.items():
        if "aux_hidden_states" not in source:
            continue
        for node in ast.walk(ast.parse(source)):
            if (
                isinstance(node, ast.Call)
                and isinstance(node.func, ast.Attribute)
                and node.func.attr == "logits_processor"
            ):
                calls += 1
                assert len(node.args) >= 4, f"{module}.py:{node.lineno}"
    assert calls > 40  # 59 in 0.5.23


def test_capture_hook_writes_stored_layers_and_names_problems(tmp_path):
    import gc

    import torch
    from sglang_fake import ForwardBatch, ForwardMode, LogitsOutput

    from hsstore.extractors.backends.sglang.capture import SlotReader
    from hsstore.extractors.backends.sglang.hook import capture_hook

    h = 4
    config = {
        "mode": "shm",
        "aux_width": 2 * h,
        "hidden_size": h,
        "layout": [2, 0],  # stored: final, then the first aux block
        "dir": str(tmp_path),
        "rid_prefix": "hs-",
    }
    hook = capture_hook(config)
    reader = SlotReader(str(tmp_path))
    aux, last = torch.randn(5, 2 * h), torch.randn(5, h)
    batch = ForwardBatch(ForwardMode(True), ["hs-a", "other", "hs-b"], [2, 1, 2], [0, 0, 0])
    hook(None, (None, last, None, batch), LogitsOutput(aux, last))
    (a,) = reader.captures_of("hs-a")
    (b,) = reader.captures_of("hs-b")
    assert torch.equal(a.states, torch.stack([last[:2], aux[:2, :h]], dim=1))
    assert torch.equal(b.states, torch.stack([last[3:], aux[3:, :h]], dim=1))
    assert reader.captures_of("other") == []
    del a, b
    gc.collect()
    slots = sorted(p.name for p in tmp_path.iterdir())
    assert slots == ["free-0", "free-1"]  # both slots back in the pool
    # a pre-norm state in place of the aux ones: a receipt naming it, no states, no slot
    hook(None, (None, last, None, batch), LogitsOutput(torch.randn(5, h), last))
    (bad,) = reader.captures_of("hs-a")
    assert bad.states is None and bad.width == h and "width 4, expected 8" in bad.problem
    assert reader.captures_of("hs-b")[0].problem == bad.problem
    # decode forwards and other ranks write nothing
    decode = ForwardBatch(ForwardMode(False), ["hs-a"], None, None)
    hook(None, (None, last, None, decode), LogitsOutput(aux, last))
    assert sorted(p.name for p in tmp_path.iterdir()) == slots


def test_capture_hook_writes_on_tp_rank_0_only(tmp_path, monkeypatch):
    import torch
    from sglang_fake import ForwardBatch, ForwardMode, LogitsOutput

    from hsstore.extractors.backends.sglang import hook as sglang_hook

    monkeypatch.setattr(sglang_hook, "_tp_rank", lambda: 1)
    config = {"mode": "shm", "aux_width": 4, "hidden_size": 4, "layout": [0, 1]}
    hook = sglang_hook.capture_hook({**config, "dir": str(tmp_path), "rid_prefix": "hs-"})
    batch = ForwardBatch(ForwardMode(True), ["hs-a"], [3], [0])
    out = LogitsOutput(torch.randn(3, 4), torch.randn(3, 4))
    hook(None, (None, None, None, batch), out)
    assert list(tmp_path.iterdir()) == []


def test_append_hook_of_the_list_fallback():
    import torch

    from hsstore.extractors.backends.sglang.hook import capture_hook

    class Output:
        def __init__(self, aux, last):
            self.hidden_states, self.last_hidden_states = aux, last

    hook = capture_hook({"mode": "append", "aux_width": 8})
    aux, last = torch.randn(3, 8), torch.randn(3, 4)
    out = Output(aux, last)
    hook(None, (), out)
    assert torch.equal(out.hidden_states, torch.cat([aux, last], dim=-1))
    for bad in (Output(torch.randn(3, 4), last), Output(aux, None)):  # pre-norm swap, no state
        before = bad.hidden_states
        hook(None, (), bad)
        assert bad.hidden_states is before


@pytest.mark.parametrize("n", LAYER_COUNTS[1:])
def test_drafter_config_serves_the_trained_depths(table, n):
    """SGLang hands eagle_config ids to the target's setter at serving time
    (model_runner_components/spec_aux_hidden_state.py _resolve_eagle_aux_hidden_state)."""
    for name, (rule_name, rule) in table.items():
        for depths in requested_sets(n):
            aux = [LayerSpec(d) for d in depths]
            if depths == [1] and rule_name == "deepseek":
                with pytest.raises(ValueError, match="cannot capture depth 1 alone"):
                    sglang_layer_ids(aux, n, target_architecture=name)
                continue
            ids = sglang_layer_ids(aux, n, target_architecture=name)
            captured = sorted(rule(ids, n))
            assert captured == sorted(depths), (name, n, depths, ids, captured)
            if 2 in depths:  # the default EAGLE-3 layers: right without knowing the target
                assert sglang_layer_ids(aux, n) == ids


def test_drafter_rule_table_matches_the_wheel(table):
    from hsstore.trainers.eagle3.checkpoint import SGLANG_FIRST_ID_RULE_TARGETS

    derived = {name for name, (rule, _) in table.items() if rule == "deepseek"}
    assert derived == set(SGLANG_FIRST_ID_RULE_TARGETS)


def test_drafter_architecture_is_an_sglang_entry_class(models):
    entries = {name for _, name in models.entry_classes}
    assert DRAFTER_ARCHITECTURE in entries
    source = models.sources["llama_eagle3"]
    assert 'eagle_config.get("eagle_aux_hidden_state_layer_ids")' in source
