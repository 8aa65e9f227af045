"""Seeded schedules of metadata damage: a dataset of a few commits (some of several segments,
some histories pruned by `gc --keep-versions`), then a drawn set of its metadata files deleted,
truncated or flipped on disk, then the checks:

1. locked: `hsstore.open` and `hsstore.repair` never refuse while a copy of every fact survives
   (each version's file or a commit mark of its segments, version 1 or its checkpoint);
2. silent: a view that serves fewer samples than were committed warns (`DamageWarning`);
3. lost: every sample whose index survives in one of its two copies reads back bit-exact,
   from the damaged dataset and after repair; a sample whose segment lost both copies of its
   index is dropped on record by repair, never silently;
4. damaged: after repair the dataset verifies, opens without a warning, and takes a commit.

Damage that removes every copy of a fact (outside the guarantee) is not drawn. `explore_damage`
runs many schedules into the explorer's `Results`.
"""

from __future__ import annotations

import os
import random
import shutil
import warnings
from collections.abc import Iterable
from pathlib import Path

import torch

import hsstore
from hsstore.commits.history import mark_key, read_mark
from hsstore.spec import paths
from tests.explorer import Results, make_dataset, sample

SEGMENT_SMALL = ("zarr.json", "states/zarr.json", "stats.json", "input_ids/zarr.json",
                 "loss_mask/zarr.json")  # fmt: skip
HOW = ("delete", "truncate", "flip")


def _build(location: str, rng: random.Random) -> tuple[list[str], dict[str, int]]:
    """Commits of one or more segments; returns the sample names and, per segment, the version
    that added it."""
    make_dataset(location)
    names: list[str] = []
    ds = hsstore.open(location)
    for c in range(rng.choice([2, 3, 4])):
        # A small segment_bytes cuts some commits into several segments.
        with ds.writer(encode_threads=1, segment_bytes=rng.choice([1 << 30, 600])) as w:
            for k in range(rng.choice([1, 2, 3])):
                name = f"d{c}s{k}"
                w.add(name, *sample(name))
                names.append(name)
        ds.refresh()
    if rng.random() < 0.25:
        hsstore.gc(location, keep_versions=rng.choice([1, 2]), grace_s=60)
    storage = hsstore.open(location).storage
    added = {s.id: read_mark(storage, s.id)["version"] for s in ds.manifest.segments}
    return names, added


def _metadata_files(root: Path, added: dict[str, int]) -> list[str]:
    found = [paths.ROOT_ZARR_JSON, paths.SEGMENTS_ZARR_JSON]
    found += [f"{paths.MANIFESTS}/{n}" for n in sorted(os.listdir(root / paths.MANIFESTS))]
    for seg in added:
        found += [paths.segment_file(seg, rel) for rel in (paths.INDEX, paths.INDEX_COPY)]
        found += [paths.segment_file(seg, rel) for rel in SEGMENT_SMALL]
        found.append(mark_key(seg))
    return [f for f in found if (root / f).is_file() and ".tmp" not in f]


def _beyond_redundancy(hit: set[str], root: Path, added: dict[str, int]) -> bool:
    """Whether ``hit`` takes every copy of some fact of the history."""
    versions = {paths.manifest_version(Path(f).name) for f in os.listdir(root / paths.MANIFESTS)}
    checkpoints = sorted(
        v for v in map(paths.checkpoint_version, os.listdir(root / paths.MANIFESTS)) if v
    )
    bases = [c for c in checkpoints if f"{paths.MANIFESTS}/c{c:08d}.json" not in hit]
    if not (1 in versions and paths.manifest_key(1) not in hit) and not bases:
        return True  # the dataset's description
    for v in set(added.values()):
        marks = [mark_key(s) for s, at in added.items() if at == v]
        file_ok = v in versions and paths.manifest_key(v) not in hit
        if not file_ok and all(m in hit for m in marks) and not any(c >= v for c in bases):
            return True  # what version v added
    return False


def _damage(file: Path, how: str, rng: random.Random) -> None:
    if how == "delete":
        file.unlink()
    elif how == "truncate":
        file.write_bytes(file.read_bytes()[: rng.randrange(max(1, file.stat().st_size))])
    else:
        data = bytearray(file.read_bytes())
        if data:
            data[rng.randrange(len(data))] ^= 1 << rng.randrange(8)
        file.write_bytes(bytes(data))


def run_damage_schedule(location: str, seed: int, results: Results) -> None:
    rng = random.Random(seed)
    names, added = _build(location, rng)
    root = Path(location)
    ds = hsstore.open(location)
    segment_of = dict(zip(ds.sample_ids, (ds.manifest.segments[int(i)].id for i in
                                          ds.index.column("segment").to_pylist()), strict=True))  # fmt: skip
    files = _metadata_files(root, added)
    for _ in range(20):  # a set within the guarantee
        hit = set(rng.sample(files, min(len(files), rng.choice([1, 1, 2, 3]))))
        if not _beyond_redundancy(hit, root, added):
            break
    else:
        return
    for f in sorted(hit):
        _damage(root / f, rng.choice(HOW), rng)
    results.files_damaged += len(hit)
    where = f"seed {seed} ({', '.join(sorted(hit))})"
    gone = {
        s
        for s in added
        if {paths.segment_file(s, r) for r in (paths.INDEX, paths.INDEX_COPY)} <= hit
    }
    _check_damaged(location, where, names, bool(gone), results)
    try:
        hsstore.repair(location)
    except BaseException as exc:  # noqa: BLE001 - counted
        results.locked.append(f"{where}: repair: {type(exc).__name__}: {exc}")
        return
    _check_repaired(location, where, names, segment_of, results)
    results.schedules += 1
    results.damage_schedules += 1


def _check_damaged(location: str, where: str, names: list[str], gone: bool, r: Results) -> None:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            ds = hsstore.open(location)
        except BaseException as exc:  # noqa: BLE001 - counted
            r.locked.append(f"{where}: open: {type(exc).__name__}: {exc}")
            return
    warned = any(issubclass(w.category, hsstore.DamageWarning) for w in caught)
    if len(ds) < len(names) and not warned:
        r.silent.append(f"{where}: {len(names) - len(ds)} samples left out without a warning")
    if len(ds) < len(names) and not gone:
        r.lost.append(f"{where}: {len(names) - len(ds)} samples left out with an index copy left")
    _compare(ds, where, r)


def _check_repaired(
    location: str, where: str, names: list[str], segment_of: dict[str, str], r: Results
) -> None:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        ds = hsstore.open(location)
    if any(issubclass(w.category, hsstore.DamageWarning) for w in caught):
        r.damaged.append(f"{where}: still warns after repair: {caught[0].message}")
    report = hsstore.verify(location)
    if not report.ok:
        r.damaged.append(f"{where}: verify after repair: {report.problems[:2]}")
    repairs = ds.manifest.provenance.get("repairs", [])
    dropped = {s for rep in repairs for s in rep.get("sample_ids", [])}
    # A segment dropped whole on record (its ids were in the lost index) accounts for them all.
    dropped |= {n for n, s in segment_of.items() if any(rep.get("segment") == s and
                rep["action"] == "dropped" for rep in repairs)}  # fmt: skip
    for name in sorted(set(names) - set(ds.sample_ids) - dropped):
        r.lost.append(f"{where}: {name} neither served nor recorded dropped after repair")
    _compare(ds, where, r)
    try:
        with ds.writer(encode_threads=1) as w:
            w.add("after", *sample("after"))
    except BaseException as exc:  # noqa: BLE001 - counted
        r.locked.append(f"{where}: commit after repair: {type(exc).__name__}: {exc}")


def _compare(ds: hsstore.Dataset, where: str, r: Results) -> None:
    for name in ds.sample_ids:
        ids, _, hidden = sample(name)
        try:
            s = ds.get(name)
        except hsstore.HsstoreError as exc:
            r.lost.append(f"{where}: {name}: {exc}")
            continue
        if not (torch.equal(s.hidden, hidden) and torch.equal(s.input_ids.long(), ids)):
            r.lost.append(f"{where}: {name} reads back different bytes")
        r.reads += 1


def explore_damage(locations: Iterable[str], seeds: Iterable[int]) -> Results:
    results = Results()
    for location, seed in zip(locations, seeds, strict=False):
        run_damage_schedule(location, seed, results)
        shutil.rmtree(location, ignore_errors=True)
    return results
