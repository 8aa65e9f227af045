"""Records, per process, which TP rank's capture hook was installed and which one captured: in
``$HSSTORE_LANE_RANKS/installed-<pid>.json`` (the hook's rank) and one line per forward it
captured in ``captured-<pid>.jsonl``. On PYTHONPATH for one command only; the hook runs
unchanged, this only watches it."""

import json
import os
from pathlib import Path

FOLDER = os.environ.get("HSSTORE_LANE_RANKS")


def _watch(hook_class):
    init, capture = hook_class.__init__, hook_class.capture

    def watched_init(self, config, runner, rank):
        init(self, config, runner, rank)
        record = {"pid": os.getpid(), "rank": rank}
        (Path(FOLDER) / f"installed-{os.getpid()}.json").write_text(json.dumps(record))

    def watched_capture(self, final, aux):
        with open(Path(FOLDER) / f"captured-{os.getpid()}.jsonl", "a") as f:
            f.write(json.dumps({"rank": self.rank, "rows": int(final.shape[0])}) + "\n")
        return capture(self, final, aux)

    hook_class.__init__ = watched_init
    hook_class.capture = watched_capture


if FOLDER:
    from hsstore.extractors.backends.vllm.hook import CaptureHook

    _watch(CaptureHook)
