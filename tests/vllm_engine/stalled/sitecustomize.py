"""Stalls a vLLM extraction at a known point: each worker's engine computes its first batch,
then, before the next one, the worker records which samples it holds in
``$HSSTORE_LANE_STALL/stalled-<pid>.json`` and waits in its main thread (where Ctrl-C lands as
it would in a forward) until it is interrupted or killed. A test thereby signals or kills a
worker whose first batch is committed and whose next batch is in the model. On PYTHONPATH for
one command only; the backend itself runs unchanged."""

import json
import os
import time
from pathlib import Path

FOLDER = os.environ.get("HSSTORE_LANE_STALL")
LONGEST_WAIT_S = 900  # a test that fails before it stops the run must not leave it waiting


def _stall(backend_class):
    run = backend_class.run
    calls = [0]

    def stalled(self, batch):
        calls[0] += 1
        if calls[0] > 1:
            marker = Path(FOLDER) / f"stalled-{os.getpid()}.json"
            held = {"pid": os.getpid(), "samples": [p.sample_id for p in batch]}
            marker.with_suffix(".tmp").write_text(json.dumps(held))
            marker.with_suffix(".tmp").replace(marker)  # whole when the test reads it
            time.sleep(LONGEST_WAIT_S)
        return run(self, batch)

    backend_class.run = stalled


if FOLDER:
    from hsstore.extractors.backends.vllm.backend import VLLMBackend

    _stall(VLLMBackend)
