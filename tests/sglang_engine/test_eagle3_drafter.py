"""The reference trainer's EAGLE-3 checkpoints in SGLang 0.5.23's own drafter class, fed the aux
states SGLang's own target capture hands it.

SGLang's speculative decoding cannot start on CPU (docs/TRAINER.md, "Serving the checkpoint"),
so serving is checked where SGLang reads what the trainer wrote, with SGLang's own code
(sglang_drafter.py, one child process for the module), for a draft vocabulary equal to the
target's and a smaller one:

* ``LlamaForCausalLMEagle3`` built from config.json loads model.safetensors with its own
  ``load_weights``: every parameter ends equal to the checkpoint's tensor (q/k/v and gate/up
  stacked as the class stacks them) and none keeps its initial value, whatever the class drops
  silently; the draft-to-target map it derives (``hot_token_id``) is the trainer's, and absent
  where the vocabularies are equal.
* The aux states: the target's states captured by SGLang's engine with the checkpoint's
  ``eagle_config`` ids, packed as SGLang hands them to the drafter, give through the loaded
  drafter's ``fc`` what the trainer's ``fc`` gives on the aux states as the trainer's loader
  concatenated them; the same states in the dataset's stored order, or in the order of the ids,
  do not (the planted wrong orders that show the comparison can fail).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import tiny_models
import torch
from lane import HERE, Reference, rel_err
from safetensors.torch import load_file

import hsstore
from hsstore import LayerSpec
from hsstore.loader import Loader
from hsstore.trainers.eagle3.checkpoint import VOCAB_MAP_KEYS, load_drafter
from hsstore.trainers.eagle3.model import load_target_tensors
from hsstore.trainers.eagle3.train import main as train
from hsstore.trainers.eagle3.train import split_layers

N, HIDDEN, VOCAB = tiny_models.N_LAYERS, tiny_models.HIDDEN, tiny_models.VOCAB
# aux depths in the dataset's stored order, which is not the order the trainer concatenates
STORED_DEPTHS = [4, 1, 2]
TRAINED_DEPTHS = sorted(STORED_DEPTHS)
DRAFT_VOCABS = (VOCAB, VOCAB // 2)
SAMPLES, TOKENS, CAPTURED = 12, 24, 2
# SGLang's stacked parameters (models/llama_eagle3.py:327-334): shard name -> (stack, position)
STACKED = {
    "q_proj": ("qkv_proj", 0),
    "k_proj": ("qkv_proj", 1),
    "v_proj": ("qkv_proj", 2),
    "gate_proj": ("gate_up_proj", 0),
    "up_proj": ("gate_up_proj", 1),
}


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A tiny Llama target, its states at the aux depths and the last (pre-norm) state for a
    few token sequences, and a drafter trained on them for each draft vocabulary."""
    root = tmp_path_factory.mktemp("drafter")
    target = tiny_models.build("LlamaForCausalLM", root / "target")
    ref = Reference(target, torch.float32)
    ds = hsstore.create(
        root / "ds",
        layers=[*(LayerSpec(depth=d) for d in STORED_DEPTHS), LayerSpec(depth=N)],
        hidden_size=HIDDEN,
        dtype=torch.float32,
        model={"name": "tiny-llama", "num_hidden_layers": N, "hidden_size": HIDDEN,
               "vocab_size": VOCAB},
    )  # fmt: skip
    gen = torch.Generator().manual_seed(0)
    with ds.writer() as w:
        for i in range(SAMPLES):
            ids = torch.randint(3, VOCAB, (TOKENS,), generator=gen)
            hidden, _ = ref.states(ids)
            states = torch.stack([hidden[d] for d in [*STORED_DEPTHS, N]], dim=1)
            w.add(f"s{i}", ids, torch.ones_like(ids), states.contiguous())
    checkpoints = {}
    for vocab in DRAFT_VOCABS:
        run = train(
            ["--data", str(root / "ds"), "--target", str(target), "--out", str(root / f"v{vocab}"),
             "--steps", "4", "--max-tokens", str(4 * TOKENS), "--draft-vocab-size", str(vocab),
             "--lr", "1e-2", "--warmup", "1", "--log-every", "2", "--num-threads", "1",
             "--eval-samples", "2"]
        )  # fmt: skip
        checkpoints[vocab] = Path(run["checkpoint"])
    return {"root": root, "target": target, "ds": root / "ds", "checkpoints": checkpoints}


def trainer_aux(ds_dir: Path, count: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(token ids [T], aux states [T, k*H]) of the first ``count`` samples, concatenated by the
    trainer's own loader with the trainer's choice of aux layers."""
    ds = hsstore.open(ds_dir)
    aux_pos, _ = split_layers(ds.layers, N, need_last=True)
    assert [ds.layers[i].depth for i in aux_pos] == TRAINED_DEPTHS
    loader = Loader(ds_dir, max_tokens=TOKENS, shuffle=False, aux_layers=aux_pos, verifier=False,
                    prefetch=1, num_threads=1)  # fmt: skip
    out = []
    try:
        for batch in loader:  # views of buffers the loader reuses: copied out
            lengths = batch["lengths"].tolist()
            ids = batch["input_ids"][0].split(lengths)
            aux = batch["hidden_states"][0].split(lengths)
            out.extend((i.clone(), a.clone()) for i, a in zip(ids, aux, strict=True))
            if len(out) >= count:
                return out[:count]
    finally:
        loader.close()
    raise AssertionError(f"the loader gave {len(out)} samples, {count} wanted")


@pytest.fixture(scope="module")
def in_sglang(trained):
    """What SGLang's drafter class and engine made of the checkpoints (sglang_drafter.py)."""
    samples = trainer_aux(trained["ds"], CAPTURED)
    request = trained["root"] / "sglang_request.json"
    out = trained["root"] / "sglang_result.pt"
    checkpoints = [str(trained["checkpoints"][v]) for v in DRAFT_VOCABS]
    request.write_text(json.dumps({
        "checkpoints": checkpoints, "target": str(trained["target"]),
        "samples": [ids.tolist() for ids, _ in samples], "out": str(out),
    }))  # fmt: skip
    proc = subprocess.run(
        [sys.executable, str(HERE / "sglang_drafter.py"), str(request)],
        capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-4000:]
    result = torch.load(out, weights_only=True)
    return {**result, "samples": samples}


def sglang_layout(weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The checkpoint's tensors under the parameter names and in the layout of SGLang's class:
    under ``model.`` but for ``lm_head``, ``midlayer.`` read as ``layers.0.``, q/k/v and gate/up
    stacked along the output dimension in that order; the vocabulary maps are no parameters."""
    out: dict[str, torch.Tensor] = {}
    stacks: dict[str, dict[int, torch.Tensor]] = {}
    for name, tensor in weights.items():
        if name in VOCAB_MAP_KEYS:
            continue
        name = name.replace("midlayer.", "layers.0.")
        name = name if name.startswith("lm_head.") else f"model.{name}"
        *module, leaf, kind = name.split(".")
        if leaf in STACKED:
            stack, position = STACKED[leaf]
            stacks.setdefault(".".join([*module, stack, kind]), {})[position] = tensor
        else:
            out[name] = tensor
    for name, shards in stacks.items():
        out[name] = torch.cat([shards[i] for i in sorted(shards)])
    return out


@pytest.mark.parametrize("draft_vocab", DRAFT_VOCABS)
def test_sglang_drafter_class_loads_every_tensor_of_the_checkpoint(trained, in_sglang, draft_vocab):
    path = trained["checkpoints"][draft_vocab]
    got = in_sglang["drafters"][str(path)]
    assert got["class"] == "LlamaForCausalLMEagle3"
    weights = load_file(path / "model.safetensors")
    assert ("d2t" in weights) == (draft_vocab < VOCAB)
    expect = sglang_layout(weights)
    # load_weights drops a name it does not know without a word: the names must match exactly
    assert sorted(got["after"]) == sorted(expect)
    for name, value in expect.items():
        assert got["after"][name].dtype == value.dtype, name
        assert torch.equal(got["after"][name], value), name
        assert not torch.equal(got["before"][name], value), f"{name}: equal before loading"
    assert got["after"]["lm_head.weight"].shape[0] == draft_vocab
    # the class keeps the drafter's own LM head; the engine then only swaps in the target's
    # embedding (speculative/eagle_worker_v2.py:353-363), which the trainer trained with
    assert got["load_lm_head_from_target"] is False
    target_embed = load_target_tensors(trained["target"], want=("embed",))[0]["embed"]
    assert torch.equal(weights["embed_tokens.weight"], target_embed.float())


@pytest.mark.parametrize("draft_vocab", DRAFT_VOCABS)
def test_sglang_maps_draft_tokens_to_target_tokens_as_the_trainer_does(
    trained, in_sglang, draft_vocab
):
    path = trained["checkpoints"][draft_vocab]
    hot = in_sglang["drafters"][str(path)]["hot_token_id"]
    ours, _ = load_drafter(path)
    if draft_vocab == VOCAB:
        # no d2t, no map: the engine takes a draft id for the target id (it maps through
        # hot_token_id only when there is one, speculative/eagle_worker_v2.py:757-758 and :897-898),
        # which is what the trainer's identity map says
        assert hot is None
        assert torch.equal(ours.draft_to_target, torch.arange(VOCAB))
    else:
        assert hot is not None
        assert torch.equal(hot, ours.draft_to_target)
        assert not torch.equal(hot, torch.arange(draft_vocab))  # a map that moves ids
        assert len(set(hot.tolist())) == draft_vocab and int(hot.max()) < VOCAB


def reorder(aux: torch.Tensor, depths: list[int]) -> torch.Tensor:
    """Trainer-ordered aux states [T, k*H] with their blocks put in the order of ``depths``."""
    blocks = aux.view(aux.shape[0], len(TRAINED_DEPTHS), -1)
    return blocks[:, [TRAINED_DEPTHS.index(d) for d in depths]].flatten(1)


def test_sglang_feeds_fc_the_aux_states_in_the_order_the_trainer_concatenated(trained, in_sglang):
    first = json.loads((trained["checkpoints"][VOCAB] / "config.json").read_text())
    ids = first["eagle_config"]["eagle_aux_hidden_state_layer_ids"]
    # the case in question: ids that start [1, 0] for depths [1, 2]
    assert ids == [1, 0, 3]
    planted = {
        "stored order": STORED_DEPTHS,
        "order of the ids": [i + 1 for i in ids],  # models/llama.py:941 captures layer id + 1
    }
    assert all(order != TRAINED_DEPTHS for order in planted.values())
    for (_, trained_aux), engine_aux in zip(in_sglang["samples"], in_sglang["aux"], strict=True):
        assert engine_aux.shape == trained_aux.shape
        assert rel_err(engine_aux, trained_aux) < 1e-5, rel_err(engine_aux, trained_aux)
    for vocab in DRAFT_VOCABS:
        path = trained["checkpoints"][vocab]
        got = in_sglang["drafters"][str(path)]
        # nothing but fc between the aux states and the draft layer (models/llama_eagle3.py:237-247)
        assert not got["input_norm"] and not got["fc_norm"]
        ours, _ = load_drafter(path)
        for (_, trained_aux), sglang_fc in zip(in_sglang["samples"], got["fc"], strict=True):
            with torch.no_grad():
                expect = ours.fc(trained_aux.float())
                wrong = {k: ours.fc(reorder(trained_aux.float(), d)) for k, d in planted.items()}
            assert rel_err(sglang_fc, expect) < 1e-5, (vocab, rel_err(sglang_fc, expect))
            for name, value in wrong.items():  # each planted order would fail the line above
                assert rel_err(sglang_fc, value) > 0.1, (vocab, name, rel_err(sglang_fc, value))
