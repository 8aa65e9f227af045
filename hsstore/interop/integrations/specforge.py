"""An hsstore dataset as SpecForge 0.2's offline feature store.

SpecForge's offline trainer builds ``refs = OfflineManifestReader(path).read()`` and
``store = LocalFeatureStore(run_id)`` and hands both to ``FeatureDataLoader``
(``specforge/launch.py``, ``_make_offline_eval_data_factory`` and the offline trainer setup).
Replace them with ``store = HsstoreFeatureStore(url, run_id, target=MODEL_DIR)`` and
``refs = store.refs()``; the loader, the EAGLE-3 normaliser (``algorithms/eagle3/data.py``) and
the collator are unchanged. Each sample's tensors are what ``hsstore convert --to specforge``
writes into ``data_{k}.ckpt`` (final norm applied the same way when the final state is pre-norm).
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Iterator, Sequence
from typing import Any

import torch
from specforge.runtime.contracts import SCHEMA_VERSION, FeatureHandle, SampleRef
from specforge.runtime.data_plane.feature_store import LocalFeatureStore

import hsstore
from hsstore.dataset.dataset import Dataset
from hsstore.errors import BadInputError
from hsstore.interop.formats.final_norm import load_final_norm
from hsstore.interop.formats.specforge import (
    KEYS,
    check_final_norm,
    reader_order,
    specforge_features,
    specforge_layout,
)

URI_SCHEME = "hsstore-sample://"


class HsstoreFeatureStore(LocalFeatureStore):
    """``LocalFeatureStore`` that also serves ``hsstore-sample://K`` refs from an hsstore dataset.

    Other refs (``mem://``, ``file://``) behave exactly as in the base class.
    """

    def __init__(
        self,
        dataset: str | os.PathLike | Dataset,
        store_id: str | None = None,
        *,
        target: str | os.PathLike | None = None,
        num_hidden_layers: int | None = None,
    ) -> None:
        super().__init__(store_id)
        self.ds = dataset if isinstance(dataset, Dataset) else hsstore.open(dataset)
        model = self.ds.manifest.model
        n = num_hidden_layers or (model.num_hidden_layers if model else None)
        if not n:
            raise BadInputError(
                "the dataset does not record num_hidden_layers; pass num_hidden_layers",
                path=str(dataset),
            )
        specforge_layout(self.ds.layers, int(n), str(dataset))
        norm = None
        if target is not None and not self.ds.layers[-1].final_norm:
            norm = load_final_norm(target, hidden_size=self.ds.hidden_size)
        self.norm = check_final_norm(self.ds.layers, int(n), norm, str(dataset))

    def refs(
        self, *, run_id: str = "offline", ttt_length: int = 7, max_len: int = 2048
    ) -> list[SampleRef]:
        """One ref per sample, shaped and ordered like ``OfflineManifestReader``'s over this
        dataset's export (``specforge/runtime/data_plane/offline_reader.py`` ``_ref_for``): ref
        ``i`` names the same sample in both, so one seed shuffles both into the same order."""
        lengths = self.ds.index.column("num_tokens").to_pylist()
        return [
            SampleRef(
                sample_id=f"{run_id}:{i:08d}",
                run_id=run_id,
                source_task_id=None,
                feature_store_uri=f"{URI_SCHEME}{k}",
                feature_keys={key: key for key in KEYS},
                feature_specs={},
                strategy="eagle3",
                schema_version=SCHEMA_VERSION,
                num_tokens=int(lengths[k]),
                metadata={
                    "format": "offline_eagle3",
                    "target_repr": "hidden_state",
                    "schema_version": SCHEMA_VERSION,
                    "ttt_length": ttt_length,
                    "max_len": max_len,
                    "file_index": i,
                },
            )
            for i, k in enumerate(reader_order(len(self.ds)))
        ]

    def planned_refs(
        self, batches: Iterable[Sequence[int]], **ref_options: Any
    ) -> Iterator[list[SampleRef]]:
        """The refs of each planned batch (storage positions, e.g. from
        ``PlannedBatchSampler(url, max_tokens=..., follow=True)``), in plan order: SpecForge
        then trains on the loader's plan. The dataset is reread when a batch names samples
        committed after it was opened. ``ref_options``: those of ``refs()``."""
        by_index: dict[int, SampleRef] = {}
        for batch in batches:
            if batch and max(batch) >= len(self.ds):
                self.ds.refresh()
                by_index = {}
            if not by_index:
                by_index = {_storage_position(r): r for r in self.refs(**ref_options)}
            yield [by_index[int(k)] for k in batch]

    def get(
        self,
        sample_ref: SampleRef,
        *,
        device: torch.device | str = "cpu",
        names: list[str] | None = None,
    ) -> tuple[dict[str, torch.Tensor], FeatureHandle]:
        uri = sample_ref.feature_store_uri
        if not uri.startswith(URI_SCHEME):
            return super().get(sample_ref, device=device, names=names)
        s = self.ds[_storage_position(sample_ref)]
        feats = specforge_features(s.input_ids, s.loss_mask, s.dequantized(), self.norm)
        wanted = names or list(sample_ref.feature_keys)
        tensors = {n: feats[sample_ref.feature_keys.get(n, n)].to(device) for n in wanted}
        # A lease like a file:// ref's, so release() and gc() treat it the same way
        # (feature_store.py LocalFeatureStore._register_file_lease, ~line 462).
        return tensors, self._register_file_lease(sample_ref)


def _storage_position(ref: SampleRef) -> int:
    """The dataset position an ``hsstore-sample://K`` ref names (``file_index`` is the
    position in SpecForge's reader order, which differs)."""
    return int(ref.feature_store_uri[len(URI_SCHEME) :])
