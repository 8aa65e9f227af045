"""The storage layer: put-if-absent (and racing creates on every backend), scatter reads,
descriptor cache under threads."""

from __future__ import annotations

import os
import threading
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest

from hsstore.storage.local_store import LocalStorage
from hsstore.storage.locations import open_storage


def test_put_if_absent_is_exclusive(tmp_path):
    store = LocalStorage(tmp_path)
    assert store.put_if_absent("m/v1.json", b"first")
    assert not store.put_if_absent("m/v1.json", b"second")
    assert store.read_bytes("m/v1.json") == b"first"
    assert not [n for n in os.listdir(tmp_path / "m") if n.startswith(".tmp-")]


@pytest.fixture(params=["local", "s3", "gs", "az"])
def location(request: pytest.FixtureRequest, tmp_path, remote_of) -> str:
    if request.param == "local":
        return str(tmp_path / "ds")
    return remote_of(request.param).url


def test_racing_creates_have_exactly_one_winner(location):
    """Writers with clients of their own create the same names at the same instant: the
    service decides, one wins each name, the others are told so (no error, no overwrite)."""
    writers, names = 6, 8
    storages = [open_storage(location) for _ in range(writers)]
    start = threading.Barrier(writers)

    def race(w: int) -> list[bool]:
        won = []
        for k in range(names):
            start.wait()  # every writer sends its create for name k together
            won.append(storages[w].put_if_absent(f"manifests/v{k:08d}.json", b"w%d" % w))
        return won

    with ThreadPoolExecutor(writers) as pool:
        results = list(pool.map(race, range(writers)))
    for k in range(names):
        winners = [w for w in range(writers) if results[w][k]]
        assert len(winners) == 1, (k, winners)
        assert storages[0].read_bytes(f"manifests/v{k:08d}.json") == b"w%d" % winners[0]


def test_ranges_a_few_bytes_apart_fill_their_buffers_and_nothing_else(tmp_path):
    """Read together (the gap goes to a junk buffer), each range lands in its own buffer."""
    store = LocalStorage(tmp_path)
    store.write_file("f", [bytes(range(256))])
    a, b = bytearray(10), bytearray(6)
    got = store.read_ranges("f", [(100, 10), (114, 6)], [memoryview(a), memoryview(b)])
    assert [len(v) for v in got] == [10, 6]
    assert bytes(a) == bytes(range(100, 110)) and bytes(b) == bytes(range(114, 120))


def test_threads_reading_more_files_than_the_descriptor_cache_holds(tmp_path):
    """Evicting a descriptor another thread is reading through must not corrupt that read."""
    store = LocalStorage(tmp_path, max_open_files=2)
    payloads = {}
    for k in range(12):
        data = np.random.default_rng(k).integers(0, 256, 1 << 16, dtype=np.uint8).tobytes()
        store.write_file(f"shard{k}", [data])
        payloads[f"shard{k}"] = data

    def read(i: int) -> bool:
        key = f"shard{i % 12}"
        out = bytearray(1 << 16)
        (got,) = store.read_ranges(key, [(0, len(out))], [memoryview(out)])
        return len(got) == len(out) and bytes(out) == payloads[key]

    with ThreadPoolExecutor(8) as pool:
        assert all(pool.map(read, range(2000)))
    store.close()
    assert not store._evicted  # every descriptor evicted in use was closed by its last reader


def test_reads_without_buffers_hand_out_each_range_until_the_next(tmp_path):
    """Without ``into`` a view holds its range's bytes until the next one is asked for, also
    with two reads open at once in one thread and after the descriptor cache evicted the file;
    a range past the end comes back short and an empty file gives an empty view."""
    store = LocalStorage(tmp_path, max_open_files=2)
    payloads = {
        f"shard{k}": np.random.default_rng(k).integers(0, 256, 5000 + k, dtype=np.uint8).tobytes()
        for k in range(4)
    }
    for key, data in payloads.items():
        store.write_file(key, [data])
    store.write_file("empty", [b""])
    ranges = [(0, 100), (4000, 1000), (10, 4990), (4990, 100)]  # the last runs past the end
    reads = {key: store.read_ranges(key, ranges) for key in payloads}  # all open at once
    for k in range(len(ranges)):
        for key, read in reads.items():  # interleaved: every read keeps its own buffer
            offset, nbytes = ranges[k]
            assert bytes(next(read)) == payloads[key][offset : offset + nbytes], (key, k)
    assert all(next(read, None) is None for read in reads.values())
    assert len(store._fds) == 2  # the first files were evicted while their reads went on
    assert [len(v) for v in store.read_ranges("empty", [(0, 0)])] == [0]
    store.close()


def test_delete_tree_skips_keys_already_gone(remote_url):
    """Azure's and GCS's bulk deletes fail on a key another process removed after this one
    listed it (S3's skip it): the tree goes all the same."""
    storage = open_storage(remote_url)
    for k in range(3):
        storage.put(f"segments/x/{k}", b"x")
    stale = list(storage.walk("segments/x"))
    storage.delete("segments/x/1")  # another gc got there first
    storage.walk = lambda prefix: iter(stale)  # the listing taken before that
    storage.delete_tree("segments/x")
    del storage.walk
    assert list(storage.walk("segments/x")) == [] and len(stale) == 3
