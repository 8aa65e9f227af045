"""`hsstore extract` in-process: multi-node shards, and bad input that must fail cleanly."""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

import hsstore
from hsstore.cli import main
from hsstore.demo_model import build_tiny_model

ROWS = [
    {
        "messages": [
            {"role": "user", "content": f"question {i}?"},
            {"role": "assistant", "content": f"answer {i}."},
        ]
    }
    for i in range(6)
]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("tiny"))


@pytest.fixture(scope="module")
def prompts(tmp_path_factory):
    path = tmp_path_factory.mktemp("p") / "p.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    return path


def extract(*args: str):
    return CliRunner().invoke(main, ["extract", "--no-progress", *args])


def test_shards_add_up_to_the_whole_set(tiny, prompts, tmp_path):
    out = tmp_path / "ds"
    base = ["--model", str(tiny), "--data", str(prompts), "--out", str(out), "--json"]
    first = extract(*base, "--shard", "0/2")
    assert first.exit_code == 0, first.output
    assert json.loads(first.output)["samples_written"] == 3
    assert len(hsstore.open(out)) == 3
    second = extract(*base, "--shard", "1/2")
    assert second.exit_code == 0, second.output
    ds = hsstore.open(out)
    assert len(ds) == len(ROWS)
    assert sorted(int(s[1:9]) for s in ds.sample_ids) == list(range(len(ROWS)))


def test_text_summary_names_skips(tiny, tmp_path):
    data = tmp_path / "p.jsonl"
    data.write_text(json.dumps(ROWS[0]) + "\n{broken\n")
    result = extract("--model", str(tiny), "--data", str(data), "--out", str(tmp_path / "ds"))
    assert result.exit_code == 0, result.output
    assert "1 samples" in result.output and "1 rows skipped" in result.output
    assert "invalid JSON on line 2" in result.output


@pytest.mark.parametrize(
    "change, match",
    [
        ({"--data": "missing.jsonl"}, "missing.jsonl: no such file or directory"),
        ({"--model": "no-such-model"}, "no-such-model: no such file or directory"),
        ({"--layers": "2,banana"}, "'banana' is not a layer"),
        ({"--layers": "9"}, "outside 0..4"),
        ({"--shard": "2/2"}, "need 0 <= i < N"),
        ({"--workers": "0"}, "--workers must be >= 1"),
        ({"--batch-size": "0"}, "--batch-size must be >= 1"),
        ({"--max-length": "0"}, "--max-length must be >= 1"),
        ({"--device": "cuda:99"}, "--device cuda:99"),
        ({"--device": "tpu"}, "use cpu, cuda"),
    ],
)
def test_bad_arguments_exit_2_with_one_line(tiny, prompts, tmp_path, change, match):
    args = {"--model": str(tiny), "--data": str(prompts), "--out": str(tmp_path / "ds")}
    for key, value in change.items():
        args[key] = str(tmp_path / value) if key in ("--data", "--model") else value
    result = extract(*[x for kv in args.items() for x in kv])
    assert result.exit_code == 2
    assert match in result.output
    assert "Traceback" not in result.output
    assert not (tmp_path / "ds").exists()


@pytest.mark.parametrize("folder_was_there", [False, True])
def test_no_usable_rows_is_an_error_that_leaves_nothing_behind(tiny, tmp_path, folder_was_there):
    data = tmp_path / "bad.jsonl"
    data.write_text('{"messages": []}\nnot json\n{"text": ""}\n')
    out = tmp_path / "ds"
    if folder_was_there:
        out.mkdir()
    result = extract("--model", str(tiny), "--data", str(data), "--out", str(out))
    assert result.exit_code == 2
    assert "bad.jsonl" in result.output and "no usable rows" in result.output
    # no empty dataset: the folder is gone, or left as it was (empty)
    assert (list(out.iterdir()) == []) if folder_was_there else not out.exists()


def test_mismatched_existing_dataset_is_refused_and_kept(tiny, prompts, tmp_path):
    out = tmp_path / "ds"
    base = ["--model", str(tiny), "--data", str(prompts), "--out", str(out)]
    assert extract(*base, "--layers", "2,final").exit_code == 0
    before = hsstore.open(out)
    ids, version = before.sample_ids, before.manifest.version
    result = extract(*base, "--layers", "1,final")
    assert result.exit_code == 2
    assert "does not match" in result.output and "after 2" in result.output
    assert str(out) in result.output
    result = extract(*base, "--layers", "2,final", "--dtype", "bfloat16")
    assert result.exit_code == 2 and "dtype float32" in result.output
    after = hsstore.open(out)
    assert after.sample_ids == ids and after.manifest.version == version
    assert hsstore.verify(out).ok


def test_one_worker_tokenizes_with_the_tokenizer_the_run_checked(
    tiny, prompts, tmp_path, monkeypatch
):
    """The model's tokenizer is loaded once per run: a worker in this process takes the one the
    checks before any model runs loaded, instead of loading it again from the same files."""
    from transformers import AutoTokenizer

    real = AutoTokenizer.from_pretrained.__func__
    loaded: list[str] = []

    def counted(cls, name, *args, **kwargs):
        loaded.append(str(name))
        return real(cls, name, *args, **kwargs)

    monkeypatch.setattr(AutoTokenizer, "from_pretrained", classmethod(counted))
    out = tmp_path / "ds"
    result = extract("--model", str(tiny), "--data", str(prompts), "--out", str(out), "--json")
    assert result.exit_code == 0, result.output
    assert json.loads(result.output)["samples_written"] == len(ROWS)
    assert loaded == [str(tiny)]
