"""Datasets on s3://, gs:// and az:// end to end, against real servers on loopback (SeaweedFS
with SigV4 on, fake-gcs-server, Azurite with Shared Key on); tests/conftest.py starts them."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
import zlib
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner, Result

import hsstore
from hsstore import LayerSpec
from hsstore.cli import main
from hsstore.commits.history import read_version
from hsstore.errors import HsstoreError, StorageError
from hsstore.interop.convert import read_lengths
from hsstore.loader import Loader
from hsstore.spec import paths
from hsstore.spec.manifest import Delta
from hsstore.storage.locations import open_storage
from hsstore.storage.object_store import ObjectStorage
from tools.convert_fixtures import write_v1_dir
from tools.ports import free_port
from tools.synthetic import random_sample

ROOT = Path(__file__).resolve().parents[1]
CLI = "from hsstore.cli import main; main()"

WRITER = textwrap.dedent(
    """
    import sys, zlib, hsstore
    from tools.synthetic import random_sample
    url, prefix, n, commit_every = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
    ds = hsstore.open(url)
    with ds.writer(segment_bytes=1 << 16, encode_threads=1) as w:
        for i in range(n):
            seed = zlib.crc32(f"{prefix}-{i}".encode()) % 1000
            w.add(f"{prefix}-{i}", *random_sample(20 + (i * 7) % 50, 2, 32, seed=seed))
            if (i + 1) % commit_every == 0:
                w.commit()
    """
)


def _make(url: str, codec: str = "blosc-zstd") -> hsstore.Dataset:
    return hsstore.create(url, layers=[LayerSpec(1), LayerSpec(4)], hidden_size=32,
                          dtype=torch.bfloat16, codec=codec, chunk_bytes=2048, shard_bytes=8192,
                          model={"name": "toy", "num_hidden_layers": 4, "hidden_size": 32})  # fmt: skip


def _sample(prefix: str, i: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    seed = zlib.crc32(f"{prefix}-{i}".encode()) % 1000
    return random_sample(20 + (i * 7) % 50, 2, 32, seed=seed)


def _cli(*args: str) -> Result:
    """The command line in this process (the environment is the test's)."""
    return CliRunner().invoke(main, list(args))


@pytest.mark.parametrize("codec", ["blosc-zstd", "none"])
def test_round_trip_is_bit_exact(remote_url, codec):
    ds = _make(remote_url, codec)
    with ds.writer(segment_bytes=1 << 15) as w:
        for i in range(40):
            w.add(f"s-{i}", *_sample("s", i))
    ds = hsstore.open(remote_url)
    assert ds.path == remote_url and len(ds.manifest.segments) > 1
    assert ds.sample_ids == [f"s-{i}" for i in range(40)]
    for i in range(40):
        ids, mask, hid = _sample("s", i)
        got = ds[i]
        assert torch.equal(got.hidden.view(torch.int16), hid.view(torch.int16))
        assert torch.equal(got.input_ids, ids.long()) and torch.equal(got.loss_mask, mask.long())
        part = ds.read(i, layers=[1]).hidden
        assert torch.equal(part.view(torch.int16), hid[:, 1:2].contiguous().view(torch.int16))
    assert hsstore.verify(remote_url).ok
    # nothing was written to a local folder named after the URL
    assert not Path("s3:").exists()


def test_big_shards_go_up_in_parts_and_read_back(remote_url, monkeypatch):
    import hsstore.storage.object_store as object_store

    monkeypatch.setattr(object_store, "MULTIPART_BYTES", 6 << 20)
    monkeypatch.setattr(object_store, "PART_BYTES", 5 << 20)
    storage = open_storage(remote_url)
    blob = os.urandom(11 << 20)
    pieces = [memoryview(blob)[k : k + (1 << 20)] for k in range(0, len(blob), 1 << 20)]
    assert storage.write_file("segments/x/states/c/0/0/0", pieces) == len(blob)
    assert storage.size("segments/x/states/c/0/0/0") == len(blob)
    (got,) = storage.read_ranges("segments/x/states/c/0/0/0", [(7 << 20, 4096)])
    assert bytes(got) == blob[7 << 20 : (7 << 20) + 4096]


def test_conditional_create_has_one_winner(remote_url):
    storage = open_storage(remote_url)
    assert storage.put_if_absent("manifests/v00000009.json", b"first")
    assert not storage.put_if_absent("manifests/v00000009.json", b"second")
    assert storage.read_bytes("manifests/v00000009.json") == b"first"


def test_four_writer_processes_into_one_dataset(remote_url):
    _make(remote_url)
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", WRITER, remote_url, f"w{k}", "12", "4"],
            cwd=ROOT,
            stderr=subprocess.PIPE,
            text=True,
        )  # fmt: skip
        for k in range(4)
    ]
    for p in procs:
        _, err = p.communicate(timeout=240)
        assert p.returncode == 0, err
    ds = hsstore.open(remote_url)
    assert sorted(ds.sample_ids) == sorted(f"w{k}-{i}" for k in range(4) for i in range(12))
    # Every commit published once: alone in a version, or in another writer's group.
    storage = open_storage(remote_url)
    tokens = []
    for v in range(2, ds.manifest.version + 1):
        delta = read_version(storage, v)
        assert isinstance(delta, Delta)
        tokens += [delta.commit, *delta.group]
    assert len(tokens) == len(set(tokens)) == 4 * 3
    assert hsstore.verify(remote_url).ok


def test_flipped_byte_in_a_stored_object_is_named_by_verify(remote_url):
    ds = _make(remote_url)
    with ds.writer() as w:
        for i in range(6):
            w.add(f"s-{i}", *_sample("s", i))
    ds = hsstore.open(remote_url)
    seg = ds.manifest.segments[0]
    key = paths.segment_file(seg.id, paths.shard_relpath(0))
    storage = open_storage(remote_url)
    data = bytearray(storage.read_bytes(key))
    data[10] ^= 0x40  # inside the first chunk, which holds sample s-0
    storage.put(key, bytes(data))
    report = hsstore.verify(remote_url)
    assert not report.ok
    assert "s-0" in report.bad_samples
    r = _cli("verify", remote_url)
    assert r.exit_code == 1 and "s-0" in r.stdout


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="needs a FIFO to hold the convert mid-run")
def test_kill_9_during_convert_then_rerun(remote_url, tmp_path):
    src = tmp_path / "v1"
    lengths = [3, 9, 1, 40, 7, 12, 5, 8]
    write_v1_dir(src, lengths, layer_ids=[1, 3], hidden_size=8)
    real5 = (src / "data_5.pt").read_bytes()
    (src / "data_5.pt").unlink()
    os.mkfifo(src / "data_5.pt")  # reading it blocks: the run commits data_0..4, then hangs
    cmd = [sys.executable, "-c", CLI, "convert", str(src), remote_url, "--commit-every", "2",
           "--no-progress"]  # fmt: skip
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        deadline = time.monotonic() + 120
        while True:
            try:
                if len(hsstore.open(remote_url)) >= 4:
                    break
            except HsstoreError:
                pass
            assert proc.poll() is None, proc.stderr.read().decode() if proc.stderr else ""
            assert time.monotonic() < deadline, "convert never committed"
            time.sleep(0.2)
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    (src / "data_5.pt").unlink()
    (src / "data_5.pt").write_bytes(real5)
    r = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    ds = hsstore.open(remote_url)
    assert ds.sample_ids == [f"data_{i}" for i in range(len(lengths))]
    assert [ds.num_tokens_of(i) for i in range(len(ds))] == lengths
    assert hsstore.verify(remote_url).ok


def test_cli_and_loader_read_remote(remote_url, tmp_path):
    ds = _make(remote_url)
    with ds.writer() as w:
        for i in range(10):
            w.add(f"s-{i}", *_sample("s", i))
    r = _cli("inspect", remote_url, "--json")
    assert r.exit_code in (0, 1), r.output
    assert '"hsstore"' in r.stdout and remote_url in r.stdout
    r = _cli("verify", remote_url)
    assert r.exit_code == 0, r.output
    out = tmp_path / "v1"
    r = _cli("convert", remote_url, str(out), "--to", "speculators-v1", "--no-progress")
    assert r.exit_code == 0, r.output
    assert read_lengths(out) == {
        str(i): hsstore.open(remote_url).num_tokens_of(i) for i in range(10)
    }
    back = torch.load(out / "data_3.pt", weights_only=True)
    assert torch.equal(back["input_ids"], _sample("s", 3)[0].long())
    loader = Loader(remote_url, max_tokens=128, seed=0, num_threads=2)
    seen = [i for b in loader for i in b["sample_index"].tolist()]
    loader.close()
    assert sorted(seen) == list(range(10))
    r = _cli("gc", remote_url, "--grace", "0", "--json")
    assert r.exit_code == 0, r.output


def test_loader_worker_processes_read_remote(remote_url):
    """Worker processes are spawned for an object store (its client does not survive fork)."""
    ds = _make(remote_url)
    with ds.writer() as w:
        for i in range(6):
            w.add(f"s-{i}", *_sample("s", i))
    loader = Loader(remote_url, max_tokens=128, seed=0, workers=2)
    seen = sorted(i for b in loader for i in b["sample_index"].tolist())
    loader.close()
    assert seen == list(range(6))


def test_local_cache_serves_the_second_epoch(remote_url, tmp_path, monkeypatch):
    ds = _make(remote_url)
    with ds.writer() as w:
        for i in range(8):
            w.add(f"s-{i}", *_sample("s", i))
    cache = tmp_path / "cache"
    storage = ObjectStorage(remote_url, cache_dir=str(cache), cache_bytes=1 << 30)
    cached = hsstore.open(storage)
    first = [cached[i].hidden for i in range(8)]
    files = [p for p in cache.rglob("*") if p.is_file()]
    assert files, "nothing was cached"
    # A local copy now answers: damage it and a later run checks it and fetches it again.
    victim = max(files, key=lambda p: p.stat().st_size)
    data = bytearray(victim.read_bytes())
    data[10] ^= 0x01
    victim.write_bytes(bytes(data))
    fresh = hsstore.open(ObjectStorage(remote_url, cache_dir=str(cache), cache_bytes=1 << 30))
    for i in range(8):
        assert torch.equal(fresh[i].hidden.view(torch.int16), first[i].view(torch.int16))
    assert victim.read_bytes() != bytes(data)
    victim.unlink()  # a missing cached file is fetched again
    again = hsstore.open(ObjectStorage(remote_url, cache_dir=str(cache), cache_bytes=1 << 30))
    for i in range(8):
        assert torch.equal(again[i].hidden.view(torch.int16), first[i].view(torch.int16))


def test_server_stopped_mid_commit_then_restarted(remote, monkeypatch):
    monkeypatch.setenv("HSSTORE_RETRY_TIMEOUT", "2")
    monkeypatch.setenv("HSSTORE_STORAGE_RETRIES", "2")
    ds = _make(remote.url)
    with ds.writer() as w:
        for i in range(4):
            w.add(f"s-{i}", *_sample("s", i))
    ds = hsstore.open(remote.url)
    w = ds.writer()
    for i in range(4, 8):
        w.add(f"s-{i}", *_sample("s", i))
    w.flush()  # the new segment is uploaded; the manifest is not
    remote.server.stop()
    try:
        with pytest.raises(StorageError):
            w.commit()
        w.close()
    finally:
        remote.server.start()
    monkeypatch.delenv("HSSTORE_RETRY_TIMEOUT")  # the normal patience again
    monkeypatch.delenv("HSSTORE_STORAGE_RETRIES")
    ds = hsstore.open(remote.url)
    assert ds.manifest.version == 2 and ds.sample_ids == [f"s-{i}" for i in range(4)]
    with ds.writer() as w:  # the rerun
        for i in range(4, 8):
            w.add(f"s-{i}", *_sample("s", i))
    assert hsstore.open(remote.url).sample_ids == [f"s-{i}" for i in range(8)]
    assert hsstore.verify(remote.url).ok


@pytest.mark.parametrize("problem", ["wrong secret", "missing bucket", "unreachable endpoint"])
def test_storage_problems_are_one_line_exit_2(remote, problem, monkeypatch, tmp_path):
    if problem == "wrong secret" and remote.secret_var is None:
        pytest.skip(f"the {remote.scheme} emulator checks no credentials")
    _make(remote.url)
    env = {**os.environ, **remote.server.env(), "HSSTORE_RETRY_TIMEOUT": "2",
           "HSSTORE_STORAGE_RETRIES": "1"}  # fmt: skip
    url = remote.url
    expect = {"wrong secret": "access denied",
              "missing bucket": f"{remote.bucket_word} does not exist",
              "unreachable endpoint": "cannot reach the storage endpoint"}[problem]  # fmt: skip
    secret = remote.server.env().get(remote.secret_var or "", "")
    if problem == "wrong secret":
        # a well-formed key that is not the server's (Azure keys are base64)
        env[remote.secret_var] = "bm90LXRoZS1zZWNyZXQ="
    elif problem == "missing bucket":
        url = remote.url.replace("://hsstore/", "://no-such-bucket/")
    else:
        env[remote.endpoint_var] = f"http://127.0.0.1:{free_port()}"
    # One real process (the installed entry point's behaviour), the other commands in process.
    r = subprocess.run([sys.executable, "-c", CLI, "inspect", url], cwd=ROOT, env=env,
                       capture_output=True, text=True, timeout=120)  # fmt: skip
    results = [(r.returncode, r.stderr)]
    for name, value in env.items():
        if name.startswith(("AWS_", "GOOGLE_", "AZURE_", "AZURITE_", "HSSTORE_")):
            monkeypatch.setenv(name, value)
    for args in (
        ["verify", url],
        ["gc", url],
        ["convert", url, str(tmp_path / "out"), "--no-progress"],
    ):
        got = _cli(*args)
        results.append((got.exit_code, got.stderr))
    for code, stderr in results:
        assert code == 2, stderr
        lines = stderr.strip().splitlines()
        assert len(lines) == 1 and "Traceback" not in stderr, stderr
        assert expect in lines[0] and url.split("/")[2] in lines[0], lines[0]
        assert "bm90LXRoZS1zZWNyZXQ=" not in stderr and (not secret or secret not in stderr)


def test_unknown_scheme_is_refused(tmp_path):
    from click.testing import CliRunner

    from hsstore.cli import main

    result = CliRunner().invoke(main, ["verify", "ftp://host/ds"])
    assert result.exit_code == 2 and "unsupported storage URL scheme" in result.output
    assert not Path("ftp:").exists()
