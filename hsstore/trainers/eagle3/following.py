"""What a ``--follow`` trainer waits for before it builds its drafter.

It may start with the extraction: first the dataset must exist, then the draft vocabulary
must be counted on enough samples. Counted on the few (or none) present when the trainer
starts, the vocabulary would be the lowest token ids rather than the most frequent ones: a
drafter that can never propose most of the target's tokens, and nothing would say so. So the
trainer waits for its first window of samples (or the extraction's completion record, for a
dataset smaller than a window) and counts on those; a following run's vocabulary is thus that
of the first ``--follow-window`` samples, where a run on the finished dataset counts them all.
"""

from __future__ import annotations

import time

from hsstore.commits.runs import completion
from hsstore.dataset.dataset import Dataset
from hsstore.errors import NotADatasetError


def wait_for_dataset(path: str, timeout_s: float | None, poll_s: float = 0.2) -> Dataset:
    """The dataset at ``path``, waiting for the extraction to create it (its start-up then
    overlaps the extraction's)."""
    import torch._dynamo  # noqa: F401  (the optimizer's import, seconds of CPU: before the wait)

    import hsstore

    t0 = time.monotonic()
    while True:
        try:
            return hsstore.open(path)
        except (NotADatasetError, FileNotFoundError):
            if timeout_s is not None and time.monotonic() - t0 > timeout_s:
                raise
            time.sleep(poll_s)


def wait_for_samples(
    ds: Dataset, count: int, timeout_s: float | None, poll_s: float = 0.2
) -> Dataset:
    """``ds`` moved forward until it holds ``count`` samples or its extraction has recorded
    that it is complete; TimeoutError after ``timeout_s`` without a new commit."""
    seen, since = len(ds), time.monotonic()
    while len(ds) < count and not completion(ds.manifest.provenance).complete:
        if timeout_s is not None and time.monotonic() - since > timeout_s:
            raise TimeoutError(
                f"{ds.path}: {len(ds)} samples after {timeout_s:g} s without a new commit, "
                f"waiting for {count} to count the draft vocabulary on"
            )
        time.sleep(poll_s)
        ds.refresh()
        if len(ds) > seen:
            seen, since = len(ds), time.monotonic()
    return ds
