"""A writer's view after its commit: it takes the published version at once and reads the new
segments' indexes only when something needs them, each once."""

from __future__ import annotations

import pickle
from collections import Counter
from pathlib import Path

import pytest
import torch

import hsstore
from hsstore import LayerSpec
from hsstore.dataset.segment_set import DamageWarning
from hsstore.spec import paths
from hsstore.storage.local_store import LocalStorage
from tests.faults import Call, Fault, FaultyStorage, InjectedStorageFault
from tools.synthetic import random_sample

READS = ("read_bytes", "read_ranges")
THEIRS = 3  # segments another writer publishes while this view's writer fills its own


class _IndexReads(FaultyStorage):
    """The real local storage, counting the reads of each segment's index, whose next read
    can be made to fail as an unreachable storage fails (no retry gets past it)."""

    def __init__(self, location: Path):
        super().__init__(LocalStorage(str(location)), self._count)
        self.reads: Counter[str] = Counter()  # by segment id
        self.fail_next = False

    def _count(self, call: Call) -> Fault | None:
        if call.verb in READS and call.key.endswith(f"/{paths.INDEX}"):
            if self.fail_next:
                self.fail_next = False
                return Fault("fail")
            self.reads[call.key.split("/")[1]] += 1
        return None

    def _error(self, call: Call, what: str) -> Exception:
        return InjectedStorageFault(f"cannot reach the storage ({what})", path=call.key)


def _sample(seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return random_sample(5 + seed, 2, 32, seed=seed)


def _committed(tmp_path: Path) -> tuple[hsstore.Dataset, _IndexReads, hsstore.Manifest]:
    """A view whose writer commits "mine" after another writer published THEIRS segments;
    the index reads of the commit itself are left in the storage's count."""
    location = tmp_path / "ds"
    hsstore.create(location, layers=[LayerSpec(1), LayerSpec(4)], hidden_size=32,
                   dtype=torch.bfloat16)  # fmt: skip
    storage = _IndexReads(location)
    view = hsstore.open(storage)
    writer = view.writer(encode_threads=1)
    other = hsstore.open(location)
    for k in range(THEIRS):
        with other.writer(encode_threads=1) as w:
            w.add(f"o{k}", *_sample(k))
    writer.add("mine", *_sample(THEIRS))
    storage.reads.clear()
    published = writer.commit()
    writer.close()
    assert published is not None
    return view, storage, published


def test_the_view_reads_new_indexes_on_first_use_each_once(tmp_path):
    view, storage, published = _committed(tmp_path)
    theirs = {s.id for s in published.segments[:-1]}
    mine = published.segments[-1].id
    at_commit = dict(storage.reads)
    # The commit reads neither this writer's own index nor any other twice; whatever other
    # writers' indexes the writer read (its duplicate-id check) are handed to the view.
    assert mine not in at_commit and set(at_commit) <= theirs
    assert all(n == 1 for n in at_commit.values()), at_commit
    # Manifest-level facts of the new version, with no index read.
    storage.reads.clear()
    assert view.manifest.version == published.version == 2 + THEIRS
    assert view.manifest.num_samples == THEIRS + 1
    assert not storage.reads

    assert view.sample_ids == [f"o{k}" for k in range(THEIRS)] + ["mine"]
    at_first_use = dict(storage.reads)
    assert set(at_first_use) == (theirs - set(at_commit)) | {mine}
    assert all(n == 1 for n in at_first_use.values()), at_first_use

    storage.reads.clear()
    assert len(view) == THEIRS + 1 and not view.unreadable
    assert torch.equal(view.get("mine").hidden, _sample(THEIRS)[2])
    assert torch.equal(view.get("o1").hidden, _sample(1)[2])
    assert not storage.reads  # loaded once, kept


def test_a_failed_index_read_raises_at_first_use_and_the_next_use_loads(tmp_path):
    view, storage, published = _committed(tmp_path)
    storage.fail_next = True
    with pytest.raises(hsstore.StorageError, match=f"{paths.INDEX}.*cannot reach"):
        view.sample_ids  # noqa: B018 - the access is what is tested
    assert not storage.fail_next  # the fault was met
    storage.fail_next = True  # any other accessor meets it too: never the old version's samples
    with pytest.raises(hsstore.StorageError, match="cannot reach"):
        view.get("o0")
    assert view.manifest.version == published.version
    assert view.sample_ids == [f"o{k}" for k in range(THEIRS)] + ["mine"]
    assert torch.equal(view.get("mine").hidden, _sample(THEIRS)[2])


def test_damage_in_the_version_moved_to_is_said_on_first_use(tmp_path):
    view, storage, published = _committed(tmp_path)
    mine = published.segments[-1].id
    for name in (paths.INDEX, paths.INDEX_COPY):
        storage.inner.delete(paths.segment_file(mine, name))
    with pytest.warns(DamageWarning, match=f"1 of the {THEIRS + 1} committed samples"):
        assert view.sample_ids == [f"o{k}" for k in range(THEIRS)]
    assert list(view.unreadable) == [mine]


def test_refresh_and_pickling_of_a_moved_view(tmp_path):
    view, storage, published = _committed(tmp_path)
    view.refresh()  # the same version: still not read
    assert view.manifest.version == published.version
    assert published.segments[-1].id not in storage.reads
    later = hsstore.open(tmp_path / "ds")
    with later.writer(encode_threads=1) as w:
        w.add("later", *_sample(9))
    assert view.refresh().sample_ids[-1] == "later" and len(view) == THEIRS + 2

    plain = hsstore.open(tmp_path / "ds")  # pickled with its location (a test's storage is not)
    with plain.writer(encode_threads=1) as w:
        w.add("last", *_sample(10))
    copy = pickle.loads(pickle.dumps(plain))
    assert copy.manifest.version == plain.manifest.version == published.version + 2
    assert copy.sample_ids == plain.sample_ids == view.sample_ids + ["last"]
