"""One rule decides whether samples may join an existing dataset, whichever path writes them.

`Manifest.check_compatible` compares canonical layer meaning (depth, final_norm), hidden size,
dtype and, when both sides know it, the model depth. `create(exist_ok=True)`, `convert` into an
existing dataset and `extract` reruns all use it, so they agree with each other.
"""

from __future__ import annotations

import json

import pytest
import torch
from click.testing import CliRunner

import hsstore
from hsstore import LayerSpec
from hsstore.cli import main
from hsstore.demo_model import build_tiny_model
from hsstore.errors import ConflictError, IncompatibleDatasetError
from hsstore.interop.convert import convert, export_to_v1

N_LAYERS = 4
ROWS = [
    {"messages": [{"role": "user", "content": f"q {i}?"}, {"role": "assistant", "content": "a."}]}
    for i in range(3)
]


def _create(path, layers, **kwargs):
    args = dict(hidden_size=16, dtype="bfloat16", model={"num_hidden_layers": N_LAYERS})
    return hsstore.create(path, layers=layers, **{**args, **kwargs})


def test_every_difference_is_named_and_source_ids_do_not_count(tmp_path):
    man = _create(tmp_path / "ds", [LayerSpec(2), LayerSpec(4)]).manifest
    named = [LayerSpec(2, source_convention="speculators", source_id=1),
             LayerSpec(4, source_convention="vllm", source_id=4)]  # fmt: skip
    man.check_compatible(named, hidden_size=16, dtype=torch.bfloat16, num_hidden_layers=None)
    with pytest.raises(IncompatibleDatasetError) as info:
        man.check_compatible(
            [LayerSpec(2), LayerSpec(4, final_norm=True)],
            hidden_size=32,
            dtype="float16",
            num_hidden_layers=8,
            path="somewhere",
        )
    text = str(info.value)
    assert text.startswith("somewhere: existing dataset does not match")
    for part in (
        "layers [after 2, after 4] (asked for [after 2, after 4 +final_norm])",
        "hidden_size 16 (asked for 32)",
        "dtype bfloat16 (asked for float16)",
        "4 decoder layers (asked for 8)",
    ):
        assert part in text
    assert isinstance(info.value, ConflictError)


def test_create_exist_ok_uses_the_rule(tmp_path):
    path = tmp_path / "ds"
    _create(path, [LayerSpec(2), LayerSpec(4)])
    again = _create(path, [LayerSpec(2, source_convention="hf", source_id=2), LayerSpec(4)],
                    exist_ok=True)  # fmt: skip
    assert again.manifest.version == 1
    with pytest.raises(IncompatibleDatasetError, match="decoder layers"):
        _create(path, [LayerSpec(2), LayerSpec(4)], model={"num_hidden_layers": 6}, exist_ok=True)


def test_a_convert_joins_a_dataset_made_by_extract(tmp_path):
    """extract records no source ids; a v1 export converted back names the same states in
    speculators ids. It is the same data, so convert must accept the extract-made dataset."""
    model = build_tiny_model(tmp_path / "model", layers=N_LAYERS)
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    out = tmp_path / "ds"
    args = ["extract", "--no-progress", "--model", str(model), "--data", str(prompts)]
    made = CliRunner().invoke(main, [*args, "--out", str(out), "--layers", "1,2,final-prenorm"])
    assert made.exit_code == 0, made.output
    extracted = hsstore.open(out)
    assert all(layer.source_convention is None for layer in extracted.layers)

    export_to_v1(out, tmp_path / "v1", progress=False)
    res = convert(tmp_path / "v1", out, progress=False)
    assert res.added + res.already_present == len(extracted) == len(ROWS)
    joined = hsstore.open(out)
    assert [(s.depth, s.final_norm) for s in joined.layers] == [(1, False), (2, False), (4, False)]
    assert len(joined) == len(extracted) + res.added

    # The same rule refuses an extract rerun asking for other states, naming both sides.
    other = CliRunner().invoke(main, [*args, "--out", str(out), "--layers", "1,3,final-prenorm"])
    assert other.exit_code == 2
    assert "existing dataset does not match: it has layers [after 1, after 2, after 4]" in (
        other.output
    )
    assert "(asked for [after 1, after 3, after 4])" in other.output
    assert len(hsstore.open(out)) == len(joined)
