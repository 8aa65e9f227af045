"""glibc keeps the HTTP client's ~1 MiB response buffers in the heap once object storage is used.

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
from hsstore.storage.heap import keep_response_buffers
tuned = None
if sys.argv[1] == "tune":
    tuned = keep_response_buffers()
elif sys.argv[1] == "storage":  # what every reader of an object store does first
    from hsstore.storage.object_store import ObjectStorage
    ObjectStorage(sys.argv[2])
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
print(json.dumps({"tuned": tuned, "faults_per_cycle": faults / 50}))
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


def test_object_storage_applies_the_setting(s3_url):
    # Opening an object store is all it takes: response-sized blocks are reused from then on.
    assert _run("storage", s3_url)["faults_per_cycle"] < 8


@pytest.mark.parametrize(
    "env", [{"HSSTORE_MALLOC_TUNING": "0"}, {"MALLOC_TRIM_THRESHOLD_": "131072"}]
)
def test_a_users_choice_is_left_alone(env):
    got = _run("tune", **env)
    assert got["tuned"] is False
    assert got["faults_per_cycle"] > 8 * 128
