"""Import a peer package for an interop test, failing loudly (never skipping) when it is missing.

The peers are dev dependencies (``scripts/install.sh`` installs them with ``--no-deps``); a CI
run without them must go red with the install line, not pass by skipping the proof.
"""

from __future__ import annotations

import importlib
from types import ModuleType

import pytest

INSTALL = "pip install --no-deps speculators==0.9.0 hs-connectors==0.9.0 specforge==0.2.0"


def peer(module: str) -> ModuleType:
    try:
        return importlib.import_module(module)
    except ImportError as exc:
        pytest.fail(
            f"peer package module {module} cannot be imported ({exc}); the interop tests need "
            f"it: run scripts/install.sh or `{INSTALL}` plus the dev extra",
            pytrace=False,
        )
