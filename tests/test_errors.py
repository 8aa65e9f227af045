"""The error hierarchy docs/API.md promises: every error about data derives from HsstoreError,
and where a builtin means the same thing the error is that builtin too."""

from __future__ import annotations

import inspect
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

import hsstore
from hsstore import LayerSpec, errors
from hsstore.cli import main
from hsstore.loader import Loader
from hsstore.spec import conventions

API_DOC = Path(__file__).resolve().parents[1] / "docs" / "API.md"
ERRORS = [
    c for _, c in inspect.getmembers(errors, inspect.isclass) if c.__module__ == errors.__name__
]


def test_every_error_is_an_hsstore_error_exported_and_documented():
    doc = API_DOC.read_text()
    assert len(ERRORS) > 5
    for cls in ERRORS:
        assert issubclass(cls, errors.HsstoreError)
        assert getattr(hsstore, cls.__name__) is cls, f"hsstore.{cls.__name__} is not exported"
        assert re.search(rf"\b{cls.__name__}\b", doc), f"docs/API.md does not list {cls.__name__}"


def test_a_missing_dataset_is_not_a_dataset_and_a_missing_file(tmp_path):
    for where in (tmp_path / "missing", tmp_path / "file"):
        if where.name == "file":
            where.write_text("x")
        with pytest.raises(hsstore.NotADatasetError) as info:
            hsstore.open(where)
        assert isinstance(info.value, FileNotFoundError) and info.value.path == str(where)
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match="not an hsstore dataset"):
        hsstore.open(tmp_path / "empty")
    result = CliRunner().invoke(main, ["verify", str(tmp_path / "missing")])
    assert result.exit_code == 2
    assert result.output.strip() == f"error: {tmp_path / 'missing'}: no such file or directory"


def test_a_convention_error_is_bad_input_and_a_value_error():
    with pytest.raises(hsstore.ConventionError) as info:
        conventions.to_canonical(conventions.SPECULATORS, [9], 4)
    assert isinstance(info.value, hsstore.BadInputError) and isinstance(info.value, ValueError)
    assert conventions.ConventionError is hsstore.ConventionError
    assert "outside a model with 4 decoder layers" in str(info.value)


def test_a_loader_state_for_another_plan_has_its_own_error(tmp_path):
    ds = hsstore.create(tmp_path / "ds", layers=[LayerSpec(1)], hidden_size=8, dtype="float32")
    with ds.writer() as w:
        for k in range(3):
            w.add(f"s{k}", torch.arange(5), torch.ones(5, dtype=torch.int64), torch.ones(5, 1, 8))
    state = Loader(str(tmp_path / "ds"), max_tokens=16).state_dict()
    with pytest.raises(hsstore.LoaderStateError, match="cannot resume") as info:
        Loader(str(tmp_path / "ds"), max_tokens=32).load_state_dict(state)
    assert not isinstance(info.value, hsstore.ConflictError)
    with pytest.raises(hsstore.LoaderStateError, match="newer than this hsstore"):
        Loader(str(tmp_path / "ds"), max_tokens=16).load_state_dict({**state, "version": 99})


def test_a_cli_error_is_one_line_where_numcodecs_would_warn_on_import(tmp_path):
    # numcodecs warns on import, through a filter of its own that shows it, wherever the crc32c
    # package is found and google-crc32c is not; the CLI's one line must stay one line there.
    hide = (
        "import importlib.util, sys; real = importlib.util.find_spec;"
        "importlib.util.find_spec = lambda n, *a: None if n == 'google_crc32c' else real(n, *a);"
        "from hsstore.cli import main; main(['verify', sys.argv[1]])"
    )
    out = subprocess.run(
        [sys.executable, "-W", "default", "-c", hide, str(tmp_path / "missing")],
        capture_output=True,
        text=True,
    )
    assert out.returncode != 0
    assert len(out.stderr.strip().splitlines()) == 1, out.stderr
    assert "missing" in out.stderr
