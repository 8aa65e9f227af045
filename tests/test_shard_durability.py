"""A segment's full shards are made durable as they are written, so a commit waits for the disk
to take the last shard only; every file is still durable when the commit returns."""

from __future__ import annotations

from collections.abc import Iterable

import torch

import hsstore
from hsstore import LayerSpec
from hsstore.spec import paths
from hsstore.storage.locations import open_storage
from tests.faults import FaultyStorage
from tools.synthetic import random_sample

TOKENS = 50


class SyncRecorder(FaultyStorage):
    """The real storage; every sync's keys recorded, with how many commits had landed."""

    def __init__(self, inner):
        super().__init__(inner)
        self.syncs: list[tuple[int, list[str]]] = []
        self.commits = 0

    def sync(self, keys: Iterable[str]) -> None:
        keys = list(keys)
        self.syncs.append((self.commits, keys))
        super().sync(keys)


def test_full_shards_are_synced_as_written_and_not_again(tmp_path):
    path = tmp_path / "ds"
    # rows of 2 layers x 32 bf16 = 128 bytes: 16-row chunks, 64-row shards
    hsstore.create(path, layers=[LayerSpec(1), LayerSpec(2)], hidden_size=32,
                   dtype=torch.bfloat16, chunk_bytes=2048, shard_bytes=8192)  # fmt: skip
    storage = SyncRecorder(open_storage(str(path)))
    ds = hsstore.open(storage)
    samples = {f"s{i}": random_sample(TOKENS, 2, 32, seed=i) for i in range(5)}
    with ds.writer() as w:
        for sample_id, (ids, mask, hidden) in samples.items():
            w.add(sample_id, ids, mask, hidden)
        w.commit()
        storage.commits += 1

    segment = hsstore.open(path).manifest.segments[0]
    shards = [paths.shard_relpath(k) for k in range(segment.num_shards)]
    key = lambda r: paths.segment_file(segment.id, r)  # noqa: E731
    assert len(shards) >= 3 and set(shards) <= set(segment.files)
    full, last = {key(r) for r in shards[:-1]}, key(shards[-1])
    before_commit = [keys for commits, keys in storage.syncs if commits == 0]
    alone = [keys[0] for keys in before_commit if len(keys) == 1]
    # each full shard on its own as it was written; the last with the segment's other files
    # in one sync at the commit, which leaves out the shards already synced
    assert sorted(alone) == sorted(full)
    final = next(keys for keys in before_commit if last in keys)
    assert not set(final) & full
    assert {key(r) for r in segment.files} <= set(alone) | set(final)

    back = hsstore.open(path)
    for sample_id, (ids, _, hidden) in samples.items():
        got = back.get(sample_id)
        assert torch.equal(got.input_ids, ids)
        assert torch.equal(got.hidden.view(torch.int16), hidden.view(torch.int16))
