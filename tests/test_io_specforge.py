"""SpecForge offline reader: .ckpt and .ckpt.gz, rows_* folders, aux + final layers."""

from __future__ import annotations

import pytest
import torch

from hsstore.errors import BadInputError
from hsstore.interop.formats import detect_format, open_foreign


def bits(t: torch.Tensor) -> bytes:
    return t.contiguous().view(torch.uint8).numpy().tobytes()


@pytest.mark.parametrize(("compress", "dtype"), [(False, torch.bfloat16), (True, torch.float16)])
def test_reads_aux_then_final_bit_for_bit(tmp_path, compress, dtype):
    from tools.convert_fixtures import write_specforge_dir

    lengths = [1, 5, 300, 2, 9]
    recs = write_specforge_dir(
        tmp_path / "sf", lengths, num_aux=3, hidden_size=8, dtype=dtype, compress=compress
    )
    assert detect_format(tmp_path / "sf") == "specforge"
    r = open_foreign(tmp_path / "sf", layer_ids=[28, 1, 15], num_hidden_layers=32)
    assert r.format == "specforge" and len(r) == 5 and r.dtype == dtype and r.hidden_size == 8
    # aux ids sorted (SpecForge concatenates in ascending layer order), then the final state.
    assert [(s.depth, s.final_norm, s.source_id) for s in r.layers] == [
        (2, False, 1),
        (16, False, 15),
        (29, False, 28),
        (32, True, 32),
    ]
    suffix = ".ckpt.gz" if compress else ".ckpt"
    assert r.names()[:3] == [
        f"rows_0-2/data_0{suffix}",
        f"rows_0-2/data_1{suffix}",
        f"rows_2-4/data_2{suffix}",
    ]
    assert r.sample_ids() == [f"data_{i}" for i in range(5)]
    for i, rec in enumerate(recs):
        item = r.read(i)
        t = lengths[i]
        assert item.sample_id == f"data_{i}"
        assert torch.equal(item.input_ids, rec["input_ids"]) and torch.equal(
            item.loss_mask, rec["loss_mask"]
        )
        aux = rec["aux_hidden_state"][0]
        for k in range(3):
            assert bits(item.hidden[:, k, :]) == bits(aux[:, k * 8 : (k + 1) * 8])
        assert bits(item.hidden[:, 3, :]) == bits(rec["hidden_state"][0])
        assert item.hidden.shape == (t, 4, 8)


def test_layers_must_be_given(tmp_path):
    from tools.convert_fixtures import write_specforge_dir

    write_specforge_dir(tmp_path / "sf", [3], num_aux=2)
    with pytest.raises(BadInputError, match="--layer-ids.*--num-hidden-layers"):
        open_foreign(tmp_path / "sf", layer_ids=[1, 2])


def test_aux_width_mismatch_is_bad_input(tmp_path):
    from tools.convert_fixtures import write_specforge_dir

    write_specforge_dir(tmp_path / "sf", [3, 4], num_aux=3, hidden_size=8)
    r = open_foreign(
        tmp_path / "sf", layer_ids=[1, 2], num_hidden_layers=8
    )  # says 2 aux, files hold 3
    with pytest.raises(
        BadInputError, match=r"aux_hidden_state has shape \[3, 24\], expected \[1, T, 16\]"
    ):
        r.read(0)


def test_truncated_gzip_is_bad_input(tmp_path):
    from tools.convert_fixtures import write_specforge_dir

    write_specforge_dir(tmp_path / "sf", [30, 4], num_aux=1, compress=True)
    f = tmp_path / "sf" / "rows_0-2" / "data_0.ckpt.gz"
    f.write_bytes(f.read_bytes()[:200])
    r = open_foreign(tmp_path / "sf", layer_ids=[3], num_hidden_layers=8)
    with pytest.raises(BadInputError, match="corrupt or truncated gzip") as e:
        r.read(0)
    assert e.value.path == str(f)


def test_duplicate_stems_are_refused(tmp_path):
    from tools.convert_fixtures import write_specforge_dir

    write_specforge_dir(tmp_path / "sf", [3, 3], num_aux=1, file_group_size=1)
    src = tmp_path / "sf" / "rows_0-1" / "data_0.ckpt"
    (tmp_path / "sf" / "rows_1-2" / "data_0.ckpt").write_bytes(src.read_bytes())
    with pytest.raises(BadInputError, match="two files would get sample id 'data_0'"):
        open_foreign(tmp_path / "sf", layer_ids=[3], num_hidden_layers=8)
