"""docs/TRAINER.md's account of serving in SGLang cites the sglang 0.5.23 wheel line by line:
each cited line (or range) must hold the code the account is about, read from the wheel's
sources (never imported), and every citation of that section must be one checked here."""

from __future__ import annotations

import re
import zipfile
from pathlib import Path

import pytest
from sglang_wheel import find_wheel

DOC = Path(__file__).resolve().parents[1] / "docs" / "TRAINER.md"
SECTION = ("SGLang (0.5.23):", "speculators 0.9 loads the weights")
# `path:first` or `path:first-last`; a citation without a path is in the last file named
CITATION = re.compile(r"`(?P<path>[\w/]+\.py)?:(?P<first>\d+)(?:-(?P<last>\d+))?`")
# (path, first line) -> what the cited lines must contain
CITED = {
    ("models/llama_eagle3.py", 303): "self.load_lm_head_from_target = True",
    ("speculative/eagle_worker_v2.py", 363): "self.draft_runner.model.set_embed(embed)",
    ("models/llama_eagle3.py", 325): "def load_weights(self, weights",
    ("models/llama_eagle3.py", 350): "self.hot_token_id = loaded_weight + torch.arange(",
    ("speculative/eagle_worker_v2.py", 757): "topk_index = self.hot_token_id[topk_index]",
    ("speculative/eagle_worker_v2.py", 897): "topk_index = self.hot_token_id[topk_index]",
    ("models/llama_eagle3.py", 355): 'if "t2d" in name:',
    (
        "model_executor/model_runner_components/spec_aux_hidden_state.py",
        192,
    ): "config.eagle_aux_hidden_state_layer_ids = eagle_config[",
    (
        "model_executor/model_runner_components/attention_backend_setup.py",
        61,
    ): "model.set_eagle3_layers_to_capture(eagle_aux_hidden_state_layer_ids)",
    ("models/llama.py", 941): "self.model.layers_to_capture = [val + 1 for val in layer_ids]",
    ("models/llama.py", 485): "if i in self.layers_to_capture",
    ("layers/logits_processor.py", 869): "pack_aux_hidden_states(aux_hidden_states)",
    ("layers/aux_hidden_states.py", 102): "return torch.cat(aux_hidden_states, dim=-1)",
    ("speculative/eagle_worker_v2.py", 1010): "hidden_states=target_hidden_states,",
    (
        "speculative/eagle_worker_v2.py",
        1150,
    ): "hidden_states=batch_result.logits_output.hidden_states,",
    ("models/llama_eagle3.py", 237): "hidden_states = self.fc(hidden_states)",
    ("models/llama_eagle3.py", 99): "residual = hidden_states",
    (
        "model_executor/model_runner_components/spec_aux_hidden_state.py",
        104,
    ): "config.eagle_aux_hidden_state_layer_ids = (",
    (
        "mem_cache/kv_cache_configurator.py",
        2790,
    ): "enable_kv_cache_copy=(get_spec().speculative_algorithm is not None),",
    ("mem_cache/memory_pool.py", 2307): "self._init_kv_copy_and_warmup()",
    ("sglang/kernels/ops/kvcache/cache_move.py", 191): "copy_all_layer_kv_cache_cpu(",
}


def citations() -> list[tuple[str, int, int]]:
    text = DOC.read_text()
    start, end = (text.index(marker) for marker in SECTION)
    out, path = [], None
    for m in CITATION.finditer(text[start:end]):
        path = m["path"] or path
        first = int(m["first"])
        out.append((path, first, int(m["last"] or first)))
    return out


@pytest.fixture(scope="module")
def wheel() -> zipfile.ZipFile:
    try:
        path = find_wheel()
    except FileNotFoundError as exc:
        pytest.fail(str(exc))
    with zipfile.ZipFile(path) as zf:
        yield zf


def test_every_sglang_citation_of_the_trainer_docs_is_checked():
    found = {(path, first) for path, first, _ in citations()}
    assert found == set(CITED)


@pytest.mark.parametrize("path, first, last", citations())
def test_the_cited_lines_hold_the_cited_code(wheel, path, first, last):
    name = path if path.startswith("sglang/") else f"sglang/srt/{path}"
    lines = wheel.read(name).decode().splitlines()
    cited = "\n".join(lines[first - 1 : last])
    assert CITED[(path, first)] in cited, f"{path}:{first}-{last} reads:\n{cited}"
