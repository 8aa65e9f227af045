"""The sgl_kernel stand-in: it records and raises, and nothing in the lane called it.

This file sorts after the engine tests, so its last test sees the log of the whole session
(conftest.py also fails the session on any call, whatever order or selection ran).
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
from lane import LOG_ENV, STUB, stand_in_events


def test_the_stand_in_records_every_call_and_raises(tmp_path):
    log = tmp_path / "log"
    code = (
        "import sgl_kernel\n"
        "from sgl_kernel.kvcacheio import transfer_kv_all_layer\n"
        "from sgl_kernel import copy_all_layer_kv_cache_cpu\n"
        "for fn in (transfer_kv_all_layer, copy_all_layer_kv_cache_cpu):\n"
        "    try:\n"
        "        fn(1, 2)\n"
        "    except sgl_kernel.StandInCalled as exc:\n"
        "        print(exc)\n"
        "    else:\n"
        "        raise SystemExit('no error')\n"
    )
    env = {**os.environ, LOG_ENV: str(log), "PYTHONPATH": str(STUB)}
    out = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr
    assert "sgl_kernel.kvcacheio.transfer_kv_all_layer is a test stand-in" in out.stdout
    events = [line.split(" pid=")[0] for line in log.read_text().splitlines()]
    assert events == [
        "import sgl_kernel",
        "import sgl_kernel.kvcacheio",
        "call sgl_kernel.kvcacheio.transfer_kv_all_layer",
        "call sgl_kernel.copy_all_layer_kv_cache_cpu",
    ]


def test_no_kernel_of_the_stand_in_ran_during_the_lane(request):
    engine_tests = [i for i in request.session.items if i.path.name.startswith("test_engine_")]
    if not engine_tests:
        pytest.skip("no engine test in this selection")
    imports, calls = stand_in_events()
    # the engines imported the stand-in (so it is what stood in for sgl_kernel) ...
    assert any(line.startswith("import sgl_kernel pid=") for line in imports)
    assert {line.split("pid=")[1] for line in imports} - {str(os.getpid())}
    # ... and never ran any of it
    assert calls == []
