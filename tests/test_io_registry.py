"""The registry of foreign formats is the one place the CLI, detection and the refusals read."""

from __future__ import annotations

import shutil

import pytest
from click.testing import CliRunner

from hsstore.cli import main
from hsstore.errors import BadInputError
from hsstore.interop.convert import convert_to_hsstore
from hsstore.interop.formats import (
    ALL_FORMATS,
    EXPORT_FORMATS,
    FORMATS,
    detect_format,
    open_foreign,
)
from tools.convert_fixtures import write_arrow_dir, write_specforge_dir, write_v1_dir


def test_cli_choices_and_flags_come_from_the_registry():
    help_text = " ".join(CliRunner().invoke(main, ["convert", "--help"]).output.split())
    assert f"--from [{'|'.join(ALL_FORMATS)}]" in help_text
    assert f"--to [hsstore|{'|'.join(EXPORT_FORMATS)}]" in help_text
    declared = 0
    for f in FORMATS.values():
        for direction, options in (("from", f.reader_options), ("to", f.writer_options)):
            for option in options:
                declared += 1
                assert option.flag in help_text
                assert f"--{direction} {f.name}: {' '.join(option.help.split()[:3])}" in help_text
    assert declared >= 3  # --hidden-states-path, --fp8, --target at least


def test_every_format_detects_its_own_folder_and_no_other(tmp_path):
    write_v1_dir(tmp_path / "speculators-v1", [3, 4])
    write_specforge_dir(tmp_path / "specforge", [3, 4])
    write_arrow_dir(tmp_path / "speculators-arrow", [3, 4])
    assert set(FORMATS) == {"speculators-v1", "specforge", "speculators-arrow"}
    for name, f in FORMATS.items():
        assert detect_format(tmp_path / name) == name
        others = [o for o in FORMATS if o != name]
        assert all(not f.detect(tmp_path / o) for o in others), name


def test_nested_v1_files_rank_below_another_formats_markers(tmp_path):
    folder = tmp_path / "mixed"
    write_specforge_dir(folder, [3, 4])
    write_v1_dir(folder / "deeper" / "v1", [3])
    assert detect_format(folder) == "specforge"
    shutil.rmtree(folder / "rows_0-2")
    assert detect_format(folder) == "speculators-v1"  # only nested v1 files left
    write_v1_dir(folder, [3])  # v1 files at the top outrank SpecForge's
    write_specforge_dir(folder, [3, 4])
    assert detect_format(folder) == "speculators-v1"


def test_an_option_of_another_format_is_refused_in_its_owners_words(tmp_path):
    write_v1_dir(tmp_path / "v1", [3, 4], layer_ids=[1, 3])
    with pytest.raises(
        BadInputError, match="--hidden-states-path applies to speculators-arrow only"
    ):
        open_foreign(tmp_path / "v1", hidden_states_path=tmp_path)
    convert_to_hsstore(tmp_path / "v1", tmp_path / "ds", progress=False)
    cases = {
        ("speculators-v1", "--fp8"): "--fp8 applies to speculators-arrow only, not speculators-v1",
        ("speculators-arrow", "--target", str(tmp_path)): (
            "--target is used only to apply the final norm for specforge, not speculators-arrow"
        ),
    }
    for (fmt, *flags), message in cases.items():
        out = tmp_path / f"out-{fmt}"
        args = ["convert", str(tmp_path / "ds"), str(out), "--to", fmt, *flags]
        r = CliRunner().invoke(main, [*args, "--no-progress"])
        assert r.exit_code == 2 and message in r.stderr, r.output
        assert not out.exists()  # refused before anything was written
