"""The contenders of the peer race (`tools/bench_peers.py`): hsstore and each format it competes
with, behind one interface (write every sample; read sample i into a ``[T, L, H]`` buffer).

The peers' packages are imported where a contender is first used, so ``--peers none`` needs
none of them; see docs/PERFORMANCE.md ("Peers") for their versions and how to install them.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import numpy as np
import torch

import hsstore
from hsstore import LayerSpec

PEERS = ("lance", "mds", "safetensors", "torchsave", "zarr")
COMPRESSED_PEERS = ("lance", "zarr")  # read compressed bytes; MDS reads a decompressed copy
Sample = tuple[torch.Tensor, torch.Tensor]  # (input_ids int64 [T], states bf16 [T, L, H])


def dir_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def evict(path: Path) -> None:
    """Drop a contender's (clean) files from the page cache."""
    for f in path.rglob("*"):
        if f.is_file():
            fd = os.open(f, os.O_RDONLY)
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


class Contender:
    """One format: writes every sample under ``root``, reads sample i into a [T, L, H] buffer."""

    name = ""

    def __init__(self, root: Path, samples: list[Sample]):
        self.root, self.samples = root, samples
        self.lengths = [s.shape[0] for _, s in samples]
        self.offsets = np.concatenate([[0], np.cumsum(self.lengths)]).tolist()
        _, self.layers, self.hidden = samples[0][1].shape

    def write(self) -> None:
        raise NotImplementedError

    def open(self) -> None:
        """Called once after writing, before any read."""

    def drop_maps(self) -> None:
        """Before an eviction: release memory maps of the files (a mapped page stays cached)."""

    def read_into(self, i: int, out: torch.Tensor) -> None:
        raise NotImplementedError

    def read_dir(self) -> Path:
        """What a read touches (evicted before cold reads)."""
        return self.root


class Hsstore(Contender):
    def __init__(
        self,
        root: Path,
        samples: list[Sample],
        codec: str,
        *,
        format_2: bool = False,
        read_threads: int | None = None,
    ):
        super().__init__(root, samples)
        self.codec = codec
        # format_2: the layout of format 2 (no sample alignment, ~1 MiB chunks)
        self.aligned = None if not format_2 else False
        self.read_threads = read_threads
        self.name = f"hsstore {codec}" + (", format 2 layout" if format_2 else "")
        if read_threads is not None:
            self.name += f", {read_threads} read thread" + ("s" if read_threads > 1 else "")

    def write(self) -> None:
        ds = hsstore.create(self.root, layers=[LayerSpec(k + 1) for k in range(self.layers)],
                            hidden_size=self.hidden, dtype=torch.bfloat16, codec=self.codec,
                            sample_aligned=self.aligned)  # fmt: skip
        with ds.writer(encode_threads=1) as w:
            for i, (ids, states) in enumerate(self.samples):
                w.add(f"s{i}", ids, torch.ones_like(ids), states)

    def open(self) -> None:
        self.ds = hsstore.open(self.root, read_threads=self.read_threads)

    def drop_maps(self) -> None:
        self.ds.close()  # reopens its files on the next read

    def read_into(self, i: int, out: torch.Tensor) -> None:
        self.ds.read_hidden_into(i, out)


class SafetensorsFiles(Contender):
    name = "safetensors per file"

    def write(self) -> None:
        from safetensors.torch import save_file

        self.root.mkdir()
        for i, (ids, states) in enumerate(self.samples):
            save_file({"hidden_states": states, "input_ids": ids}, str(self.root / f"{i}.st"))

    def read_into(self, i: int, out: torch.Tensor) -> None:
        from safetensors.torch import load_file

        out.copy_(load_file(str(self.root / f"{i}.st"))["hidden_states"])


class TorchSaveFiles(Contender):
    name = "torch.save per file"

    def write(self) -> None:
        self.root.mkdir()
        for i, (ids, states) in enumerate(self.samples):
            torch.save({"hidden_states": states, "input_ids": ids}, self.root / f"{i}.pt")

    def read_into(self, i: int, out: torch.Tensor) -> None:
        out.copy_(torch.load(self.root / f"{i}.pt", weights_only=True)["hidden_states"])


class ZarrPython(Contender):
    """One zarr-python array [tokens, L, H] with hsstore's codec settings and ~1 MiB chunks."""

    name = "zarr-python blosc-zstd"

    def write(self) -> None:
        import zarr
        from zarr.codecs import BloscCodec

        rows = max(1, (1 << 20) // (self.layers * self.hidden * 2))
        group = zarr.open_group(str(self.root), mode="w")
        blosc = BloscCodec(typesize=2, cname="zstd", clevel=1, shuffle="shuffle", blocksize=1 << 20)
        states = group.create_array("states", shape=(self.offsets[-1], self.layers, self.hidden),
                                    chunks=(rows, self.layers, self.hidden), dtype="uint16",
                                    compressors=[blosc])  # fmt: skip
        ids = group.create_array("input_ids", shape=(self.offsets[-1],), chunks=(1 << 17,),
                                 dtype="int64", compressors=[blosc])  # fmt: skip
        # Whole chunks at a time: unaligned per-sample writes would re-encode shared chunks.
        slab = rows * 16
        pending, start = [], 0
        for k, (_, s) in enumerate(self.samples):
            pending.append(s.view(torch.uint16).numpy())
            filled = sum(p.shape[0] for p in pending)
            if filled >= slab or k == len(self.samples) - 1:
                block = np.concatenate(pending)
                end = start + (filled // rows * rows if k < len(self.samples) - 1 else filled)
                states[start:end] = block[: end - start]
                pending, start = [block[end - start :]], end
        ids[:] = torch.cat([i for i, _ in self.samples]).numpy()

    def open(self) -> None:
        import zarr

        self.states = zarr.open_group(str(self.root), mode="r")["states"]

    def read_into(self, i: int, out: torch.Tensor) -> None:
        block = self.states[self.offsets[i] : self.offsets[i + 1]]
        out.view(torch.uint16).copy_(torch.from_numpy(block))


class LanceRows(Contender):
    """One row per token (its L*H bf16 values as one binary cell), zstd pages.

    A binary cell rather than a fixed-size list: pylance 14.0.2 leaves fixed-size lists of
    uint16 uncompressed whatever the field's compression metadata says (ratio 1.000)."""

    name = "lance zstd"

    def write(self) -> None:
        import lance
        import pyarrow as pa

        compression = {"lance-encoding:compression": "zstd"}
        schema = pa.schema([pa.field("hidden", pa.large_binary(), metadata=compression),
                            pa.field("input_id", pa.int64())])  # fmt: skip
        row_bytes = self.layers * self.hidden * 2

        def batches():
            # Many samples per batch: lance compresses page by page, so tiny batches would not.
            pending: list[Sample] = []
            for k, sample in enumerate(self.samples):
                pending.append(sample)
                if sum(s.shape[0] for _, s in pending) >= 4096 or k == len(self.samples) - 1:
                    flat = np.concatenate(
                        [s.view(torch.uint16).numpy().reshape(-1) for _, s in pending]
                    )
                    offsets = np.arange(0, flat.nbytes + 1, row_bytes, dtype=np.int64)
                    hidden = pa.LargeBinaryArray.from_buffers(
                        pa.large_binary(), len(offsets) - 1,
                        [None, pa.py_buffer(offsets), pa.py_buffer(flat)],
                    )  # fmt: skip
                    ids = np.concatenate([i.numpy() for i, _ in pending])
                    yield pa.RecordBatch.from_arrays([hidden, pa.array(ids)], schema=schema)
                    pending = []

        lance.write_dataset(pa.RecordBatchReader.from_batches(schema, batches()), str(self.root))

    def open(self) -> None:
        import lance

        self.ds = lance.dataset(str(self.root))

    def read_into(self, i: int, out: torch.Tensor) -> None:
        rows = self.ds.take(list(range(self.offsets[i], self.offsets[i + 1])), columns=["hidden"])
        cells = rows.column("hidden").combine_chunks()
        _, offsets, data = cells.buffers()
        first, last = np.frombuffer(offsets, dtype=np.int64)[
            [cells.offset, cells.offset + len(cells)]
        ]
        np.copyto(out.view(torch.uint16).numpy().reshape(-1),
                  np.frombuffer(data, dtype=np.uint16, count=(last - first) // 2, offset=first))  # fmt: skip


def import_mds():
    """MDSWriter and StreamingDataset without `streaming/__init__.py`, which imports its
    vision datasets and so torchvision (streaming/__init__.py:8 in mosaicml-streaming 0.13.0);
    torchvision is not installed, since its wheels pull a CUDA torch."""
    import importlib.util
    import types

    if "streaming" not in sys.modules:
        spec = importlib.util.find_spec("streaming")
        if spec is None or spec.submodule_search_locations is None:
            raise ModuleNotFoundError(
                "mosaicml-streaming is not installed (see docs/PERFORMANCE.md)"
            )
        package = types.ModuleType("streaming")
        package.__path__ = list(spec.submodule_search_locations)
        sys.modules["streaming"] = package
    from streaming.base import MDSWriter, StreamingDataset

    return MDSWriter, StreamingDataset


class MosaicMDS(Contender):
    name = "MDS zstd (reads its decompressed copy)"

    def write(self) -> None:
        writer_cls, _ = import_mds()
        columns = {"hidden": "bytes", "input_ids": "bytes", "tokens": "int"}
        with writer_cls(out=str(self.root / "remote"), columns=columns, compression="zstd",
                        size_limit=1 << 26) as w:  # fmt: skip
            for ids, states in self.samples:
                w.write({"hidden": states.view(torch.uint16).numpy().tobytes(),
                         "input_ids": ids.numpy().tobytes(), "tokens": states.shape[0]})  # fmt: skip

    def open(self) -> None:
        _, dataset_cls = import_mds()
        self.ds = dataset_cls(remote=str(self.root / "remote"), local=str(self.root / "local"),
                              shuffle=False, batch_size=1)  # fmt: skip
        for i in range(len(self.lengths)):  # materialize the local decompressed shards
            self.ds[i]

    def read_into(self, i: int, out: torch.Tensor) -> None:
        raw = np.frombuffer(self.ds[i]["hidden"], dtype=np.uint16)
        np.copyto(out.view(torch.uint16).numpy().reshape(-1), raw)

    def read_dir(self) -> Path:
        return self.root / "local"
