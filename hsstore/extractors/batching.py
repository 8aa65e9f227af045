"""Which samples a worker owns, and how they are cut into batches.

Both are pure functions of the input and the run shape (workers, shards, batch limits), never
of what is already committed. That is what makes a resumed run bit-identical to an
uninterrupted one: a sample is always computed in the same padded batch, next to the same
neighbours, so the same kernels see the same shapes. A resumed run recomputes a batch that was
only partly committed and stores just the missing samples.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from hsstore.extractors.chat_tokens import TokenizedPrompt

# Batches are formed inside windows of this many batches' worth of samples, sorted by length,
# so padding stays small without reading the whole input first.
WINDOW_BATCHES = 16


def parse_shard(text: str | None) -> tuple[int, int]:
    """``"i/N"`` -> (i, N) with 0 <= i < N; None -> (0, 1)."""
    if text is None:
        return 0, 1
    try:
        i_str, n_str = text.split("/")
        i, n = int(i_str), int(n_str)
    except ValueError:
        raise ValueError(f"--shard must look like i/N (e.g. 0/4), got {text!r}") from None
    if n < 1 or not 0 <= i < n:
        raise ValueError(f"--shard {text!r}: need 0 <= i < N")
    return i, n


def owner(row_index: int, *, world: int) -> int:
    """The global rank (shard * workers + worker) that owns an input row."""
    return row_index % world


def plan_batches(
    samples: Sequence[TokenizedPrompt], *, batch_size: int, max_batch_tokens: int
) -> list[list[TokenizedPrompt]]:
    """Cut ``samples`` (in input order) into batches.

    A batch holds at most ``batch_size`` samples and at most ``max_batch_tokens`` padded tokens
    (samples x longest), except that one sample longer than the budget runs alone.
    """
    if batch_size < 1 or max_batch_tokens < 1:
        raise ValueError("batch_size and max_batch_tokens must be >= 1")
    window = batch_size * WINDOW_BATCHES
    batches: list[list[TokenizedPrompt]] = []
    for start in range(0, len(samples), window):
        chunk = sorted(samples[start : start + window], key=lambda p: (-p.num_tokens, p.index))
        batches.extend(_greedy(chunk, batch_size, max_batch_tokens))
    return batches


def _greedy(
    chunk: Iterable[TokenizedPrompt], batch_size: int, max_batch_tokens: int
) -> list[list[TokenizedPrompt]]:
    out: list[list[TokenizedPrompt]] = []
    current: list[TokenizedPrompt] = []
    longest = 0
    for p in chunk:
        t = max(longest, p.num_tokens)
        if current and (len(current) >= batch_size or t * (len(current) + 1) > max_batch_tokens):
            out.append(current)
            current, t = [], p.num_tokens
        current.append(p)
        longest = t
    if current:
        out.append(current)
    return out
