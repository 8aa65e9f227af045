"""Which path a loader's fetcher decodes on, chosen in one place (`resolve_decode_path`).

Both paths yield the same batches; they differ in which threads do the work. ``decode_path``
is a field of `hsstore.loader.options.LoaderOptions` (docs/LOADER.md).
"""

from __future__ import annotations

from hsstore.cores import usable_cores

# How a fetcher decodes (`resolve_decode_path`): "inline", every decode thread also hashes what
# it decodes and nothing runs beside them; "pipelined", a checker thread verifies a batch's
# checksums while the next one decodes and, with one decode thread, that thread only decodes
# what the producer plans and reads for it (`ChunkPipeline`); "auto", pipelined where the decode
# threads leave a core free.
DECODE_PATHS = ("auto", "inline", "pipelined")


def check_decode_path(decode_path: str) -> None:
    if decode_path not in DECODE_PATHS:
        raise ValueError(f"decode_path must be one of {DECODE_PATHS}, got {decode_path!r}")


def resolve_decode_path(decode_path: str, num_threads: int) -> str:
    """The path (`DECODE_PATHS`) a fetcher with ``num_threads`` decode threads takes:
    ``"inline"`` or ``"pipelined"`` as asked, and for ``"auto"`` pipelined exactly where the
    decode threads leave one of this process's cores free (`usable_cores`), since the threads
    beside them are then not competing with them for a core."""
    check_decode_path(decode_path)
    if decode_path != "auto":
        return decode_path
    return "pipelined" if num_threads < usable_cores() else "inline"
