"""What extraction needs beyond hsstore's own dependencies: the ``extract`` extra.

A wheel installed without it has no transformers (nor tokenizers), and the first import deep in
a worker would end in a traceback; the commands that run a model check here first instead.
"""

from __future__ import annotations

import importlib

from hsstore.errors import MissingExtraError

INSTALL = "pip install 'hsstore[extract]'"
MODULES = ("transformers", "tokenizers")


def require_extract_extra(what: str) -> None:
    """Raise :class:`MissingExtraError` naming :data:`INSTALL` unless the extra's modules import."""
    for module in MODULES:
        try:
            importlib.import_module(module)
        except ModuleNotFoundError as exc:
            missing = exc.name or module
            raise MissingExtraError(
                f"{what} needs {missing}, which is not installed: {INSTALL}"
            ) from exc
