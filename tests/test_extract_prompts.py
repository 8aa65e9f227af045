"""Prompt reading, tokenisation, loss masks and --layers parsing for `hsstore extract`."""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from hsstore.demo_model import build_tiny_model
from hsstore.errors import BadInputError
from hsstore.extractors.batching import parse_shard, plan_batches
from hsstore.extractors.chat_tokens import ChatTokenizer, TokenizedPrompt
from hsstore.extractors.layer_select import default_layers, eagle3_aux_layers, parse_layers
from hsstore.extractors.prompts import Prompt, SkippedRow, read_prompts
from hsstore.spec import conventions

CHAT = {
    "messages": [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "What is the capital of France?"},
        {"role": "assistant", "content": "Paris."},
        {"role": "user", "content": "And of Italy?"},
        {"role": "assistant", "content": "Rome, of course."},
    ]
}
SHAREGPT = {
    "conversations": [
        {"from": "human", "value": "Say hello"},
        {"from": "gpt", "value": "Hello!"},
    ]
}


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    from transformers import AutoTokenizer

    model_dir = build_tiny_model(tmp_path_factory.mktemp("tiny"))
    return AutoTokenizer.from_pretrained(model_dir)


def write_jsonl(path: Path, rows: list) -> Path:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


def test_jsonl_formats_and_skips(tmp_path):
    rows = [
        CHAT,
        SHAREGPT,
        {"text": "plain text prompt"},
        "{not json",
        {"messages": []},
        {"conversations": [{"from": "alien", "value": "x"}]},
        {"other": 1},
        {"text": "   "},
        [1, 2],
    ]
    got = list(read_prompts(write_jsonl(tmp_path / "p.jsonl", rows)))
    assert [type(r).__name__ for r in got] == ["Prompt"] * 3 + ["SkippedRow"] * 6
    assert [r.index for r in got] == list(range(len(rows)))
    assert got[0].messages[2] == ("assistant", "Paris.")
    assert got[1].messages == (("user", "Say hello"), ("assistant", "Hello!"))
    assert got[2].text == "plain text prompt"
    reasons = [r.reason for r in got[3:]]
    assert "invalid JSON on line 4" in reasons[0]
    assert reasons[1] == "empty conversation"
    assert "unknown speaker 'alien'" in reasons[2]
    assert "no 'messages'" in reasons[3]
    assert reasons[4] == "empty text"
    assert "not an object" in reasons[5]


def test_sample_ids_stable_and_content_sensitive(tmp_path):
    a = list(read_prompts(write_jsonl(tmp_path / "a.jsonl", [CHAT, SHAREGPT])))
    b = list(read_prompts(write_jsonl(tmp_path / "b.jsonl", [CHAT, SHAREGPT])))
    assert [p.sample_id for p in a] == [p.sample_id for p in b]
    changed = json.loads(json.dumps(SHAREGPT))
    changed["conversations"][1]["value"] = "Hi!"
    c = list(read_prompts(write_jsonl(tmp_path / "c.jsonl", [CHAT, changed])))
    assert c[0].sample_id == a[0].sample_id
    assert c[1].sample_id != a[1].sample_id
    # identical rows at different positions still get distinct ids
    d = list(read_prompts(write_jsonl(tmp_path / "d.jsonl", [CHAT, CHAT])))
    assert d[0].sample_id != d[1].sample_id


def test_txt_and_datasets_dirs(tmp_path):
    txt = tmp_path / "p.txt"
    txt.write_text("first prompt\n\nsecond prompt\n")
    got = list(read_prompts(txt))
    assert [type(r) for r in got] == [Prompt, SkippedRow, Prompt]
    assert got[2].text == "second prompt"

    # the layout `datasets.Dataset.save_to_disk` writes: Arrow IPC stream files + state.json
    hf_dir = tmp_path / "hf"
    hf_dir.mkdir()
    table = pa.table({"text": ["one", "two", ""]})
    arrow = str(hf_dir / "data-00000-of-00001.arrow")
    with pa.OSFile(arrow, "wb") as sink, pa.ipc.new_stream(sink, table.schema) as writer:
        writer.write_table(table)
    (hf_dir / "state.json").write_text(
        json.dumps({"_data_files": [{"filename": "data-00000-of-00001.arrow"}]})
    )
    got = list(read_prompts(hf_dir))
    assert all(isinstance(r, Prompt) for r in got[:2])
    assert [r.text for r in got[:2] if isinstance(r, Prompt)] == ["one", "two"]
    assert isinstance(got[2], SkippedRow)

    pq_dir = tmp_path / "pq"
    pq_dir.mkdir()
    pq.write_table(pa.table({"conversations": [SHAREGPT["conversations"]]}), pq_dir / "a.parquet")
    (pq_got,) = list(read_prompts(pq_dir))
    assert pq_got.messages[1] == ("assistant", "Hello!")


def test_unreadable_inputs_name_the_file(tmp_path):
    with pytest.raises(FileNotFoundError, match="no such file or directory") as exc:
        list(read_prompts(tmp_path / "missing.jsonl"))
    assert "missing.jsonl" in str(exc.value)
    bad = tmp_path / "p.csv"
    bad.write_text("a,b\n")
    with pytest.raises(BadInputError, match="unknown prompt format"):
        list(read_prompts(bad))
    latin = tmp_path / "latin.jsonl"
    latin.write_bytes(b'{"text": "caf\xe9"}\n')
    with pytest.raises(BadInputError, match="not UTF-8") as exc:
        list(read_prompts(latin))
    assert "latin.jsonl" in str(exc.value)


def test_loss_mask_covers_assistant_turns_only(tokenizer, tmp_path):
    (prompt,) = list(read_prompts(write_jsonl(tmp_path / "p.jsonl", [CHAT])))
    sample = ChatTokenizer(tokenizer).encode(prompt)
    assert isinstance(sample, TokenizedPrompt)
    ids, mask = sample.input_ids.tolist(), sample.loss_mask.tolist()
    # the ids are exactly the chat template's tokenisation
    assert ids == tokenizer.apply_chat_template(CHAT["messages"], tokenize=True, return_dict=False)
    eot = tokenizer.convert_tokens_to_ids("<|eot_id|>")
    masked = tokenizer.decode([i for i, m in zip(ids, mask) if m])
    assert masked == "Paris.<|eot_id|>Rome, of course.<|eot_id|>"
    # each assistant turn is one contiguous run ending with its end-of-turn token
    runs, start = [], None
    for k, m in enumerate(mask + [0]):
        if m and start is None:
            start = k
        elif not m and start is not None:
            runs.append((start, k))
            start = None
    assert len(runs) == 2
    assert all(ids[end - 1] == eot for _, end in runs)
    unmasked = tokenizer.decode([i for i, m in zip(ids, mask) if not m])
    for text in ("Be brief.", "capital of France", "And of Italy?", "assistant"):
        assert text in unmasked


def test_plain_text_is_all_loss_and_truncation(tokenizer):
    text = Prompt(0, None, "The quick brown fox jumps over the lazy dog.", "t")
    full = ChatTokenizer(tokenizer).encode(text)
    assert full.loss_mask.tolist() == [1] * full.num_tokens
    cut = ChatTokenizer(tokenizer, max_length=5).encode(text)
    assert cut.num_tokens == 5 and cut.truncated
    assert cut.input_ids.tolist() == full.input_ids.tolist()[:5]


def test_rows_without_assistant_tokens_are_skipped(tokenizer):
    chat = ChatTokenizer(tokenizer, max_length=8)
    user_only = Prompt(0, (("user", "hello there"),), None, "s")
    assert chat.encode(user_only).reason == "no assistant tokens"
    long_user = Prompt(1, (("user", "word " * 50), ("assistant", "ok")), None, "s")
    assert chat.encode(long_user).reason == "no assistant tokens within --max-length"


def test_template_that_rewrites_history_still_finds_spans(tokenizer):
    """A template hiding earlier assistant turns' reasoning breaks the prefix rule."""
    import copy

    tok = copy.deepcopy(tokenizer)
    tok.chat_template = (
        "{{ bos_token }}{% for m in messages %}"
        "<|start_header_id|>{{ m['role'] }}<|end_header_id|>\n\n"
        "{% if m['role'] == 'assistant' and not loop.last %}{{ m['content'].split('</think>')[-1] }}"
        "{% else %}{{ m['content'] }}{% endif %}<|eot_id|>{% endfor %}"
        "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}"
    )
    msgs = (
        ("user", "q1"),
        ("assistant", "<think>hmm</think>a1"),
        ("user", "q2"),
        ("assistant", "<think>ok</think>a2"),
    )
    got = ChatTokenizer(tok).encode(Prompt(0, msgs, None, "s"))
    ids, mask = got.input_ids.tolist(), got.loss_mask.tolist()
    masked = tok.decode([i for i, m in zip(ids, mask) if m])
    assert masked == "a1<|eot_id|><think>ok</think>a2<|eot_id|>"
    assert "q1" not in masked and "q2" not in masked


def test_chat_rows_need_a_template(tokenizer):
    import copy

    tok = copy.deepcopy(tokenizer)
    tok.chat_template = None
    with pytest.raises(BadInputError, match="no chat template"):
        ChatTokenizer(tok, path="m").encode(
            Prompt(0, (("user", "x"), ("assistant", "y")), None, "s")
        )


def test_parse_layers_canonical_and_foreign():
    n = 32
    default = parse_layers(None, n)
    # the final state before the norm: speculators' trainers need it, SpecForge's is derived
    assert [(s.depth, s.final_norm) for s in default] == [
        (2, False),
        (16, False),
        (29, False),
        (32, False),
    ]
    # every backend stores it (SGLang's through a hook on the final norm)
    for backend in ("transformers", "sglang"):
        assert parse_layers(default_layers(backend), n) == default
    # the default aux layers are what SGLang's EAGLE-3 capture uses when given no ids
    sglang_default = conventions.to_canonical(conventions.VLLM, [2, n // 2, n - 3], n)
    assert [s.depth for s in eagle3_aux_layers(n)] == [s.depth for s in sglang_default]
    assert [(s.depth, s.final_norm) for s in parse_layers("0,5,final-prenorm,final", n)] == [
        (0, False),
        (5, False),
        (32, False),
        (32, True),
    ]
    foreign = parse_layers("sglang-llama:1,15,28", n)
    assert [s.depth for s in foreign] == [2, 16, 29]
    assert foreign[0].source_convention == "sglang-llama" and foreign[0].source_id == 1
    assert [s.depth for s in parse_layers("eagle3", 4)] == sorted(
        {s.depth for s in parse_layers("eagle3", 4)}
    )
    for bad, match in (
        ("33", "outside"),
        ("x", "not a layer"),
        ("2,2", "twice"),
        ("nope:1", "unknown"),
    ):
        with pytest.raises(BadInputError, match=match):
            parse_layers(bad, n)


def test_shards_and_batches_are_deterministic():
    assert parse_shard("1/4") == (1, 4)
    for bad in ("4/4", "x", "1-2"):
        with pytest.raises(ValueError):
            parse_shard(bad)
    import torch

    samples = [
        TokenizedPrompt(
            f"s{i}",
            i,
            torch.zeros(n, dtype=torch.int64),
            torch.ones(n, dtype=torch.int64),
            "x",
            False,
        )
        for i, n in enumerate([5, 9, 3, 9, 1, 7, 2, 8])
    ]
    batches = plan_batches(samples, batch_size=3, max_batch_tokens=20)
    assert sorted(p.index for b in batches for p in b) == list(range(8))
    for b in batches:
        assert len(b) <= 3
        assert len(b) == 1 or len(b) * max(p.num_tokens for p in b) <= 20
    again = plan_batches(list(samples), batch_size=3, max_batch_tokens=20)
    assert [[p.index for p in b] for b in batches] == [[p.index for p in b] for b in again]
