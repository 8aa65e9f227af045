"""The JSON Schemas of the format, shipped inside the package.

The code reads them from here as package data, so an installed wheel validates exactly as the
source tree does. The top-level ``schemas/`` folder of the repository is the published copy and
the one to edit; ``make schemas`` copies it here, and ``tests/test_packaging.py`` fails if the
two differ.
"""

from __future__ import annotations

import json
from importlib import resources
from typing import Any

MANIFEST = "manifest.schema.json"
INSPECT = "inspect.schema.json"


def load(name: str) -> dict[str, Any]:
    """One schema document by file name (``MANIFEST`` or ``INSPECT``)."""
    return json.loads(resources.files(__name__).joinpath(name).read_text(encoding="utf-8"))
