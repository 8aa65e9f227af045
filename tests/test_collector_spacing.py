"""The cyclic garbage collector's passes are spaced wider in hsstore's own programs (the command
line, `hsstore.tuning.space_collections`), and only there: importing hsstore leaves them alone.

Each case runs in a fresh interpreter: the setting is process-wide and lasts."""

from __future__ import annotations

import json
import subprocess
import sys

from hsstore.tuning import YOUNG_COLLECTION_SPACING

_REPORT = r"""
import gc, json, sys
given = json.loads(sys.argv[2])
if given is not None:
    gc.set_threshold(*given)
before = gc.get_threshold()
if sys.argv[1] == "import":
    import hsstore
elif sys.argv[1] == "space":
    from hsstore.tuning import space_collections
    space_collections()
    space_collections()
elif sys.argv[1] == "cli":  # the group's start runs before a subcommand parses its --help
    from hsstore.cli import main
    try:
        main(["inspect", "--help"])
    except SystemExit as exc:
        assert exc.code == 0, exc.code
print(json.dumps({"before": before, "after": gc.get_threshold()}))
"""


def _thresholds(mode: str, given: tuple[int, ...] | None = None) -> tuple[list, list]:
    out = subprocess.run(
        [sys.executable, "-c", _REPORT, mode, json.dumps(given)],
        capture_output=True,
        text=True,
        check=True,
    )
    report = json.loads(out.stdout.strip().splitlines()[-1])
    return report["before"], report["after"]


def test_importing_hsstore_leaves_the_collector_alone():
    before, after = _thresholds("import")
    assert after == before


def test_hsstore_programs_space_the_young_passes_and_keep_the_older_ratios():
    before, after = _thresholds("space")
    assert before[0] < YOUNG_COLLECTION_SPACING
    assert after == [YOUNG_COLLECTION_SPACING, *before[1:]]
    _, from_the_command_line = _thresholds("cli")
    assert from_the_command_line == after


def test_a_wider_spacing_or_a_collector_turned_off_is_left_as_it_is():
    wider = (YOUNG_COLLECTION_SPACING * 5, 7, 3)
    assert _thresholds("space", wider)[1] == list(wider)
    assert _thresholds("space", (0, 10, 10))[1] == [0, 10, 10]
