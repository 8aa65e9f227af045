"""Which device an extraction runs on and which GPUs its spawned workers see."""

from __future__ import annotations

import os
from contextlib import contextmanager

from hsstore.errors import BadInputError


def resolve_device(name: str) -> str:
    """The torch device an extraction runs on: ``--device`` checked against what is here."""
    import torch

    if name == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if name.startswith("cuda"):
        if not torch.cuda.is_available():
            raise BadInputError(f"--device {name}: CUDA is not available")
        index = name.partition(":")[2]
        if index and (not index.isdigit() or int(index) >= torch.cuda.device_count()):
            raise BadInputError(f"--device {name}: no such CUDA device")
    elif name != "cpu":
        raise BadInputError(f"--device {name!r}: use cpu, cuda, cuda:K or auto")
    return name


def visible_gpus() -> list[str]:
    """The GPUs this process may hand to its workers, as CUDA_VISIBLE_DEVICES names them."""
    import torch

    env = os.environ.get("CUDA_VISIBLE_DEVICES")
    if env:
        return [g.strip() for g in env.split(",") if g.strip()]
    return [str(i) for i in range(torch.cuda.device_count())]


@contextmanager
def environ_set(**values: str | None):
    """Set environment variables (None: leave as is) for the block, then restore them."""
    old = {k: os.environ.get(k) for k in values}
    try:
        for k, v in values.items():
            if v is not None:
                os.environ[k] = v
        yield
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
