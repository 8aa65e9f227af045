"""pytest plugin of scripts/test_transformers_versions.sh: the run stops before any test unless
the transformers it imports is the release named in HSSTORE_TRANSFORMERS_VERSION, so a lane can
never quietly test the main environment's release instead of the one it names."""

from __future__ import annotations

import os

import pytest


def pytest_sessionstart(session):
    import transformers

    want = os.environ["HSSTORE_TRANSFORMERS_VERSION"]
    if transformers.__version__ != want:
        raise pytest.UsageError(
            f"imported transformers {transformers.__version__} from {transformers.__file__}, "
            f"not {want}"
        )


def pytest_terminal_summary(terminalreporter):
    import transformers

    where = os.path.dirname(os.path.dirname(transformers.__file__))
    terminalreporter.write_line(f"ran under transformers {transformers.__version__} from {where}")
