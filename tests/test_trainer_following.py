"""A ``--follow`` trainer counts its draft vocabulary on its first window of samples, not on
the few (or none) present when it starts (`hsstore.trainers.eagle3.following`)."""

from __future__ import annotations

import threading
import time

import pytest

import hsstore
from hsstore.trainers.eagle3.following import wait_for_samples
from hsstore.trainers.eagle3.vocab import dataset_token_counts
from tests.test_loader_follow import add_samples, new_dataset, record_finished


def test_the_vocabulary_waits_for_the_first_window(tmp_path):
    path = str(tmp_path / "ds")
    new_dataset(path)
    ds = hsstore.open(path)
    assert len(ds) == 0  # what a trainer started with the extraction sees
    writer = threading.Thread(target=lambda: (time.sleep(0.3), add_samples(path, 0, 12, 4)))
    writer.start()
    try:
        got = wait_for_samples(ds, 8, timeout_s=60, poll_s=0.02)
    finally:
        writer.join()
    assert len(got) >= 8
    counts = dataset_token_counts(got, 100)
    assert int(counts.sum()) > 0  # counted on committed samples, not on an empty dataset


def test_a_finished_extraction_smaller_than_a_window_ends_the_wait(tmp_path):
    path = str(tmp_path / "ds")
    new_dataset(path)
    add_samples(path, 0, 3, 3)
    record_finished(path)
    t0 = time.monotonic()
    assert len(wait_for_samples(hsstore.open(path), 256, timeout_s=60, poll_s=0.02)) == 3
    assert time.monotonic() - t0 < 5


def test_no_commit_within_the_timeout_is_an_error_naming_the_dataset(tmp_path):
    path = str(tmp_path / "ds")
    new_dataset(path)
    add_samples(path, 0, 2, 2)
    with pytest.raises(TimeoutError, match=r"ds: 2 samples after 0.2 s without a new commit"):
        wait_for_samples(hsstore.open(path), 8, timeout_s=0.2, poll_s=0.02)
