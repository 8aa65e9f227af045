"""An hsstore dataset as speculators 0.9's training dataset.

Replace ``ArrowDataset(max_len, datapath, ...)`` (``speculators/train/data.py``) with
``HsstoreArrowDataset(max_len, url, ...)`` (same arguments); everything after it (``CollateFn``, the multipack batch
sampler in ``speculators/train/dataloader.py``) is unchanged. Each item is what
``ArrowDataset._get_raw_data`` returns for the converted files: every stored layer but the last
concatenated as ``hidden_states`` [T, (L-1)*H], the last as ``verifier_last_hidden_states``.

The loader's plan drives it as a batch sampler: ``DataLoader(HsstoreArrowDataset(...),
batch_sampler=PlannedBatchSampler(url, max_tokens=..., follow=True), collate_fn=...)`` trains
on the loader's batches, elastic resume and a following first pass included (item k is
storage position k with the default split).
"""

from __future__ import annotations

import os
from typing import Any, Literal

import torch
from speculators.train.data import BaseDataset

import hsstore
from hsstore.dataset.dataset import Dataset
from hsstore.errors import BadInputError
from hsstore.interop.formats.speculators_arrow import arrow_layer_ids


class HsstoreArrowDataset(BaseDataset):
    """speculators' ``BaseDataset`` over an hsstore dataset (a path, URL or open Dataset).

    Takes ``ArrowDataset``'s arguments, so swapping the class is the whole change:
    ``train_ratio``/``split`` cut the same train/val rows as ``ArrowDataset``. Its other options
    (``transfer``, ``vllm_endpoint``, ``on_missing``, ``model``, timeouts, retries) steer how
    missing states are fetched or generated; an hsstore dataset holds every sample's states, so
    they are accepted and have nothing to do.
    """

    def __init__(
        self,
        max_len: int,
        datapath: str | os.PathLike | Dataset,
        *,
        train_ratio: float = 1.0,
        split: Literal["train", "val"] = "train",
        hidden_states_dtype: torch.dtype = torch.bfloat16,
        num_hidden_layers: int | None = None,
        **fetch_options: Any,
    ) -> None:
        ds = datapath if isinstance(datapath, Dataset) else hsstore.open(datapath)
        self.ds = ds
        model = ds.manifest.model
        n = num_hidden_layers or (model.num_hidden_layers if model else None)
        if not n:
            raise BadInputError(
                "the dataset does not record num_hidden_layers; pass num_hidden_layers",
                path=str(datapath),
            )
        self.layer_ids = arrow_layer_ids(ds.layers, int(n), str(datapath))
        # The split rule of ArrowDataset.__init__ (speculators/train/data.py, ~line 160).
        if not 0.0 < train_ratio <= 1.0:
            raise ValueError(f"train_ratio must be in (0.0, 1.0], got {train_ratio}")
        if split == "val" and train_ratio == 1.0:
            raise ValueError("train_ratio=1.0 leaves no validation split")
        split_idx = int(len(ds) * train_ratio)
        self.start, self.stop = (0, split_idx) if split == "train" else (split_idx, len(ds))
        if self.start >= self.stop:
            raise ValueError(f"{split} split is empty (dataset has {len(ds)} rows)")
        # A dataset still being extracted: the whole-set train split grows with it, so the
        # batches of a following PlannedBatchSampler can name samples committed later.
        self.grows = split == "train" and train_ratio == 1.0
        # BaseDataset.__init__ calls _compute_approx_lengths, so the dataset must be open first.
        super().__init__(max_len, hidden_states_dtype)

    def __len__(self) -> int:
        return self.stop - self.start

    def _compute_approx_lengths(self) -> list[int]:
        lengths = self.ds.index.column("num_tokens").to_pylist()[self.start : self.stop]
        return [int(v) for v in lengths]

    def _get_raw_data(self, index: int) -> dict[str, Any]:
        if self.grows and index >= len(self):
            self.stop = len(self.ds.refresh())
        if not 0 <= index < len(self):
            raise IndexError(f"index {index} out of range for {len(self)} samples")
        s = self.ds[self.start + index]
        # fp8 states dequantized as FP8Transfer does (hs_connectors/transfer.py, line 301 builds
        # it with the default bf16); other dtypes as stored, as FileTransfer returns them.
        hidden = s.dequantized()
        return {
            "hidden_states": hidden[:, :-1].flatten(1),
            "input_ids": s.input_ids,
            "verifier_last_hidden_states": hidden[:, -1],
            "loss_mask": s.loss_mask,
        }
