"""The seeded explorer of the commit protocol (`tests.explorer`) over fixed seeds: writers, gc
and readers on threads with faults at random storage calls, writer processes killed with
SIGKILL, on a local disk, on S3, GCS and Azure Blob; and schedules of metadata damage on a
local disk (`tests.damage_explorer`). Every check must hold in every schedule:
nothing reported committed is lost, nothing reported refused is there, the dataset opens and
verifies, no hang, no error but hsstore's own or the injected fault itself. `tools/soak_commits.py` runs more.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Iterator

import pytest

from tests.damage_explorer import explore_damage
from tests.explorer import explore

# Three hundred schedules (some two thousand faults) keep the suite's share of CI's time small;
# `tools/soak_commits.py` runs thousands (HSSTORE_EXPLORER_SCHEDULES raises this one).
LOCAL_SCHEDULES = int(os.environ.get("HSSTORE_EXPLORER_SCHEDULES", "300"))
DAMAGE_SCHEDULES = int(os.environ.get("HSSTORE_EXPLORER_DAMAGE", "30"))


@pytest.fixture
def scratch(tmp_path) -> Iterator[str]:
    """Memory-backed scratch space where there is one: the schedules fsync a lot, and what
    they explore is the order of storage calls, not the disk."""
    if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK):
        path = tempfile.mkdtemp(prefix="hsstore-explore-", dir="/dev/shm")
        try:
            yield path
        finally:
            shutil.rmtree(path, ignore_errors=True)
    else:
        yield str(tmp_path)


def _assert_clean(results) -> None:
    print(results.summary())  # the figures the closing note quotes (pytest -s shows them)
    assert results.failures == 0, (
        results.summary()
        + "\n"
        + "\n".join(
            (results.lost + results.unopenable + results.silent + results.damaged)[:10]
            + results.locked[:10]
            + (results.hangs + results.raw)[:10]
        )
    )


def test_schedules_on_a_local_filesystem(scratch):
    n = LOCAL_SCHEDULES
    results = explore((os.path.join(scratch, f"d{i}") for i in range(n)), range(n))
    _assert_clean(results)
    assert results.schedules == n
    assert sum(results.faults.counts.values()) > 5 * n  # the faults were really injected
    assert results.commits_published and results.commits_refused and results.reads
    # The crowded schedules' writers commit at once: creates lose races and commits go in
    # groups (group commit's leaders, intents and recognition of tokens, under faults).
    assert results.groups > 0 and results.grouped > 0


def test_metadata_damage_schedules(scratch):
    """Metadata files deleted, truncated or flipped, one or several at once (tests.damage_explorer):
    the damage stays in the samples whose index is gone with its copy; nothing else is lost,
    nothing locked, nothing silent. `tools/soak_commits.py --damage N` runs more."""
    n = DAMAGE_SCHEDULES
    results = explore_damage((os.path.join(scratch, f"m{i}") for i in range(n)), range(n))
    _assert_clean(results)
    assert results.damage_schedules >= n * 0.9 and results.files_damaged >= n
    assert results.reads > 0


def test_schedules_with_killed_writer_processes(tmp_path):
    seeds = range(1000, 1003)
    results = explore((str(tmp_path / f"k{i}") for i in seeds), seeds, crash_every=1)
    _assert_clean(results)
    assert results.kills == 3 and results.schedules == 3


@pytest.mark.parametrize("crash", [False, True])
def test_schedules_on_s3(s3_url, crash):
    seeds = range(2000, 2003) if crash else range(2100, 2130)
    results = explore((f"{s3_url}/{i}" for i in seeds), seeds, crash_every=1 if crash else 0)
    _assert_clean(results)
    assert results.schedules == len(seeds)


@pytest.mark.parametrize("crash", [False, True])
@pytest.mark.parametrize("scheme", ["gs", "az"])
def test_schedules_on_gcs_and_azure(remote_of, scheme, crash):
    """The same schedules on fake-gcs-server and Azurite, fewer of them (CI time)."""
    url = remote_of(scheme).url
    seeds = range(2300, 2301) if crash else range(2200, 2210)
    results = explore((f"{url}/{i}" for i in seeds), seeds, crash_every=1 if crash else 0)
    _assert_clean(results)
    assert results.schedules == len(seeds)
