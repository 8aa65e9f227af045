"""Writers racing to commit to one dataset: what each commit costs in storage calls, and that
no writer's retries wait without bound. (Throughput is measured by tools/bench_commits.py.)"""

from __future__ import annotations

import json
import threading
from collections import Counter
from pathlib import Path

import torch

import hsstore
from hsstore import LayerSpec
from hsstore.commits import commit
from hsstore.spec import paths
from hsstore.storage.local_store import LocalStorage
from tools import bench_commits
from tools.bench_commits import CountingStorage, sample

WRITERS, COMMITS = 4, 4


class _Reads(CountingStorage):
    """Counts, besides the bench's classes, every read of a version file that returned bytes
    and every read of a segment's index, by key."""

    def __init__(self, inner: LocalStorage):
        super().__init__(inner)
        self.reads: Counter[str] = Counter()

    def read_bytes(self, key: str) -> bytes:
        data = super().read_bytes(key)
        self.reads[key] += 1
        return data


def test_racing_writers_publish_each_commit_once_reading_each_file_once(tmp_path):
    location = str(tmp_path / "ds")
    hsstore.create(location, layers=[LayerSpec(1), LayerSpec(2)], hidden_size=64,
                   dtype=torch.bfloat16)  # fmt: skip
    barrier = threading.Barrier(WRITERS)
    storages = [_Reads(LocalStorage(location)) for _ in range(WRITERS)]
    errors: list[BaseException] = []

    def write(w: int) -> None:
        try:
            ds = hsstore.open(storages[w])
            writer = ds.writer(encode_threads=1)
            storages[w].reads.clear()
            storages[w].counts.clear()
            barrier.wait()
            for i in range(COMMITS):
                writer.add(f"w{w}-{i}", *sample(w * 100 + i))
                published = writer.commit()
                assert ds.manifest.version == published.version  # the view moved with it
                assert f"w{w}-{i}" in ds.sample_ids
            assert len(ds) == len(ds.index)  # and holds every sample up to its version
            writer.close()
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=write, args=(w,)) for w in range(WRITERS)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not errors, errors[0]

    ds = hsstore.open(location)
    assert sorted(ds.sample_ids) == sorted(
        f"w{w}-{i}" for w in range(WRITERS) for i in range(COMMITS)
    )
    segments = {s.id for s in ds.manifest.segments}
    # Every commit is published once: alone in a version of its own, or in a group's.
    tokens = [t for d in _deltas(location) for t in (d["commit"], *d.get("group", []))]
    assert len(tokens) == len(set(tokens)) == WRITERS * COMMITS
    assert ds.manifest.version <= 1 + WRITERS * COMMITS
    won = 0
    for storage in storages:
        index_reads = {
            key.split("/")[1]: n for key, n in storage.reads.items() if key.endswith(paths.INDEX)
        }
        # The duplicate-id check reads no index (the versions' sample digests hold the ids);
        # the view reads each segment's once, as it loads a version.
        assert set(index_reads) <= segments
        assert max(index_reads.values()) == 1, index_reads
        # Catching up and judging intents read each version once.
        version_reads = [n for key, n in storage.reads.items() if key.startswith("manifests/v")]
        assert max(version_reads, default=1) == 1
        assert len(version_reads) <= ds.manifest.version - 1
        won += storage.counts["version_create"] - storage.counts["version_create_lost"]
    assert won == ds.manifest.version - 1  # one create won per version


def _deltas(location: str) -> list[dict]:
    names = sorted(p for p in (Path(location) / paths.MANIFESTS).glob("v*.json"))
    return [json.loads(p.read_bytes()) for p in names[1:]]


def test_waits_after_lost_races_spread_out_and_stay_bounded():
    """Each lost race doubles the window a writer draws its wait from, up to a cap: racing
    writers spread out (no herd), and the thousandth retry waits no longer than the tenth."""
    for losses in (1, 2, 5, 10, 100, 1000):
        window = min(commit.RETRY_CAP_S, commit.RETRY_BASE_S * 2**losses)
        waits = [commit.lost_race_wait(losses) for _ in range(400)]
        assert all(0.0 <= x <= window for x in waits)
        assert max(waits) > 0.8 * window and min(waits) < 0.2 * window  # drawn over all of it
        assert len(set(waits)) == len(waits)  # not one schedule every writer shares
    assert commit.RETRY_CAP_S <= 0.1


def test_commit_benchmark_prints_its_figures(tmp_path, capsys):
    bench_commits.main(["--backends", "local", "--writers", "1", "3", "--commits", "2",
                        "--dir", str(tmp_path)])  # fmt: skip
    out = capsys.readouterr().out.strip().splitlines()
    keys = [kv.split("=")[0] for kv in out[-1].split()]
    assert keys == ["commits_per_s_1", "commits_per_s_3", "scaling", "p99_ms_3",
                    "calls_per_commit_3"]  # fmt: skip
    figures = dict(kv.split("=") for kv in out[-1].split())
    assert all(float(v) > 0 for v in figures.values())
    assert float(figures["calls_per_commit_3"]) > 10  # a segment's files and the version
    assert any(line.strip().startswith("N= 3:") for line in out)
    assert list(tmp_path.iterdir()) == []  # scratch removed
