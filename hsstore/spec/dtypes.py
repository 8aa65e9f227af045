"""The logical dtypes of stored states, the numpy dtype each is stored as, and the per-token
columns a dataset of each dtype keeps beside its states."""

from __future__ import annotations

import numpy as np
import torch

from hsstore.errors import FormatError
from hsstore.spec import paths

# logical dtype -> (torch dtype, storage numpy dtype). bf16 is stored as uint16 bit patterns and
# fp8 as uint8 ones: zarr-python 3.1 has neither data type, and the integers keep the bits exact.
DTYPES: dict[str, tuple[torch.dtype, np.dtype]] = {
    "bfloat16": (torch.bfloat16, np.dtype("<u2")),
    "float16": (torch.float16, np.dtype("<f2")),
    "float32": (torch.float32, np.dtype("<f4")),
    "float8_e4m3fn": (torch.float8_e4m3fn, np.dtype("u1")),
}
STORAGE_DTYPE_NAMES = {
    "bfloat16": "uint16",
    "float16": "float16",
    "float32": "float32",
    "float8_e4m3fn": "uint8",
}
COLUMN_DTYPES = {"input_ids": "int32", "loss_mask": "uint8"}
# A scaled dtype stores one float32 scale per token row in this column beside the states; a
# state's value is ``stored * scale`` (hs-connectors' per-token FP8, see `hsstore.codec.fp8`).
SCALES_COLUMN = paths.SCALES
SCALED_DTYPES = frozenset({"float8_e4m3fn"})


def columns_for(dtype: str) -> dict[str, str]:
    """The per-token columns a dataset of logical dtype ``dtype`` stores."""
    columns = dict(COLUMN_DTYPES)
    if dtype in SCALED_DTYPES:
        columns[SCALES_COLUMN] = "float32"
    return columns


def dtype_name(dtype: torch.dtype | str) -> str:
    """Normalise a torch dtype or name to one of the logical dtype names."""
    if isinstance(dtype, str):
        name = dtype.removeprefix("torch.")
        name = {"bf16": "bfloat16", "fp16": "float16", "half": "float16", "fp32": "float32",
                "float": "float32", "fp8": "float8_e4m3fn"}.get(name, name)  # fmt: skip
    else:
        name = str(dtype).removeprefix("torch.")
    if name not in DTYPES:
        raise FormatError(f"unsupported dtype {dtype!r}; expected one of {sorted(DTYPES)}")
    return name


def storage_view(t: torch.Tensor) -> np.ndarray:
    """The storage-dtype numpy view of a CPU tensor (bf16 -> its uint16 bit patterns, fp8 -> its
    uint8 ones)."""
    if t.dtype == torch.bfloat16:
        return t.view(torch.int16).numpy().view("<u2")
    if t.dtype == torch.float8_e4m3fn:
        return t.view(torch.uint8).numpy()
    return t.numpy()
