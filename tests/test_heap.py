"""glibc keeps the HTTP client's ~1 MiB response buffers in the heap once hsstore's process
settings are made (`tune_process`, which the CLI and the loader call), and never before: importing
hsstore or opening an object store changes no process-wide setting.

Each case runs in a fresh interpreter: the setting is process-wide and lasts."""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys

import pytest

pytestmark = pytest.mark.skipif(
    platform.system() != "Linux" or platform.libc_ver()[0] != "glibc",
    reason="the tuning applies to glibc's malloc only",
)

# Faults per cycle of a 1 MiB block malloc'ed, written whole and freed: what a response buffer
# costs when glibc maps it afresh each time (256 pages) or reuses heap (none).
_CYCLES = r"""
import ctypes, json, resource, sys
import numcodecs.blosc
from hsstore.tuning import tune_process
tuned = None
if sys.argv[1] == "tune":
    tuned = tune_process().malloc_keeps_response_buffers
elif sys.argv[1] == "storage":  # hsstore imported and an object store opened, nothing asked
    import hsstore
    from hsstore.storage.object_store import ObjectStorage
    ObjectStorage(sys.argv[2])
elif sys.argv[1] == "loader":  # what a training process does first
    import hsstore
    from hsstore.loader import Loader
    Loader(hsstore.open(sys.argv[2]), max_tokens=64).close()
libc = ctypes.CDLL("libc.so.6")
libc.malloc.restype = ctypes.c_void_p
libc.malloc.argtypes = [ctypes.c_size_t]
libc.free.argtypes = [ctypes.c_void_p]
libc.memset.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_size_t]
def cycle():
    blocks = [libc.malloc(1 << 20) for _ in range(8)]  # several responses in flight
    for b in blocks:
        libc.memset(b, 1, 1 << 20)
    for b in blocks:
        libc.free(b)
cycle()
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(50):
    cycle()
faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before
print(json.dumps({"tuned": tuned, "faults_per_cycle": faults / 50,
                  "blosc_threads": numcodecs.blosc.use_threads}))
"""


def _run(mode: str, *args: str, **env: str) -> dict:
    clean = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_")}
    clean.pop("HSSTORE_MALLOC_TUNING", None)
    out = subprocess.run(
        [sys.executable, "-c", _CYCLES, mode, *args],
        env={**clean, **env},
        capture_output=True,
        text=True,
        check=True,
    )
    return json.loads(out.stdout)


def test_tuned_heap_reuses_response_sized_blocks():
    untouched = _run("leave")
    tuned = _run("tune")
    assert tuned["tuned"] is True
    # Without the setting every cycle maps its blocks afresh: 8 MiB of first touches.
    assert untouched["faults_per_cycle"] > 8 * 128
    assert tuned["faults_per_cycle"] < 8


def test_importing_and_opening_storage_change_no_process_setting(s3_url):
    got = _run("storage", s3_url)
    assert got["faults_per_cycle"] > 8 * 128
    assert got["blosc_threads"] is None  # numcodecs' own default


def test_the_loader_makes_the_process_settings(tmp_path):
    import torch

    import hsstore

    ds = hsstore.create(tmp_path / "ds", layers=[hsstore.LayerSpec(1)], hidden_size=8,
                        dtype="bf16", model={"num_hidden_layers": 1})  # fmt: skip
    with ds.writer() as w:
        w.add(
            "a", torch.arange(4), torch.ones(4).long(), torch.zeros(4, 1, 8, dtype=torch.bfloat16)
        )
    got = _run("loader", str(tmp_path / "ds"))
    assert got["faults_per_cycle"] < 8
    assert got["blosc_threads"] is False


@pytest.mark.parametrize(
    "env", [{"HSSTORE_MALLOC_TUNING": "0"}, {"MALLOC_TRIM_THRESHOLD_": "131072"}]
)
def test_a_users_choice_is_left_alone(env):
    got = _run("tune", **env)
    assert got["tuned"] is False
    assert got["faults_per_cycle"] > 8 * 128
