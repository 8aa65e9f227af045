"""The bounds `tools/bench_loader.py` measures the loader against: the codec alone, on one core.

* `codec_runner`: every chunk held in memory, decoded (crc checked) into one reused buffer,
  as `tools/bench_codec.py` times it;
* `codec_files_runner`: the chunks got as any reader of the files must get them (a memory map,
  its pages dropped after each shard, or a ``preadv`` per chunk into a reused buffer) and
  decoded without crc one after another into a batch-sized buffer, around the caches (the
  codec's ``stream``) as a loader decodes batches. With ``how="checked"`` they are read with
  ``preadv`` and every decoded chunk also goes through XXH3 at once (so it is decoded into the
  cache), as a whole-sample checksum taken inline does: the bound of a loader on one core that
  reads its files the way hsstore does (no memory maps) and verifies what it delivers;
* `codec_held_runner`: the chunks held in memory as for `codec_runner`, decoded without crc
  into a batch-sized buffer around the caches, so only the destination (and the stores that
  suit it) differs from `codec_runner`: the rate no loader on one core passes, whatever it
  does about reads and checks, since every batch it delivers lands in such memory;
* `codec_pipelined_runner`: `codec_files_runner`'s "checked" work cut into three threads: one
  reads the chunks with ``preadv``, this one only decodes (no crc) into batch-sized memory,
  and a third runs XXH3 over what was decoded: the bound of a loader whose decode thread
  does nothing but decode, with reads and checks on other cores;
* `time_codec_calls`: the seconds a process spends inside the codec's decode calls, which
  splits a one-thread loader's epoch into the codec's own work and everything else.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np


def held_chunks(path: Path):
    """The dataset at ``path``, its codec and, per shard, the file and its chunks' ranges."""
    import hsstore
    from hsstore.codec.codecs import ChunkCodec
    from hsstore.spec import paths
    from hsstore.spec.segment_layout import EMPTY

    ds = hsstore.open(path)
    man = ds.manifest
    shards = []
    for k in range(len(man.segments)):
        reader = ds.segment_reader(k)
        for shard in range(reader.info.num_shards):
            key = reader.key(paths.shard_relpath(shard))
            entries = reader.shard_index(shard).entries.reshape(-1, 2).tolist()
            shards.append((reader.storage, key, [(o, n) for o, n in entries if o != EMPTY]))
    return man, ChunkCodec(man.codec, man.storage_dtype.itemsize), shards


def _chunks_in_memory(shards) -> list[memoryview]:
    """Every chunk of ``shards`` (`held_chunks`), its shard file read into memory once (into
    writable memory, as a loader's reads land)."""
    chunks = []
    for storage, key, ranges in shards:
        data = memoryview(bytearray(storage.read_bytes(key)))
        chunks += [data[o : o + n] for o, n in ranges]
    return chunks


def _batch_places(size: int, batch_bytes: int) -> list[np.ndarray]:
    """Consecutive chunk-sized places of one batch-sized buffer, touched once before timing."""
    places = max(1, batch_bytes // size)
    batch = np.ones(places * size, np.uint8)
    return [batch[k * size : (k + 1) * size] for k in range(places)]


def codec_runner(path: Path):
    """The codec alone, one core: every chunk of the dataset at ``path``, read into memory
    first, decoded (crc checked) into one reused buffer; returns the decoded bytes."""
    man, codec, shards = held_chunks(path)
    chunks = _chunks_in_memory(shards)
    out = np.empty(man.chunk_nbytes, np.uint8)

    def run(epoch: int) -> int:
        for chunk in chunks:
            codec.decode_into(chunk, out, what="codec")
        return len(chunks) * out.nbytes

    return run


def codec_held_runner(path: Path, batch_bytes: int):
    """The codec alone, one core: every chunk read into memory first, as for `codec_runner`,
    but decoded without crc into consecutive places of a batch-sized buffer; returns the
    decoded bytes."""
    man, codec, shards = held_chunks(path)
    chunks = _chunks_in_memory(shards)
    outs = _batch_places(man.chunk_nbytes, batch_bytes)

    def run(epoch: int) -> int:
        for k, chunk in enumerate(chunks):
            codec.decode_into(chunk, outs[k % len(outs)], what="codec", crc=False, stream=True)
        return len(chunks) * man.chunk_nbytes

    return run


def codec_files_runner(path: Path, batch_bytes: int, how: str):
    """The codec alone, one core, reading the files as a loader must (``how``: "mapped" or
    "pread"; "checked": "pread" plus XXH3 of each decoded chunk), chunks decoded without crc
    into consecutive places of a batch-sized buffer; returns the decoded bytes."""
    import mmap

    import xxhash

    man, codec, shards = held_chunks(path)
    size = man.chunk_nbytes
    outs = _batch_places(size, batch_bytes)
    staging = memoryview(np.ones(2 * size, np.uint8))  # a chunk never grows past this
    files = []
    for storage, key, ranges in shards:
        fd = os.open(Path(storage.root) / key, os.O_RDONLY)
        files.append((fd, mmap.mmap(fd, 0, prot=mmap.PROT_READ), ranges))

    def run(epoch: int) -> int:
        k = 0
        hasher = xxhash.xxh3_64() if how == "checked" else None
        for fd, mapped, ranges in files:
            view = memoryview(mapped)
            for o, n in ranges:
                if how == "mapped":
                    chunk = view[o : o + n]
                else:
                    os.preadv(fd, [staging[:n]], o)
                    chunk = staging[:n]
                out = outs[k % len(outs)]
                # hashed at once, so decoded into the cache; else around it, as a loader does
                codec.decode_into(chunk, out, what="codec", crc=False, stream=hasher is None)
                if hasher is not None:
                    hasher.update(out)
                k += 1
            view.release()
            mapped.madvise(mmap.MADV_DONTNEED)
        return k * size

    return run


def codec_pipelined_runner(path: Path, batch_bytes: int, group: int = 16):
    """`codec_files_runner` ("checked") in three threads: reads (``preadv``) ahead of this
    thread's decoding, ``group`` chunks at a time into one of four staging slots, and XXH3 of
    each decoded group behind it; returns the decoded bytes."""
    import queue
    import threading

    import xxhash

    man, codec, shards = held_chunks(path)
    size = man.chunk_nbytes
    outs = _batch_places(size, batch_bytes)
    items = []
    for storage, key, ranges in shards:
        fd = os.open(Path(storage.root) / key, os.O_RDONLY)
        items += [(fd, o, n) for o, n in ranges]
    groups = [items[k : k + group] for k in range(0, len(items), group)]
    slots = [memoryview(np.ones(2 * size * group, np.uint8)) for _ in range(4)]
    # A decoded group waits for its hash at most this many groups back, so no place of the
    # batch buffer is decoded into again before it is hashed.
    lag = max(1, len(outs) // group - 2)

    def run(epoch: int) -> int:
        free: queue.Queue[int] = queue.Queue()
        for k in range(len(slots)):
            free.put(k)
        read: queue.Queue = queue.Queue()
        decoded: queue.Queue = queue.Queue(maxsize=lag)

        def reader() -> None:
            for chunks in groups:
                slot, at, views = free.get(), 0, []
                for fd, o, n in chunks:
                    view = slots[slot][at : at + n]
                    os.preadv(fd, [view], o)
                    views.append(view)
                    at += n
                read.put((slot, views))

        def hasher() -> None:
            h = xxhash.xxh3_64()
            while (places := decoded.get()) is not None:
                for place in places:
                    h.update(place)

        threads = [threading.Thread(target=reader), threading.Thread(target=hasher)]
        for t in threads:
            t.start()
        k = 0
        for _ in groups:
            slot, views = read.get()
            places = []
            for view in views:
                out = outs[k % len(outs)]
                codec.decode_into(view, out, what="codec", crc=False, stream=True)
                places.append(out)
                k += 1
            free.put(slot)
            decoded.put(places)
        decoded.put(None)
        for t in threads:
            t.join()
        return k * size

    return run


def time_codec_calls() -> list[float]:
    """From now on, add the seconds of every `ChunkCodec.decode_into` call in this process to
    the returned one-element list (a benchmark's own process only: the codec is wrapped)."""
    import time

    from hsstore.codec.codecs import ChunkCodec

    spent = [0.0]
    decode_into = ChunkCodec.decode_into

    def timed(self, *args, **kwargs):
        t0 = time.perf_counter()
        try:
            return decode_into(self, *args, **kwargs)
        finally:
            spent[0] += time.perf_counter() - t0

    ChunkCodec.decode_into = timed
    return spent
