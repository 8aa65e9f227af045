"""An hsstore dataset as speculators 0.9's training dataset.

Replace ``ArrowDataset(max_len, datapath, ...)`` (``speculators/train/data.py``) with
``HsstoreArrowDataset(max_len, url)``; everything after it (``CollateFn``, the multipack batch
sampler in ``speculators/train/dataloader.py``) is unchanged. Each item is what
``ArrowDataset._get_raw_data`` returns for the converted files: every stored layer but the last
concatenated as ``hidden_states`` [T, (L-1)*H], the last as ``verifier_last_hidden_states``.
"""

from __future__ import annotations

import os
from typing import Any

import torch
from speculators.train.data import BaseDataset

import hsstore
from hsstore.dataset import Dataset
from hsstore.errors import BadInputError
from hsstore.io.speculators_arrow import arrow_layer_ids


class HsstoreArrowDataset(BaseDataset):
    """speculators' ``BaseDataset`` over an hsstore dataset (a path, URL or open Dataset)."""

    def __init__(
        self,
        max_len: int,
        dataset: str | os.PathLike | Dataset,
        *,
        hidden_states_dtype: torch.dtype = torch.bfloat16,
        num_hidden_layers: int | None = None,
    ) -> None:
        self.ds = dataset if isinstance(dataset, Dataset) else hsstore.open(dataset)
        model = self.ds.manifest.model
        n = num_hidden_layers or (model.num_hidden_layers if model else None)
        if not n:
            raise BadInputError(
                "the dataset does not record num_hidden_layers; pass num_hidden_layers",
                path=str(dataset),
            )
        self.layer_ids = arrow_layer_ids(self.ds.layers, int(n), str(dataset))
        # BaseDataset.__init__ calls _compute_approx_lengths, so the dataset must be open first.
        super().__init__(max_len, hidden_states_dtype)

    def __len__(self) -> int:
        return len(self.ds)

    def _compute_approx_lengths(self) -> list[int]:
        return [int(v) for v in self.ds.index.column("num_tokens").to_pylist()]

    def _get_raw_data(self, index: int) -> dict[str, Any]:
        s = self.ds[index]
        return {
            "hidden_states": s.hidden[:, :-1].flatten(1),
            "input_ids": s.input_ids,
            "verifier_last_hidden_states": s.hidden[:, -1],
            "loss_mask": s.loss_mask,
        }
