"""``python -m hsstore.trainers.eagle3 --data DS --steps N --out DIR``: see hsstore/trainers/eagle3/train.py."""

import gc

from hsstore.cli._common import handle_errors
from hsstore.trainers.eagle3.train import main

if __name__ == "__main__":
    # Bad input (no dataset, an unreadable target model) is one line and exit code 2, as in the CLI.
    handle_errors(main)()
    # The run is over: its checkpoint, samples log and summary are written and closed. The
    # interpreter's teardown would now walk every object torch's imports created, a second or
    # more of garbage collection for memory the process is about to hand back; frozen objects
    # are skipped. Exit hooks still run (Python never promised finalizers at exit anyway).
    gc.freeze()
