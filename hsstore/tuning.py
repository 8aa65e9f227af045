"""The process-wide settings hsstore makes for the processes it runs, made only when asked.

Importing hsstore changes nothing outside hsstore. The command line (`hsstore.cli.main`) and
the loader (`hsstore.loader.Loader`) call `tune_process` first thing; a program that reads
through `Dataset` or `ObjectStorage` alone calls it itself if it wants the same behaviour
(docs/API.md, "Process settings").
"""

from __future__ import annotations

import gc
from dataclasses import dataclass

from hsstore.codec.codecs import single_threaded_blosc
from hsstore.storage.heap import keep_response_buffers


@dataclass(frozen=True)
class ProcessTuning:
    """What `tune_process` set: c-blosc works on its caller's thread only (always), and
    whether glibc's malloc keeps response-sized blocks (see `hsstore.storage.heap`)."""

    blosc_single_threaded: bool
    malloc_keeps_response_buffers: bool


def tune_process() -> ProcessTuning:
    """Make hsstore's process-wide settings; idempotent, cheap after the first call.

    - c-blosc's own threads off (numcodecs' ``blosc.use_threads = False``): hsstore's reading
      and writing threads already use every core, and blosc's would compete with them.
    - glibc's mmap and trim thresholds raised, so the object-store client's response buffers
      are reused from the heap instead of mapped afresh for every request; left alone with
      ``HSSTORE_MALLOC_TUNING=0``, under glibc's own ``MALLOC_*_`` variables, or off glibc.
    """
    single_threaded_blosc()
    return ProcessTuning(
        blosc_single_threaded=True, malloc_keeps_response_buffers=keep_response_buffers()
    )


# Net allocations between two passes of the cyclic garbage collector over its youngest objects,
# in a program of hsstore's own (CPython's own spacing is 700). Each tenth young pass is followed
# by a pass over the middle generation, and each tenth of those by one over every tracked object
# when enough have been promoted since the last: so the start-up of an extraction, whose imports
# and model (torch, transformers) create some half a million objects that live until the exit,
# walks them all again and again at CPython's spacing. Fourteen times further apart, the passes
# over everything come that much less often; garbage cycles wait a few thousand allocations
# longer to be freed, which bounds what they can hold.
YOUNG_COLLECTION_SPACING = 10_000


def space_collections() -> None:
    """Space the cyclic collector's passes `YOUNG_COLLECTION_SPACING` allocations apart for a
    program of hsstore's own (the command line, a spawned extraction worker); idempotent. A
    wider spacing already set, or the collector turned off, is left as it is."""
    young, middle, old = gc.get_threshold()
    if 0 < young < YOUNG_COLLECTION_SPACING:
        gc.set_threshold(YOUNG_COLLECTION_SPACING, middle, old)
