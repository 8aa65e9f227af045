"""Real skewed clocks: gc and writers run as processes whose clocks libfaketime shifts by 150 s
(ahead and behind, against the default lease ttl of 60 s), on a local folder, S3, GCS and
Azure Blob.

gc judges every age on the storage's own clock, so neither direction matters: a live writer's
segment is kept whatever the two clocks say, a dead writer's debris still goes, the writer's
commit is published and reads back bit-exact, and the dataset opens and verifies.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest
import torch

import hsstore
from hsstore.spec import paths
from hsstore.storage.locations import open_storage
from tests.explorer import make_dataset, sample
from tests.faults import faketime_env

SKEW_S = 150.0
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# A writer: reports its clock and its segment, waits for a line on stdin, then commits
# ("crash": it never gets the line; the test kills it).
_WRITER = """
import json, sys, time
import hsstore
from tests.explorer import sample
location, names = sys.argv[1], sys.argv[2].split(",")
w = hsstore.open(location).writer(encode_threads=1)
for name in names:
    w.add(name, *sample(name))
print(json.dumps({"clock": time.time(), "segments": list(w._held)}), flush=True)
sys.stdin.readline()
published = w.commit()
print(json.dumps({"version": published.version}), flush=True)
w.close()
"""


def _env(shift: float, **extra: str) -> dict[str, str]:
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    env.update(extra)
    return faketime_env(shift, env) if shift else env


def _writer(location: str, names: list[str], shift: float, **extra: str) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-c", _WRITER, location, ",".join(names)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        env=_env(shift, **extra),
        text=True,
    )


def _ready(child: subprocess.Popen, shift: float) -> list[str]:
    """The writer's segments, once its lease and files are in; checks its clock is shifted."""
    line = child.stdout.readline()
    assert line, "the writer exited before it was ready"
    said = json.loads(line)
    assert abs(said["clock"] - time.time() - shift) < 20, "the child's clock is not shifted"
    return said["segments"]


# Both directions on a local folder and S3; one each on GCS and Azure Blob (CI time: the
# storage's clock is the same code on every object store).
CASES = [("local", SKEW_S), ("local", -SKEW_S), ("s3", SKEW_S), ("s3", -SKEW_S),
         ("gs", SKEW_S), ("az", -SKEW_S)]  # fmt: skip


@pytest.mark.parametrize(("where", "gc_shift"), CASES, ids=[f"{w}-{s:+g}s" for w, s in CASES])
def test_gc_with_a_skewed_clock_keeps_live_segments_and_removes_debris(
    where, gc_shift, tmp_path, remote_of
):
    location = str(tmp_path / "ds") if where == "local" else remote_of(where).url
    make_dataset(location)
    # The live writer's clock is off the other way: the two machines disagree by 300 s.
    live = _writer(location, ["live-0", "live-1"], -gc_shift)
    dead = _writer(location, ["dead-0"], 0.0, HSSTORE_LEASE_TTL="1")
    try:
        kept = _ready(live, -gc_shift)
        debris = _ready(dead, 0.0)
        dead.send_signal(signal.SIGKILL)  # a crashed writer: its lease lapses in 1 s
        dead.wait(30)
        time.sleep(2.5)  # past the debris's ttl and grace on the storage's clock
        gc = subprocess.run(
            [sys.executable, "-c", "from hsstore.cli import main; main()",
             "gc", location, "--grace", "1", "--json"],
            env=_env(gc_shift), capture_output=True, text=True, timeout=120,
        )  # fmt: skip
        assert gc.returncode == 0, gc.stderr
        report = json.loads(gc.stdout)
        assert report["removed_segments"] == debris
        assert set(kept) <= set(report["live_segments"])
        live.stdin.write("go\n")
        live.stdin.flush()
        out, _ = live.communicate(timeout=120)
        assert live.returncode == 0
        published = json.loads(out.splitlines()[-1])["version"]
    finally:
        for child in (live, dead):
            if child.poll() is None:
                child.kill()
                child.wait(30)
    ds = hsstore.open(location)
    assert ds.manifest.version >= published
    assert sorted(ds.sample_ids) == ["live-0", "live-1"]
    for name in ("live-0", "live-1"):
        assert torch.equal(ds.get(name).hidden, sample(name)[2])
    assert hsstore.verify(location).ok
    storage = open_storage(location)
    assert [s for s in debris if storage.exists(paths.segment_file(s, "zarr.json"))] == []
