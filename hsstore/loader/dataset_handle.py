"""The loader's handle on a dataset: picklable metadata plus a reader opened per process.

Workers must not inherit an open dataset across ``fork`` (file descriptors, an object-store
client's runtime, locks). A ``DatasetSource`` therefore pickles as its location (a path, or the
`Storage` of a URL, which pickles as its URL and cache settings) and metadata only, and opens
the dataset on first use in each process.
"""

from __future__ import annotations

import os
import threading
import zlib
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import numpy as np
import pyarrow as pa
import torch

from hsstore.codec import fp8, tiers
from hsstore.dataset import batch_reads
from hsstore.dataset.dataset import Dataset
from hsstore.dataset.dataset import open as open_dataset
from hsstore.errors import BadInputError
from hsstore.segment.rows import PlannedRead
from hsstore.spec import paths
from hsstore.spec.layers import LayerSpec, verifier_position
from hsstore.spec.manifest import Manifest
from hsstore.storage.store import Storage


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
        cls, layers: list[LayerSpec], aux_layers: list[int] | None, verifier: bool
    ) -> LayerChoice:
        n = len(layers)
        deepest = verifier_position(layers) if n else None
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
    """Location + index metadata of one dataset version; opens a reader per process on demand."""

    def __init__(
        self,
        dataset: str | os.PathLike[str] | Storage | Dataset,
        *,
        verify_reads: bool | None = None,
    ):
        """dataset: a path, a URL (s3://, gs://, az://, file://), a Storage or an open Dataset.

        verify_reads: check every whole-sample read against its stored checksum (the core's
        default; costs an XXH3-64 pass over the bytes). None: the given dataset's setting, or
        True."""
        if isinstance(dataset, Dataset):
            ds = dataset
            self.verify_reads = ds.verify_reads if verify_reads is None else verify_reads
        else:
            self.verify_reads = True if verify_reads is None else verify_reads
            ds = open_dataset(dataset, verify_reads=self.verify_reads)
        # Reopened from its storage in another process (a URL's cache settings travel along).
        self.location: Storage = ds.storage
        self.path = ds.path
        index = ds.index
        self.num_tokens = np.asarray(index.column("num_tokens").to_numpy(), dtype=np.int64)
        self.segments = np.asarray(index.column("segment").to_numpy(), dtype=np.int64)
        self.layers = list(ds.layers)
        self._all_layers = list(range(len(self.layers)))
        man = ds.manifest
        self.hidden_size = man.hidden_size
        # fp8 states are delivered dequantized, as speculators' trainer reads them (hsstore.codec.fp8).
        self.dtype = fp8.DEQUANTIZED_DTYPE if man.scaled else man.torch_dtype
        self.stored_dtype = man.torch_dtype
        self.tier = man.tier
        self.compressed = man.codec.compressed
        self.data_fingerprint = _data_fingerprint(index)
        self.dataset_id = man.dataset_id
        # A dataset object opened with another verify setting is reopened on first read.
        self._ds: Dataset | None = ds if self.verify_reads == ds.verify_reads else None
        self._pid = self._lock_pid = os.getpid()
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self.num_tokens)

    def grow(self, manifest: Manifest) -> None:
        """Move to ``manifest``, a later version of this dataset (a followed dataset's new
        samples). Positions are stable: a version only appends, so batches planned on the
        old arrays read the same samples."""
        ds = self.ds
        ds.refresh(to=manifest)
        index = ds.index
        self.num_tokens = np.asarray(index.column("num_tokens").to_numpy(), dtype=np.int64)
        self.segments = np.asarray(index.column("segment").to_numpy(), dtype=np.int64)

    def ensure(self, n: int) -> None:
        """Make the first ``n`` positions known and readable in this process (a process that
        opened a followed dataset before the samples it is asked for were committed)."""
        if len(self) < n:
            self.grow(self.ds.refresh().manifest)

    @property
    def ds(self) -> Dataset:
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
                self._ds = open_dataset(self.location, verify_reads=self.verify_reads)
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
        return self.ds.read_tokens(i)

    def read_tokens_many(
        self, positions: np.ndarray, takes: np.ndarray
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(input_ids, loss_mask) of the first ``takes[k]`` tokens of every sample
        ``positions[k]``, back to back, as int64 (a batch's token columns in one call)."""
        return self.ds.read_tokens_many(positions, takes)

    def scales_width(self, layers: list[int]) -> int | None:
        """Scales per token of a read of ``layers``: None unscaled, 1 per token, or one per
        layer read."""
        if self.tier is None or not self.tier.scaled:
            return None
        return tiers.scales_width(self.tier, len(layers)) or 1

    def read_scales_many(
        self, positions: np.ndarray, takes: np.ndarray, layers: list[int]
    ) -> torch.Tensor:
        """The float32 scales ``[tokens, scales_width(layers)]`` of the tokens
        `read_tokens_many` takes, back to back (per-layer scales of ``layers`` only)."""
        (scales,) = self.ds.read_columns_many(positions, takes, (paths.SCALES,))
        picked = tiers.scales_for_layers(scales, None if layers == self._all_layers else layers)
        return torch.from_numpy(np.ascontiguousarray(picked).reshape(len(scales), -1))

    def will_read(self, positions: np.ndarray, layers: list[int]) -> None:
        """The samples of a batch about to be decoded (`Dataset.will_read`)."""
        whole = layers == self._all_layers
        self.ds.will_read(positions, layers=None if whole else layers)

    def read_hidden_into(self, i: int, out: torch.Tensor, layers: list[int]) -> None:
        """Decode sample ``i``'s ``layers`` into ``out`` [T, len(layers), H].

        All layers in storage order are asked for as ``layers=None``: the core then also checks
        the whole-sample checksum.
        """
        whole = layers == self._all_layers
        self.ds.read_hidden_into(i, out, layers=None if whole else layers)

    def read_hidden_many_into(
        self,
        out: torch.Tensor,
        placed: Iterable[tuple[int, int]],
        layers: list[int],
        unchecked: list[tuple[int, int]] | None = None,
        runs_to: Callable[[PlannedRead], None] | None = None,
    ) -> int:
        """Decode whole samples into token rows of ``out`` [R, len(layers), H]: sample ``i``
        at ``out[row:]`` for every ``(i, row)`` drawn from ``placed``, their checksums left
        to `check_decoded` when ``unchecked`` is given, their compressed chunks decoded and
        their uncompressed rows read by ``runs_to`` when it is
        (`hsstore.dataset.batch_reads.read_hidden_many_into`)."""
        whole = layers == self._all_layers
        return batch_reads.read_hidden_many_into(
            self.ds,
            out,
            placed,
            layers=None if whole else layers,
            unchecked=unchecked,
            runs_to=runs_to,
        )

    def check_decoded(self, out: torch.Tensor, unchecked: list[tuple[int, int]]) -> None:
        """Verify the checksums `read_hidden_many_into` left
        (`hsstore.dataset.batch_reads.check_decoded`)."""
        batch_reads.check_decoded(self.ds, out, unchecked)


def _data_fingerprint(index: pa.Table) -> int:
    """A checksum of the sample ids and lengths: changes whenever the sample list does."""
    ids = index.column("sample_id").to_pylist()
    crc = zlib.crc32("\x00".join(ids).encode())
    tokens = np.ascontiguousarray(index.column("num_tokens").to_numpy(), dtype="<i8")
    return zlib.crc32(tokens.tobytes(), crc)
