"""Golden test: stored states mean what their canonical LayerSpec says.

For the tiny Llama, the states `hsstore extract` stores for every canonical layer are compared
with what forward hooks on a separately loaded copy of the model see at that point: the
embedding output (depth 0), each decoder layer's output (depth k = output of layer k-1), the
final norm's input (final-prenorm) and output (final). The hooks are independent of the
extractor's own mechanism (``output_hidden_states`` plus a pre-hook), so the semantics are
proven, not assumed.
"""

from __future__ import annotations

import json

import pytest
import torch

import hsstore
from hsstore.demo_model import build_tiny_model
from hsstore.extractors.runner import ExtractOptions, run_extract

N_LAYERS = 4
MESSAGES = [
    [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello there!"}],
    [
        {"role": "user", "content": "What is the capital of France? Answer briefly."},
        {"role": "assistant", "content": "The capital of France is Paris."},
    ],
    [{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "4"}],
]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("tiny"), layers=N_LAYERS)


@pytest.fixture(scope="module")
def prompts(tmp_path_factory):
    path = tmp_path_factory.mktemp("prompts") / "p.jsonl"
    path.write_text("".join(json.dumps({"messages": m}) + "\n" for m in MESSAGES))
    return path


def hooked_states(model_dir, input_ids: torch.Tensor) -> dict[tuple[int, bool], torch.Tensor]:
    """What hooks on the model itself see for one unpadded sequence."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir).eval()  # saved in float32
    base = model.model
    seen: dict[tuple[int, bool], torch.Tensor] = {}

    def keep(key, pick):
        def hook(_m, args, output=None):
            seen[key] = pick(args, output)[0].detach().clone()

        return hook

    handles = [base.embed_tokens.register_forward_hook(keep((0, False), lambda a, o: o))]
    for k, layer in enumerate(base.layers):
        out = lambda a, o: o[0] if isinstance(o, tuple) else o  # noqa: E731
        handles.append(
            layer.register_forward_hook(keep((k + 1, False), lambda a, o, f=out: f(a, o)))
        )
    handles.append(base.norm.register_forward_hook(keep((N_LAYERS, True), lambda a, o: o)))
    handles.append(
        base.norm.register_forward_pre_hook(
            lambda m, args: seen.__setitem__(("prenorm", False), args[0][0].detach().clone())
        )
    )
    with torch.inference_mode():
        model(input_ids=input_ids[None], attention_mask=torch.ones_like(input_ids)[None])
    for h in handles:
        h.remove()
    return seen


@pytest.mark.parametrize("batch_size", [1, 3])
def test_stored_states_equal_hooks(tiny, prompts, tmp_path, batch_size):
    out = tmp_path / f"ds{batch_size}"
    summary = run_extract(
        ExtractOptions(
            model=str(tiny),
            data=str(prompts),
            out=str(out),
            layers="0,1,2,3,final-prenorm,final",
            batch_size=batch_size,
            progress=False,
        )
    )
    assert summary["samples_written"] == len(MESSAGES)
    ds = hsstore.open(out)
    assert [(s.depth, s.final_norm) for s in ds.layers] == [
        (0, False),
        (1, False),
        (2, False),
        (3, False),
        (4, False),
        (4, True),
    ]
    lengths = {int(ds[i].input_ids.shape[0]) for i in range(len(ds))}
    assert batch_size == 1 or len(lengths) > 1, "batched run must involve padding"
    for i in range(len(ds)):
        sample = ds[i]
        seen = hooked_states(tiny, sample.input_ids)
        expected = [seen[(k, False)] for k in range(4)] + [
            seen[("prenorm", False)],
            seen[(4, True)],
        ]
        # the last decoder layer's output is the final norm's input: two views of one state
        assert torch.equal(seen[(4, False)], seen[("prenorm", False)])
        for pos, want in enumerate(expected):
            got = sample.hidden[:, pos]
            assert got.shape == want.shape
            if batch_size == 1:
                # same unpadded forward: identical bits
                assert torch.equal(got, want), f"layer {ds.layers[pos].label} differs"
            else:
                # padded batch: same maths, different kernel shapes
                torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
        # layers really differ from each other, so a mix-up could not pass
        assert not torch.allclose(sample.hidden[:, 4], sample.hidden[:, 5])
        assert not torch.allclose(sample.hidden[:, 1], sample.hidden[:, 2])
