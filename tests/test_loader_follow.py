"""Elastic resume and the following loader, on real datasets written while they are read.

Every check compares sample positions: which samples each rank got, in which global batch.
A state saved at one world size resumes at another with every sample still exactly once per
epoch, and the resumed ranks get exactly the batches an uninterrupted run at the new size has
at the same global positions. A following loader sees each sample of a dataset that grows
under it exactly once in its first pass, then ordinary epochs; its windows are a function of
the version history, so a run that starts later from the same version plans the same pass.
"""

from __future__ import annotations

import multiprocessing
import subprocess
import sys
import threading
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
import torch

import hsstore
from hsstore import LayerSpec
from hsstore.commits.runs import completion, run_record
from hsstore.errors import LoaderStateError
from hsstore.loader import Loader, PlannedBatchSampler
from hsstore.loader.follow import FollowTimeoutError, ids_crc
from hsstore.loader.partition import rank_batches

ROOT = Path(__file__).resolve().parents[1]
H = 8
MAX_TOKENS = 24
JOB = {"input": "p.jsonl", "input_bytes": 1, "input_sha256": "0" * 64, "limit": None,
       "max_length": None}  # fmt: skip


def new_dataset(path):
    return hsstore.create(
        path,
        layers=[LayerSpec(depth=1), LayerSpec(depth=2)],
        hidden_size=H,
        dtype=torch.float32,
        model={"name": "t", "num_hidden_layers": 2, "hidden_size": H, "vocab_size": 100},
    )


def add_samples(path, lo: int, hi: int, commit_every: int) -> None:
    ds = hsstore.open(path)
    with ds.writer() as w:
        for i in range(lo, hi):
            t = 3 + i % 7
            hidden = torch.full((t, 2, H), float(i))
            w.add(f"s{i:04d}", torch.arange(t) % 100, torch.ones(t, dtype=torch.int64), hidden)
            if (i + 1 - lo) % commit_every == 0:
                w.commit()


def record_finished(path, shard: int = 0, shards: int = 1) -> None:
    with hsstore.open(path).writer() as w:
        w.record_run(run_record("finished", JOB, shard, shards, samples=0))


def lockstep(loaders, steps=None, epochs=None):
    """Batches of ranks run in lockstep (one step each in turn): per rank, a list of
    (epoch, global batch, repeat, samples)."""
    its = [ld.iter_epochs(epochs) for ld in loaders]
    out = [[] for _ in loaders]
    k = 0
    while steps is None or k < steps:
        got = [next(it, None) for it in its]
        if any(b is None for b in got):
            assert all(b is None for b in got), "ranks ran different numbers of steps"
            break
        for r, (ld, b) in enumerate(zip(loaders, got)):
            # add_samples gives every state of sample i the value i: the batch holds the
            # states of the samples it names (threads or worker processes alike).
            states = torch.repeat_interleave(b["sample_index"], b["lengths"]).float()
            assert torch.equal(b["hidden_states"][0, : len(states), 0], states)
            out[r].append((*ld.last_batch, tuple(b["sample_index"].tolist())))
        k += 1
    return out


def real(records, epoch):
    """Samples of the non-repeat batches of ``epoch``, over all ranks."""
    return Counter(s for rank in records for e, _g, rep, ss in rank if e == epoch and not rep
                   for s in ss)  # fmt: skip


def by_global(records, epoch):
    return {g: ss for rank in records for e, g, rep, ss in rank if e == epoch and not rep}


# --- elastic resume, fixed epochs ----------------------------------------------------------


@pytest.mark.parametrize("tail", ["uneven", "pad", "drop"])
@pytest.mark.parametrize("world", [1, 2, 3, 4])
@pytest.mark.parametrize("new_world", [1, 2, 3, 5])
def test_rank_batches_resume_at_any_world_size(tail, world, new_world):
    n = 23
    for steps in range(0, n // world + 1):
        done = [rank_batches(n, r, world, tail)[:steps] for r in range(world)]
        position = min(n, steps * world)
        rest = [rank_batches(n, r, new_world, tail, position) for r in range(new_world)]
        seen = Counter(int(g) for part in done + rest for g in part)
        if tail == "uneven":
            assert sorted(seen) == list(range(n)) and set(seen.values()) == {1}
        elif tail == "pad":
            assert sorted(seen) == list(range(n))
            assert len(rest[0]) == max(len(x) for x in rest) == min(len(x) for x in rest)
        else:
            assert all(v == 1 for v in seen.values())
            assert len({len(x) for x in rest}) <= 1


@pytest.fixture(scope="module")
def fixed(tmp_path_factory):
    path = tmp_path_factory.mktemp("fixed") / "ds"
    new_dataset(path)
    add_samples(path, 0, 40, commit_every=40)
    return path


def loaders(path, world, **opts):
    return [
        Loader(path, max_tokens=MAX_TOKENS, rank=r, world_size=world, num_threads=1, **opts)
        for r in range(world)
    ]


@pytest.mark.parametrize(("world", "new_world"), [(2, 1), (2, 3), (3, 2), (1, 4)])
def test_fixed_resume_on_another_world_size(fixed, world, new_world):
    first = loaders(fixed, world, seed=3)
    head = lockstep(first, steps=2)
    state = first[0].state_dict()
    assert state["position"] == 2 * world and state["world_size"] == world
    resumed = loaders(fixed, new_world, seed=3)
    for ld in resumed:
        ld.load_state_dict(state)
    tail = lockstep(resumed, epochs=2)
    records = [*head, *tail]
    for epoch in (0, 1):
        seen = real(records, epoch)
        assert sorted(seen) == list(range(40)) and set(seen.values()) == {1}, epoch
    # The same batches, at the same global positions, as an uninterrupted run at the new size.
    whole = lockstep(loaders(fixed, new_world, seed=3), epochs=2)
    for epoch in (0, 1):
        want, got = by_global(whole, epoch), by_global(tail, epoch)
        assert got and all(want[g] == ss for g, ss in got.items())
    for ld in first + resumed:
        ld.close()


def test_threads_resume_as_workers_on_another_world_size(fixed):
    first = loaders(fixed, 2, seed=1)
    head = lockstep(first, steps=2)
    state = first[0].state_dict()
    for ld in first:
        ld.close()
    workers = Loader(fixed, max_tokens=MAX_TOKENS, seed=1, workers=2)  # 1 rank, 2 processes
    workers.load_state_dict(state)
    rest = [b["sample_index"].tolist() for b in workers]
    workers.close()
    seen = Counter(s for rank in head for *_, ss in rank for s in ss)
    seen.update(s for b in rest for s in b)
    assert sorted(seen) == list(range(40)) and set(seen.values()) == {1}


def test_state_of_another_dataset_is_refused(fixed, tmp_path):
    other = tmp_path / "other"
    new_dataset(other)
    add_samples(other, 0, 41, commit_every=41)
    state = Loader(fixed, max_tokens=MAX_TOKENS).state_dict()
    with pytest.raises(LoaderStateError, match="another dataset"):
        Loader(other, max_tokens=MAX_TOKENS).load_state_dict(state)


# --- following ------------------------------------------------------------------------------


def follower(path, world, rank, version, **opts):
    return Loader(path, max_tokens=MAX_TOKENS, rank=rank, world_size=world, num_threads=1,
                  follow=True, follow_window=8, follow_poll_s=0.02, follow_timeout_s=30,
                  follow_from=version, seed=5, **opts)  # fmt: skip


def test_follow_sees_each_sample_once_resumes_on_any_world_size(tmp_path):
    path = tmp_path / "ds"
    new_dataset(path)
    add_samples(path, 0, 10, commit_every=5)
    start = hsstore.open(path).manifest.version
    more = threading.Event()

    def extraction():
        add_samples(path, 10, 30, commit_every=3)
        more.wait(30)
        add_samples(path, 30, 61, commit_every=4)
        record_finished(path)

    writer = threading.Thread(target=extraction)
    writer.start()
    try:
        first = [follower(path, 2, r, start) for r in range(2)]
        head = lockstep(first, steps=3)
        state = first[0].state_dict()
        for ld in first:
            ld.close()
        assert not completion(hsstore.open(path).manifest.provenance).complete
    finally:
        more.set()
    writer.join()
    assert state["follow"]["windows"] and state["epoch"] == 0 and state["position"] == 6
    # Resume at 1 rank for two steps, then at 3 ranks to the end of epoch 1.
    one = [follower(path, 1, 0, start)]
    one[0].load_state_dict(state)
    middle = lockstep(one, steps=2)
    state = one[0].state_dict()
    one[0].close()
    assert state["position"] == 8 and state["world_size"] == 1
    three = [follower(path, 3, r, start) for r in range(3)]
    for ld in three:
        ld.load_state_dict(state)
    rest = lockstep(three, epochs=2)
    records = [*head, *middle, *rest]
    for epoch in (0, 1):
        seen = real(records, epoch)
        assert sorted(seen) == list(range(61)) and set(seen.values()) == {1}, epoch
    windows = three[0].state_dict()["follow"]["windows"]
    assert len(windows) >= 4 and windows[-1][1] == 61 and three[0].state_dict()["follow"]["done"]
    # Each window's CRC, run on from the last one's, is that of all the ids up to its end.
    ids = hsstore.open(path).index.column("sample_id").to_pylist()
    assert all(crc == ids_crc(ids[:end]) for _version, end, crc in windows)
    # Planned afresh on the finished dataset from the same start version: the same windows,
    # and at 3 ranks the same batches at every global position the resumed run had.
    whole = lockstep([follower(path, 3, r, start) for r in range(3)], epochs=2)
    for epoch in (0, 1):
        want, got = by_global(whole, epoch), by_global(rest, epoch)
        assert got and all(want[g] == ss for g, ss in got.items()), epoch
    # The first pass is shuffled within windows: not storage order.
    order = [s for e, g, rep, ss in sorted(x for r in whole for x in r) if e == 0 and not rep
             for s in ss]  # fmt: skip
    assert order != sorted(order)
    for ld in three:
        ld.close()


def test_follow_with_worker_processes_sees_each_sample_once(tmp_path):
    path = tmp_path / "ds"
    new_dataset(path)
    add_samples(path, 0, 6, commit_every=6)
    start = hsstore.open(path).manifest.version
    # The extraction is another process: the loaders' workers are forked while it writes.
    code = ("import sys; from tests.test_loader_follow import add_samples, record_finished; "
            "add_samples(sys.argv[1], 6, 47, 3); record_finished(sys.argv[1])")  # fmt: skip
    writer = subprocess.Popen([sys.executable, "-c", code, str(path)], cwd=ROOT)
    try:
        first = [follower(path, 2, r, start, workers=2) for r in range(2)]
        head = lockstep(first, steps=3)
        state = first[0].state_dict()
        for ld in first:
            ld.close()
        assert multiprocessing.active_children() == []
        # Resumed on 3 ranks of 2 workers each, to the end of epoch 1 (workers over fixed data).
        three = [follower(path, 3, r, start, workers=2) for r in range(3)]
        for ld in three:
            ld.load_state_dict(state)
        rest = lockstep(three, epochs=2)
    finally:
        assert writer.wait(60) == 0
    for epoch in (0, 1):
        seen = real([*head, *rest], epoch)
        assert sorted(seen) == list(range(47)) and set(seen.values()) == {1}, epoch
    # The same batches at the same global positions as 3 ranks decoding with threads.
    whole = lockstep([follower(path, 3, r, start) for r in range(3)], epochs=2)
    for epoch in (0, 1):
        want, got = by_global(whole, epoch), by_global(rest, epoch)
        assert got and all(want[g] == ss for g, ss in got.items()), epoch
    for ld in three:
        ld.close()


def test_follow_with_spawned_workers_on_s3(s3_url):
    """Object storage starts the workers with spawn: the windows so far and the stop event
    travel pickled, and each worker reads the new versions from the store itself."""
    new_dataset(s3_url)
    add_samples(s3_url, 0, 4, commit_every=4)
    start = hsstore.open(s3_url).manifest.version
    code = ("import sys; from tests.test_loader_follow import add_samples, record_finished; "
            "add_samples(sys.argv[1], 4, 30, 5); record_finished(sys.argv[1])")  # fmt: skip
    writer = subprocess.Popen([sys.executable, "-c", code, s3_url], cwd=ROOT)
    try:
        workers = follower(s3_url, 1, 0, start, workers=2)
        got = lockstep([workers], epochs=1)
        workers.close()
    finally:
        assert writer.wait(60) == 0
    seen = real(got, 0)
    assert sorted(seen) == list(range(30)) and set(seen.values()) == {1}
    assert got == lockstep([follower(s3_url, 1, 0, start)], epochs=1)  # as threads decode it


def test_follow_until_and_sampler(tmp_path):
    path = tmp_path / "ds"
    new_dataset(path)
    add_samples(path, 0, 20, commit_every=6)
    start = hsstore.open(path).manifest.version
    writer = threading.Thread(target=add_samples, args=(path, 20, 45, 5))
    writer.start()
    sampler = PlannedBatchSampler(path, max_tokens=MAX_TOKENS, follow=True, follow_window=8,
                                  follow_until=40, follow_poll_s=0.02, follow_from=start)  # fmt: skip
    batches = list(sampler)
    writer.join()
    seen = Counter(s for b in batches for s in b)
    assert sorted(seen) == list(range(40)) and set(seen.values()) == {1}
    assert sampler.first_pass.state.done


def test_follow_times_out_without_completion(tmp_path):
    path = tmp_path / "ds"
    new_dataset(path)
    add_samples(path, 0, 6, commit_every=6)
    ld = Loader(path, max_tokens=MAX_TOKENS, follow=True, follow_poll_s=0.02,
                follow_timeout_s=0.3, num_threads=1)  # fmt: skip
    with pytest.raises(FollowTimeoutError, match="no new version"):
        list(ld)
    ld.close()


def test_follow_state_refused_by_a_fixed_loader(tmp_path):
    path = tmp_path / "ds"
    new_dataset(path)
    add_samples(path, 0, 6, commit_every=6)
    record_finished(path)
    state = Loader(path, max_tokens=MAX_TOKENS, follow=True).state_dict()
    with pytest.raises(LoaderStateError):
        Loader(path, max_tokens=MAX_TOKENS).load_state_dict(state)


# --- completion records -------------------------------------------------------------------


def test_completion_needs_every_shard_finished_and_none_restarted():
    def rec(event, shard, shards=2, job=JOB):
        return run_record(event, job, shard, shards)

    assert not completion({}).complete
    runs = [rec("started", 0), rec("started", 1), rec("finished", 0)]
    assert not completion({"runs": runs}).complete
    assert completion({"runs": runs}).pending == ["1/2 of p.jsonl"]
    runs.append(rec("finished", 1))
    assert completion({"runs": runs}).complete
    runs.append(rec("started", 1))  # a rerun of shard 1 (appending more rows, or a retry)
    assert not completion({"runs": runs}).complete
    other = {**JOB, "input": "q.jsonl", "input_sha256": "1" * 64}
    runs += [rec("finished", 1), rec("started", 0, 1, other)]
    assert not completion({"runs": runs}).complete  # a second job into the same dataset
    runs.append(rec("finished", 0, 1, other))
    assert completion({"runs": runs}).complete and completion({"runs": runs}).finished_jobs == 2
    assert not completion({"runs": [{"event": "finished"}, "junk"]}).complete


def test_run_records_survive_the_history(tmp_path):
    path = tmp_path / "ds"
    new_dataset(path)
    add_samples(path, 0, 4, commit_every=4)
    record_finished(path)
    add_samples(path, 4, 6, commit_every=2)
    for version in range(1, hsstore.open(path).manifest.version + 1):
        man = hsstore.Dataset(path, version=version).manifest
        assert completion(man.provenance).complete == (version >= 3)
    assert np.array_equal(
        hsstore.open(path).index.column("num_tokens").to_numpy()[:4], [3, 4, 5, 6]
    )


def test_version_1_state_still_resumes_at_its_world_size(fixed):
    from hsstore.loader.plan import fingerprint_v1

    ld = Loader(fixed, max_tokens=MAX_TOKENS, rank=1, world_size=2, num_threads=1)
    old = {"version": 1, "epoch": 0, "step": 1, "seed": 0,
           "fingerprint": fingerprint_v1(ld.config, ld.source.data_fingerprint, 2)}  # fmt: skip
    ld.load_state_dict(old)
    assert (ld.epoch, ld.start, ld.step, ld.position) == (0, 0, 1, 2)
    ld.close()
