"""``python -m hsstore.trainers.eagle3 --data DS --steps N --out DIR``: see hsstore/trainers/eagle3/train.py."""

from hsstore.cli._common import handle_errors
from hsstore.trainers.eagle3.train import main

if __name__ == "__main__":
    # Bad input (no dataset, an unreadable target model) is one line and exit code 2, as in the CLI.
    handle_errors(main)()
