"""The vLLM lane: the real vllm 0.32.0 engine on CPU (scripts/test_vllm_lane.sh).

Collected only where vllm is importable, i.e. in the environment scripts/vllm_env.sh builds;
the main suite skips this folder without importing anything from it. The SGLang lane's helpers
(tests/sglang_engine: the tiny models, the CLI in a child process, transformers' reference)
serve this lane too.
"""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path

SGLANG_LANE = Path(__file__).resolve().parent.parent / "sglang_engine"

if importlib.util.find_spec("vllm") is None:
    collect_ignore_glob = ["*"]
else:
    sys.path.append(str(SGLANG_LANE))


def pytest_configure(config):
    if importlib.util.find_spec("vllm") is None:
        return
    # the engine's processes are children of the CLI: the settings reach them by environment
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("VLLM_NO_USAGE_STATS", "1")
