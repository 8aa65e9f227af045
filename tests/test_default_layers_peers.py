"""The default extraction serves every peer, without extracting again.

``hsstore extract`` with no ``--layers`` stores the EAGLE-3 aux layers and the final state before
the norm. From that one dataset: speculators v1 files; speculators Arrow, read by speculators 0.9's
own ``ArrowDataset``/``CollateFn`` and trained a step by its ``Eagle3DraftModel``; SpecForge files,
read by SpecForge's own reader, whose post-norm state (the norm applied on export) is bit for bit
what an extraction of the post-norm state stores; and hsstore's own trainer. A dataset that stores
the final state after the norm cannot feed speculators, and says which ``--layers`` would have.
"""

from __future__ import annotations

import json
import math
import shutil

import pytest
import torch
from click.testing import CliRunner

import hsstore
from hsstore import LayerSpec
from hsstore.cli import main
from hsstore.demo import demo_prompts
from hsstore.demo_model import build_tiny_model
from hsstore.interop.formats import open_foreign
from tests.peer_packages import peer
from tests.test_interop_specforge import read_with_specforge

N, H, VOCAB = 8, 64, 512
AUX = [LayerSpec(2), LayerSpec(4), LayerSpec(5)]  # eagle3 for 8 layers: vLLM ids 2, N//2, N-3


def bits(t: torch.Tensor) -> bytes:
    return t.contiguous().view(torch.uint8).numpy().tobytes()


def run(*args: str):
    return CliRunner().invoke(main, [str(a) for a in args])


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("default_layers")
    model = build_tiny_model(root / "model", hidden=H, layers=N, vocab=VOCAB, seed=0)
    prompts = root / "prompts.jsonl"
    prompts.write_text("".join(json.dumps(r) + "\n" for r in demo_prompts()[:6]))
    common = ("--model", model, "--data", prompts, "--workers", 1, "--no-progress")
    made = run("extract", *common, "--out", root / "ds")
    assert made.exit_code == 0, made.output
    # The same prompts with the post-norm final state (the default before, and SGLang's), made
    # in two runs: the second leaves out --layers and so keeps the dataset's own.
    for extra in (("--layers", "eagle3,final", "--limit", 2), ()):
        again = run("extract", *common, "--out", root / "post", *extra)
        assert again.exit_code == 0, again.output
    return root, model


def test_default_stores_the_final_state_before_the_norm(setup):
    root, model = setup
    ds = hsstore.open(root / "ds")
    assert list(ds.layers) == [*AUX, LayerSpec(N)] and len(ds) == 6
    post = hsstore.open(root / "post")
    assert list(post.layers) == [*AUX, LayerSpec(N, final_norm=True)] and len(post) == 6
    # inspect's norm checks read the stored state as what it is declared to be
    r = run("inspect", root / "ds", "--lm-head", model, "--json")
    checks = {c["name"]: c["verdict"] for c in json.loads(r.stdout)["checks"]}
    assert checks["final_norm"] == "OK" and checks["final_norm_exact"] == "OK", r.stdout


def test_speculators_v1_export_holds_the_stored_states(setup):
    root, _ = setup
    r = run("convert", root / "ds", root / "v1", "--to", "speculators-v1", "--no-progress")
    assert r.exit_code == 0, r.output
    cfg = json.loads((root / "v1" / "data_config.json").read_text())
    assert cfg["hidden_states"]["layer_ids"] == [1, 3, 4, N - 1]  # speculators ids: depth - 1
    ds = hsstore.open(root / "ds")
    reader = open_foreign(root / "v1")
    assert [(s.depth, s.final_norm) for s in reader.layers] == [(s.depth, False) for s in ds.layers]
    for k in range(len(ds)):
        mine, theirs = ds[k], reader.read(k)
        assert torch.equal(theirs.input_ids, mine.input_ids)
        assert bits(theirs.hidden) == bits(mine.hidden)
        # the file's last tensor is what speculators' trainer takes as the verifier's last state
        saved = torch.load(root / "v1" / f"data_{k}.pt", weights_only=True)
        assert bits(saved["hidden_states"][-1]) == bits(mine.hidden[:, -1])


def test_speculators_arrow_export_trains_in_speculators(setup):
    root, model = setup
    r = run("convert", root / "ds", root / "arrow", "--to", "speculators-arrow", "--no-progress")
    assert r.exit_code == 0, r.output
    data = peer("speculators.train.data")
    shift_batch = peer("speculators.models.eagle3.data").shift_batch
    Eagle3DraftModel = peer("speculators.models.eagle3.core").Eagle3DraftModel
    from transformers import AutoConfig, AutoModelForCausalLM

    theirs = data.ArrowDataset(max_len=512, datapath=str(root / "arrow"), on_missing="raise",
                               hidden_states_dtype=torch.float32)  # fmt: skip
    items = [theirs[k] for k in range(len(theirs))]
    ds = hsstore.open(root / "ds")
    stored = ds[0]
    assert bits(items[0]["verifier_last_hidden_states"]) == bits(stored.hidden[:, -1])

    draft_config = AutoConfig.from_pretrained(model)
    draft_config.num_hidden_layers = 1
    drafter = Eagle3DraftModel.from_training_args(
        verifier_config=draft_config, verifier_name_or_path=str(model), target_layer_ids=[2, 4, 5],
        draft_vocab_size=VOCAB, norm_before_residual=True, ttt_steps=2, draft_attn_impl="eager",
    )  # fmt: skip
    # Its trainer's targets are its verifier norm + head over the stored state: the target
    # model's own logits, which only a state stored before the norm gives.
    target = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32).eval()
    with torch.no_grad():
        logits = target(items[0]["input_ids"][None]).logits[0]
        theirs_logits = drafter.verifier_lm_head(
            drafter.verifier_norm(items[0]["verifier_last_hidden_states"])
        )
    torch.testing.assert_close(theirs_logits, logits, rtol=1e-5, atol=1e-5)

    batch = data.CollateFn(512, H, num_target_layers=3, dtype=torch.float32,
                           preprocess=shift_batch)(items)  # fmt: skip
    call_kwargs, _ = Eagle3DraftModel.get_trainer_kwargs(
        ttt_steps=2, ttt_step_loss_decay=1.0, loss_fn="kl_div", loss_implementation="eager"
    )
    optimizer = torch.optim.AdamW([p for p in drafter.parameters() if p.requires_grad], lr=1e-3)
    before = drafter.fc.weight.detach().clone()
    _, loss, _ = drafter(**batch, **call_kwargs)
    loss.backward()
    optimizer.step()
    assert math.isfinite(loss.item()) and loss.item() > 0
    assert not torch.equal(drafter.fc.weight, before)


def test_specforge_export_applies_the_recorded_models_norm(setup):
    root, model = setup
    r = run("convert", root / "ds", root / "sf", "--to", "specforge", "--no-progress")
    assert r.exit_code == 0, r.output
    assert f"final norm applied to the final state (from {model}" in r.output
    done = run("convert", root / "post", root / "sf-post", "--to", "specforge", "--no-progress")
    assert done.exit_code == 0, done.output
    derived, extracted = (
        read_with_specforge(root / "sf", 512),
        read_with_specforge(root / "sf-post", 512),
    )
    assert sorted(derived) == list(range(6))
    post_ids = hsstore.open(root / "post").index.column("sample_id").to_pylist()
    for k, name in enumerate(hsstore.open(root / "ds").index.column("sample_id").to_pylist()):
        mine, theirs = derived[k], extracted[post_ids.index(name)]
        # the norm applied on export == the norm applied by the model in the extraction
        assert bits(mine["target"]) == bits(theirs["target"])
        assert bits(mine["hidden_state"]) == bits(theirs["hidden_state"])


def test_hsstore_trainer_trains_from_the_default(setup, tmp_path):
    from hsstore.trainers.eagle3.train import main as train

    root, model = setup
    result = train(["--data", str(root / "ds"), "--target", str(model), "--out", str(tmp_path),
                    "--steps", "2", "--max-tokens", "256", "--draft-vocab-size", "128",
                    "--num-threads", "1"])  # fmt: skip
    assert result["summary"]["steps"] == 2 and math.isfinite(result["summary"]["loss_last"])


@pytest.mark.parametrize("fmt", ["speculators-v1", "speculators-arrow"])
def test_post_norm_dataset_names_the_layers_that_would_export(setup, fmt):
    root, _ = setup
    r = run("convert", root / "post", root / f"no-{fmt}", "--to", fmt)
    assert r.exit_code == 2 and "Traceback" not in r.output
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and "cannot be undone" in lines[0]
    assert "extracting with --layers 2,4,5,final-prenorm would have made it exportable" in lines[0]
    assert not (root / f"no-{fmt}").exists()


def test_specforge_export_without_the_model_folder_asks_for_target(setup, tmp_path):
    root, model = setup
    shutil.copytree(root / "ds", tmp_path / "ds")
    moved = tmp_path / "elsewhere"
    shutil.move(model, moved)
    try:
        r = run("convert", tmp_path / "ds", tmp_path / "sf", "--to", "specforge")
    finally:
        shutil.move(moved, model)
    assert r.exit_code == 2
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and "pass --target MODEL_DIR" in lines[0] and str(model) in lines[0]


def test_check_against_sglang_refuses_what_it_cannot_capture_before_extracting(setup, tmp_path):
    root, model = setup
    r = run("extract", "--model", model, "--data", root / "prompts.jsonl", "--out",
            tmp_path / "ds", "--layers", "0,2,final-prenorm", "--check-against", "sglang",
            "--no-progress")  # fmt: skip
    assert r.exit_code == 2 and "cannot return depth 0" in r.stderr
    assert not (tmp_path / "ds").exists()
