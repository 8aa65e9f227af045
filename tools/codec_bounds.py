"""The bounds `tools/bench_loader.py` measures the loader against: the codec alone, on one core.

* `codec_runner`: every chunk held in memory, decoded (crc checked) into one reused buffer,
  as `tools/bench_codec.py` times it;
* `codec_files_runner`: the chunks got as any reader of the files must get them (a memory map,
  its pages dropped after each shard, or a ``preadv`` per chunk into a reused buffer) and
  decoded without crc one after another into a batch-sized buffer.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np


def held_chunks(path: Path):
    """The dataset at ``path``, its codec and, per shard, the file and its chunks' ranges."""
    import hsstore
    from hsstore.format import paths
    from hsstore.format.codecs import ChunkCodec
    from hsstore.format.segment_layout import EMPTY

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


def codec_runner(path: Path):
    """The codec alone, one core: every chunk of the dataset at ``path``, read into memory
    first, decoded (crc checked) into one reused buffer; returns the decoded bytes."""
    man, codec, shards = held_chunks(path)
    chunks = []
    for storage, key, ranges in shards:
        data = memoryview(storage.read_bytes(key))
        chunks += [data[o : o + n] for o, n in ranges]
    out = np.empty(man.chunk_nbytes, np.uint8)

    def run(epoch: int) -> int:
        for chunk in chunks:
            codec.decode_into(chunk, out, what="codec")
        return len(chunks) * out.nbytes

    return run


def codec_files_runner(path: Path, batch_bytes: int, how: str):
    """The codec alone, one core, reading the files as a loader must (``how``: "mapped" or
    "pread"), chunks decoded without crc into consecutive places of a batch-sized buffer;
    returns the decoded bytes."""
    import mmap

    man, codec, shards = held_chunks(path)
    size = man.chunk_nbytes
    places = max(1, batch_bytes // size)
    batch = np.ones(places * size, np.uint8)  # touched once, before timing matters
    outs = [batch[k * size : (k + 1) * size] for k in range(places)]
    staging = memoryview(np.ones(2 * size, np.uint8))  # a chunk never grows past this
    files = []
    for storage, key, ranges in shards:
        fd = os.open(Path(storage.root) / key, os.O_RDONLY)
        files.append((fd, mmap.mmap(fd, 0, prot=mmap.PROT_READ), ranges))

    def run(epoch: int) -> int:
        k = 0
        for fd, mapped, ranges in files:
            view = memoryview(mapped)
            for o, n in ranges:
                if how == "pread":
                    os.preadv(fd, [staging[:n]], o)
                    chunk = staging[:n]
                else:
                    chunk = view[o : o + n]
                codec.decode_into(chunk, outs[k % places], what="codec", crc=False)
                k += 1
            view.release()
            mapped.madvise(mmap.MADV_DONTNEED)
        return k * size

    return run
