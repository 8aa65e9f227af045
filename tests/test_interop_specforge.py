"""hsstore <-> SpecForge 0.2, proven with SpecForge's own reader, store, normaliser and collator.

The states come from a tiny random Llama built here: the final state is captured before the
final norm (as vLLM, speculators and hsstore's extractors store it), and SpecForge's
``hidden_state`` must equal transformers' own post-norm output bit for bit.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

import hsstore
from hsstore.cli import main
from hsstore.errors import BadInputError
from hsstore.interop.convert import convert
from hsstore.spec.layers import LayerSpec
from tests.peer_packages import peer

N, H, VOCAB = 4, 32, 128
LENGTHS = [7, 2, 12]


def bits(t: torch.Tensor) -> bytes:
    return t.contiguous().view(torch.uint8).numpy().tobytes()


@pytest.fixture(scope="module")
def model_run(tmp_path_factory):
    """(model dir, per sample: ids, mask, [T, 4, H] aux depths 1..3 + pre-norm final, post-norm)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(hidden_size=H, intermediate_size=2 * H, num_hidden_layers=N,
                      num_attention_heads=4, num_key_value_heads=4, vocab_size=VOCAB,
                      rms_norm_eps=1e-5, tie_word_embeddings=False)  # fmt: skip
    model = LlamaForCausalLM(cfg).to(torch.bfloat16).eval()
    with torch.no_grad():
        model.model.norm.weight.uniform_(0.3, 2.0)
    root = tmp_path_factory.mktemp("model")
    model.save_pretrained(root, safe_serialization=True)
    pre: dict = {}
    model.model.norm.register_forward_pre_hook(lambda m, a: pre.__setitem__("x", a[0]))
    out = []
    for k, t in enumerate(LENGTHS):
        g = torch.Generator().manual_seed(k)
        ids = torch.randint(0, VOCAB, (t,), generator=g, dtype=torch.int64)
        mask = (torch.rand(t, generator=g) < 0.7).to(torch.int64)
        with torch.no_grad():
            hs = model(ids[None], output_hidden_states=True).hidden_states
        hidden = torch.stack([hs[1][0], hs[2][0], hs[3][0], pre["x"][0]], dim=1)
        out.append((ids, mask, hidden.contiguous(), hs[N][0].contiguous()))
    return root, out


PRE_NORM = [LayerSpec(1), LayerSpec(2), LayerSpec(3), LayerSpec(N)]


def make_dataset(path: Path, layers, run) -> None:
    ds = hsstore.create(path, layers=layers, hidden_size=H, dtype=torch.bfloat16,
                        model={"num_hidden_layers": N})  # fmt: skip
    with ds.writer() as w:
        for k, (ids, mask, hidden, _post) in enumerate(run):
            w.add(f"s{k}", ids, mask, hidden)
        w.commit()


def read_with_specforge(out: Path, max_len: int = 64) -> dict[int, dict]:
    """sample k -> SpecForge's normalised tensors, through its reader, store and normaliser."""
    reader = peer("specforge.runtime.data_plane.offline_reader")
    store_mod = peer("specforge.runtime.data_plane.feature_store")
    eagle3 = peer("specforge.algorithms.eagle3.data")
    store = store_mod.LocalFeatureStore("test")
    normalize = eagle3.build_offline_normalizer(max_len)
    got = {}
    for ref in reader.OfflineManifestReader(str(out)).read():
        k = int(re.search(r"data_(\d+)\.ckpt$", ref.feature_store_uri).group(1))
        raw, handle = store.get(ref)
        got[k] = normalize(raw)
        store.release(handle)
    return got


def test_export_applies_the_final_norm_and_reads_in_specforge(tmp_path, model_run):
    model_dir, run = model_run
    make_dataset(tmp_path / "ds", PRE_NORM, run)
    r = CliRunner().invoke(main, ["convert", str(tmp_path / "ds"), str(tmp_path / "out"),
                                  "--to", "specforge", "--target", str(model_dir),
                                  "--no-progress"])  # fmt: skip
    assert r.exit_code == 0, r.output
    assert "final norm applied" in r.output and "aux layer ids 0,1,2" in r.output
    assert (tmp_path / "out" / "rows_0-2000" / "data_2.ckpt").exists()
    got = read_with_specforge(tmp_path / "out")
    assert sorted(got) == list(range(len(run)))
    for k, (ids, mask, hidden, post) in enumerate(run):
        g = got[k]
        assert bits(g["target"][0]) == bits(post)  # transformers' own final norm output
        assert bits(g["hidden_state"][0]) == bits(hidden[:, :3].reshape(len(ids), 3 * H))
        assert torch.equal(g["input_ids"][0], ids)
        want_mask = mask.clone()
        want_mask[-1] = 0  # SpecForge's normaliser clears the last position
        assert torch.equal(g["loss_mask"][0], want_mask)
    collator = peer("specforge.algorithms.eagle3.data").build_offline_collator()
    batch = collator([got[0], got[1]])
    t0, t1 = LENGTHS[0], LENGTHS[1]
    assert bits(batch["target"][1, :t1]) == bits(run[1][3])
    assert batch["target"].shape[1] == t0 and not batch["target"][1, t1:].any()


def test_pre_norm_export_without_target_is_refused_in_one_line(tmp_path, model_run):
    make_dataset(tmp_path / "ds", PRE_NORM, model_run[1])
    r = CliRunner().invoke(
        main, ["convert", str(tmp_path / "ds"), str(tmp_path / "out"), "--to", "specforge"]
    )
    assert r.exit_code == 2 and "Traceback" not in r.output
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and "pass --target MODEL_DIR" in lines[0]
    assert not (tmp_path / "out").exists()


def test_post_norm_data_exports_as_stored(tmp_path, model_run):
    _, run = model_run
    layers = [*PRE_NORM[:3], LayerSpec(N, final_norm=True)]
    post_run = [(i, m, torch.cat([h[:, :3], p[:, None]], dim=1), p) for i, m, h, p in run]
    make_dataset(tmp_path / "ds", layers, post_run)
    convert(tmp_path / "ds", tmp_path / "out", dst_format="specforge", progress=False)
    got = read_with_specforge(tmp_path / "out")
    for k, (_i, _m, _h, post) in enumerate(run):
        assert bits(got[k]["target"][0]) == bits(post)


@pytest.mark.parametrize(
    "layers", [[LayerSpec(1), LayerSpec(3), LayerSpec(N)], [LayerSpec(2), LayerSpec(1),
               LayerSpec(3), LayerSpec(N)], [LayerSpec(0), LayerSpec(1), LayerSpec(2),
               LayerSpec(3)]]
)  # fmt: skip
def test_export_refuses_what_specforge_cannot_hold(tmp_path, model_run, layers):
    run = [(i, m, h[:, : len(layers)].contiguous(), p) for i, m, h, p in model_run[1]]
    make_dataset(tmp_path / "ds", layers, run)
    with pytest.raises(BadInputError, match="cannot export to specforge"):
        convert(tmp_path / "ds", tmp_path / "out", dst_format="specforge",
                target=model_run[0], progress=False)  # fmt: skip


def test_target_of_another_model_is_refused(tmp_path, model_run):
    make_dataset(tmp_path / "ds", PRE_NORM, model_run[1])
    other = tmp_path / "other"
    other.mkdir()
    (other / "config.json").write_text((model_run[0] / "config.json").read_text())
    with pytest.raises(BadInputError, match="safetensors"):
        convert(tmp_path / "ds", tmp_path / "out", dst_format="specforge", target=other,
                progress=False)  # fmt: skip


def test_export_options_that_do_not_apply_are_refused(tmp_path, model_run):
    make_dataset(tmp_path / "ds", PRE_NORM, model_run[1])
    for extra in (["--codec", "none"], ["--on-error", "skip"], ["--fp8"]):
        r = CliRunner().invoke(main, ["convert", str(tmp_path / "ds"), str(tmp_path / "out"),
                                      "--to", "specforge", "--target", str(model_run[0]),
                                      *extra])  # fmt: skip
        assert r.exit_code == 2, extra
        assert extra[0] in r.stderr and len(r.stderr.strip().splitlines()) == 1
    assert not (tmp_path / "out").exists()


def test_feature_store_adapter_delivers_what_the_files_deliver(tmp_path, model_run):
    from hsstore.interop.integrations.specforge import HsstoreFeatureStore

    store_mod = peer("specforge.runtime.data_plane.feature_store")
    loader_mod = peer("specforge.runtime.data_plane.feature_dataloader")
    eagle3 = peer("specforge.algorithms.eagle3.data")
    model_dir, run = model_run
    make_dataset(tmp_path / "ds", PRE_NORM, run)
    convert(tmp_path / "ds", tmp_path / "out", dst_format="specforge", target=model_dir,
            progress=False)  # fmt: skip
    files = read_with_specforge(tmp_path / "out")

    store = HsstoreFeatureStore(tmp_path / "ds", "run", target=model_dir)
    assert isinstance(store, store_mod.FeatureStore)
    loader = loader_mod.FeatureDataLoader(
        store, refs=store.refs(run_id="run"), batch_size=1,
        collate_fn=eagle3.build_offline_collator(),
        per_sample_transform=eagle3.build_offline_normalizer(64), drop_last=False,
    )  # fmt: skip
    batches = list(loader)
    assert len(batches) == len(run)
    for k, batch in enumerate(batches):
        assert batch.sample_ids == [f"run:{k:08d}"]
        want = eagle3.build_offline_collator()([files[k]])
        assert set(batch.tensors) >= {"target", "hidden_state", "input_ids", "loss_mask"}
        for key, value in want.items():
            if isinstance(value, torch.Tensor):
                assert bits(batch.tensors[key]) == bits(value), (k, key)

    with pytest.raises(BadInputError, match="pass --target"):
        HsstoreFeatureStore(tmp_path / "ds")


def test_adapter_refs_name_the_samples_the_readers_refs_name(tmp_path):
    """SpecForge lists an export's files sorted as text (data_0, data_1, data_10, ...): ref i of
    the adapter must be ref i of the reader, so one seed trains on one order in both paths."""
    from hsstore.interop.integrations.specforge import HsstoreFeatureStore

    reader = peer("specforge.runtime.data_plane.offline_reader")
    store_mod = peer("specforge.runtime.data_plane.feature_store")
    layers = [*PRE_NORM[:3], LayerSpec(N, final_norm=True)]
    g = torch.Generator().manual_seed(1)
    ds = hsstore.create(tmp_path / "ds", layers=layers, hidden_size=H, dtype=torch.bfloat16,
                        model={"num_hidden_layers": N})  # fmt: skip
    with ds.writer() as w:
        for k in range(12):
            t = 2 + k % 5
            ids = torch.randint(0, VOCAB, (t,), generator=g, dtype=torch.int64)
            hidden = torch.randn(t, len(layers), H, generator=g).to(torch.bfloat16)
            w.add(f"s{k}", ids, torch.ones(t, dtype=torch.int64), hidden)
        w.commit()
    convert(tmp_path / "ds", tmp_path / "out", dst_format="specforge", progress=False)

    theirs = reader.OfflineManifestReader(str(tmp_path / "out"), run_id="run").read()
    files = [int(re.search(r"data_(\d+)\.ckpt$", r.feature_store_uri).group(1)) for r in theirs]
    assert files[:4] == [0, 1, 10, 11]  # text order, so storage order would not pass
    ours = HsstoreFeatureStore(tmp_path / "ds", "run").refs(run_id="run")
    assert len(ours) == len(theirs)
    files_store = store_mod.LocalFeatureStore("files")
    store = HsstoreFeatureStore(tmp_path / "ds", "adapter")
    for mine, their in zip(ours, theirs):
        assert mine.sample_id == their.sample_id
        assert mine.metadata["file_index"] == their.metadata["file_index"]
        want, handle = files_store.get(their)
        got, own_handle = store.get(mine)
        assert set(got) == set(want)
        for key in want:
            assert bits(got[key]) == bits(want[key]), (mine.sample_id, key)
        files_store.release(handle)
        store.release(own_handle)


def test_reader_order_is_specforges_listing_across_row_groups(tmp_path, monkeypatch):
    """Past one rows_ folder the text order mixes folders too (rows_10-12 before rows_2-4);
    groups of 2 instead of 2000 show it with 13 files instead of 10003."""
    from hsstore.interop.formats import specforge

    reader = peer("specforge.runtime.data_plane.offline_reader")
    monkeypatch.setattr(specforge, "GROUP_SIZE", 2)
    n = 13
    for k in range(n):  # empty files are enough: only their names are listed
        path = tmp_path / specforge.sample_relpath(k)
        path.parent.mkdir(exist_ok=True)
        path.touch()
    assert (tmp_path / "rows_12-14" / "data_12.ckpt").exists()
    listed = reader.list_feature_files(str(tmp_path))
    order = [int(re.search(r"data_(\d+)\.ckpt$", p).group(1)) for p in listed]
    assert order[:4] == [0, 1, 10, 11]  # rows_0-2, then rows_10-12
    assert specforge.reader_order(n) == order
