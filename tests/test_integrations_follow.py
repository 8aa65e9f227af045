"""The peers' adapters on the loader's plan, following a dataset while it is written.

speculators' dataset class takes a following ``PlannedBatchSampler`` as its DataLoader's
batch sampler, and SpecForge's feature store serves the refs of the same plan's batches:
both see every sample exactly once while commits land under them.
"""

from __future__ import annotations

import threading
from collections import Counter

import torch
from torch.utils.data import DataLoader

import hsstore
from hsstore import LayerSpec
from hsstore.commits.runs import run_record
from hsstore.loader import PlannedBatchSampler

H = 8
N = 4
TOTAL = 36
JOB = {"input": "p.jsonl", "input_bytes": 1, "input_sha256": "0" * 64, "limit": None,
       "max_length": None}  # fmt: skip


def grow(path, lo: int, hi: int) -> None:
    with hsstore.open(path).writer() as w:
        for i in range(lo, hi):
            t = 3 + i % 5
            w.add(f"s{i:03d}", torch.arange(t) + i, torch.ones(t, dtype=torch.int64),
                  torch.full((t, 4, H), float(i)))  # fmt: skip
            if i % 4 == 3:
                w.commit()
    if hi == TOTAL:
        with hsstore.open(path).writer() as w:
            w.record_run(run_record("finished", JOB, 0, 1, samples=TOTAL))


def growing(tmp_path, final_norm: bool):
    path = tmp_path / "ds"
    hsstore.create(
        path,
        layers=[LayerSpec(1), LayerSpec(2), LayerSpec(3), LayerSpec(N, final_norm=final_norm)],
        hidden_size=H,
        dtype=torch.float32,
        model={"name": "t", "num_hidden_layers": N, "hidden_size": H, "vocab_size": 100},
    )
    grow(path, 0, 8)
    start = hsstore.open(path).manifest.version
    writer = threading.Thread(target=grow, args=(path, 8, TOTAL))
    sampler = PlannedBatchSampler(path, max_tokens=16, follow=True, follow_window=6,
                                  follow_poll_s=0.02, follow_timeout_s=30, follow_from=start)  # fmt: skip
    return path, sampler, writer


def test_speculators_dataset_on_a_following_plan(tmp_path):
    from hsstore.interop.integrations.speculators import HsstoreArrowDataset

    path, sampler, writer = growing(tmp_path, final_norm=False)  # speculators: pre-norm
    dataset = HsstoreArrowDataset(64, path)  # opened with the first 8 samples
    planned: list[list[int]] = []

    def batches():
        for b in sampler:
            planned.append(b)
            yield b

    writer.start()
    loader = DataLoader(dataset, batch_sampler=batches(), collate_fn=lambda items: items)
    got = list(loader)
    writer.join()
    assert sum(len(b) for b in got) == TOTAL
    for positions, items in zip(planned, got, strict=True):
        for k, item in zip(positions, items, strict=True):
            assert bool((item["hidden_states"] == k).all()) and item["input_ids"][0] == k
    seen = Counter(k for b in planned for k in b)
    assert sorted(seen) == list(range(TOTAL)) and set(seen.values()) == {1}


def test_specforge_store_serves_a_following_plan(tmp_path):
    from hsstore.interop.integrations.specforge import HsstoreFeatureStore

    path, sampler, writer = growing(tmp_path, final_norm=True)  # no target norm needed
    store = HsstoreFeatureStore(path, "run")
    writer.start()
    seen: Counter = Counter()
    for refs in store.planned_refs(sampler, run_id="run"):
        for ref in refs:
            k = int(ref.feature_store_uri.removeprefix("hsstore-sample://"))
            tensors, handle = store.get(ref)
            assert int(tensors["input_ids"].reshape(-1)[0]) == k
            store.release(handle)
            seen[k] += 1
    writer.join()
    assert sorted(seen) == list(range(TOTAL)) and set(seen.values()) == {1}
