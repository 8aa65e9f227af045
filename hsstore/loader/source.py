"""The loader's view of a dataset: picklable metadata plus a lazily opened reader.

Workers must not inherit an open dataset across ``fork`` (file descriptors, locks, and, if
zarr-python were ever on the path, its event-loop thread). A ``DatasetSource`` therefore
pickles as its path and metadata only, and opens the dataset on first use in each process.
"""

from __future__ import annotations

import os
import threading
import zlib
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from hsstore import fp8
from hsstore.errors import BadInputError


def _open(path: str, verify_reads: bool) -> Any:
    import hsstore  # late: hsstore/__init__ imports the core, which imports torch etc.

    return hsstore.open(path, verify_reads=verify_reads)


def dataset_path(ds: Any) -> str:
    """The root path of an open dataset object (whatever the core calls it)."""
    for name in ("path", "root"):
        value = getattr(ds, name, None)
        if isinstance(value, (str, os.PathLike)):
            return os.fspath(value)
    storage = getattr(ds, "storage", None)
    root = getattr(storage, "root", None)
    if isinstance(root, str):
        return root
    raise BadInputError("cannot tell where this dataset lives; pass its path instead")


def _deepest(layers: list[Any]) -> int:
    """Position of the deepest stored layer (final norm wins a tie): the verifier's state."""
    keys = [
        (int(spec.depth), bool(getattr(spec, "final_norm", False)), i)
        for i, spec in enumerate(layers)
    ]
    return max(keys)[2]


@dataclass(frozen=True)
class LayerChoice:
    """Which stored layers a batch carries and how they are split into the EAGLE-3 keys.

    ``read`` lists positions in ``ds.layers`` in buffer order: the aux layers, then the
    verifier layer last when ``verifier`` is set.
    """

    aux: tuple[int, ...]
    verifier: int | None

    @property
    def read(self) -> list[int]:
        return list(self.aux) + ([self.verifier] if self.verifier is not None else [])

    @classmethod
    def resolve(
        cls, layers: list[Any], aux_layers: list[int] | None, verifier: bool
    ) -> LayerChoice:
        n = len(layers)
        deepest = _deepest(layers) if n else None
        if aux_layers is None:
            aux = [i for i in range(n) if i != deepest]
        else:
            aux = [int(i) for i in aux_layers]
            bad = [i for i in aux if not 0 <= i < n]
            if bad:
                raise BadInputError(f"aux_layers {bad} out of range: the dataset stores {n} layers")
        if not aux and not verifier:
            raise BadInputError("no layers selected (aux_layers empty and verifier=False)")
        return cls(aux=tuple(aux), verifier=deepest if verifier else None)


class DatasetSource:
    """Path + index metadata of one dataset version; opens a reader per process on demand."""

    def __init__(self, path_or_ds: Any, *, verify_reads: bool | None = None):
        """verify_reads: check every whole-sample read against its stored checksum (the core's
        default; costs a CRC pass over the bytes). None: the given dataset's setting, or True."""
        if isinstance(path_or_ds, (str, os.PathLike)):
            self.path = os.fspath(path_or_ds)
            self.verify_reads = True if verify_reads is None else verify_reads
            ds = _open(self.path, self.verify_reads)
        else:
            ds = path_or_ds
            self.path = dataset_path(ds)
            own = bool(getattr(ds, "verify_reads", True))
            self.verify_reads = own if verify_reads is None else verify_reads
        index = ds.index
        self.num_tokens = np.asarray(index.column("num_tokens").to_numpy(), dtype=np.int64)
        self.segments = np.asarray(index.column("segment").to_numpy(), dtype=np.int64)
        self.layers = list(ds.layers)
        man = ds.manifest
        self.hidden_size = int(man.hidden_size)
        # fp8 states are delivered dequantized, as speculators' trainer reads them (hsstore.fp8).
        self.dtype = fp8.DEQUANTIZED_DTYPE if man.scaled else _torch_dtype(man.dtype)
        self.data_fingerprint = _data_fingerprint(index)
        # A dataset object opened with another verify setting is reopened on first read.
        self._ds: Any = ds if self.verify_reads == getattr(ds, "verify_reads", True) else None
        self._pid = self._lock_pid = os.getpid()
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self.num_tokens)

    @property
    def ds(self) -> Any:
        """The open dataset in this process (opened here on first use after a fork/pickle)."""
        pid = os.getpid()
        if self._ds is not None and self._pid == pid:
            return self._ds
        if self._lock_pid != pid:
            # A lock inherited through fork may have been held by a parent thread: never wait
            # on it. (Two threads racing here at worst open the dataset twice.)
            self._lock, self._lock_pid = threading.Lock(), pid
        with self._lock:
            if self._ds is None or self._pid != pid:
                self._ds = _open(self.path, self.verify_reads)
                self._pid = pid
        return self._ds

    def __getstate__(self) -> dict:
        state = self.__dict__.copy()
        state["_ds"] = None
        state["_lock"] = None
        return state

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self._lock, self._lock_pid = threading.Lock(), os.getpid()

    def read_tokens(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(input_ids, loss_mask) of sample ``i`` as int64, without decoding hidden states."""
        ds = self.ds
        reader = getattr(ds, "read_tokens", None)
        if reader is not None:
            return reader(i)
        s = ds.read(i, layers=[])  # older cores: an empty layer list decodes no state
        return s.input_ids, s.loss_mask

    def read_hidden_into(self, i: int, out: torch.Tensor, layers: list[int]) -> None:
        """Decode sample ``i``'s ``layers`` into ``out`` [T, len(layers), H].

        All layers in storage order are asked for as ``layers=None``: the core then also checks
        the whole-sample checksum.
        """
        whole = layers == list(range(len(self.layers)))
        self.ds.read_hidden_into(i, out, layers=None if whole else layers)


def _torch_dtype(value: Any) -> torch.dtype:
    if isinstance(value, torch.dtype):
        return value
    name = str(value).replace("torch.", "")
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise BadInputError(f"unknown dtype {value!r}")
    return dtype


def _data_fingerprint(index: Any) -> int:
    """A checksum of the sample ids and lengths: changes whenever the sample list does."""
    ids = index.column("sample_id").to_pylist()
    crc = zlib.crc32("\x00".join(ids).encode())
    tokens = np.ascontiguousarray(index.column("num_tokens").to_numpy(), dtype="<i8")
    return zlib.crc32(tokens.tobytes(), crc)
