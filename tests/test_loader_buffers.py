"""The loader's host batch buffers: huge-page memory, and padding written only where a buffer
may hold stale rows, zeroed on the checker thread when there is much of it."""

from __future__ import annotations

import mmap
import os
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import torch

import hsstore
import hsstore.loader.fetch as fetch
from hsstore import LayerSpec
from hsstore.loader import Loader
from hsstore.loader.collate import HostBuffers, fill_padding, placements

H = 32
MAX_TOKENS = 128
LAYERS = [LayerSpec(depth=1), LayerSpec(depth=3), LayerSpec(depth=5), LayerSpec(depth=6)]


def test_padding_skips_only_rows_known_to_be_zero():
    buf = HostBuffers(16, 1, 2, torch.bfloat16, pin=False)
    assert buf.clean_from == 0  # allocated zeroed
    raw = buf.view(1, 16, [12], [0])
    buf.clean_from = fill_padding(raw, placements(True, np.array([12])), True, 0, buf.clean_from)
    assert buf.clean_from == 12
    raw.hidden[0, :12] = 1  # what the decode threads write
    raw = buf.view(1, 16, [5], [1])  # a shorter packed batch: rows 5-11 are stale
    buf.clean_from = fill_padding(raw, placements(True, np.array([5])), True, 0, buf.clean_from)
    assert buf.clean_from == 5
    assert bool((raw.hidden[0, :5] == 1).all()) and bool((raw.hidden[0, 5:] == 0).all())
    raw.hidden[0, :5] = 1
    raw = buf.view(2, 2, [1, 2], [2, 3])  # padded, over flat rows 0-3 only: row 4 keeps its 1
    bound = fill_padding(raw, placements(False, np.array([1, 2])), False, 0, buf.clean_from)
    assert bound == 5
    assert bool((raw.hidden[0, 1] == 0).all()) and bool((raw.hidden[1] == 1).all())
    assert bool((buf.hidden.view(16, 2)[4] == 1).all())
    fresh = HostBuffers(16, 1, 2, torch.bfloat16, pin=False, prefault=False)
    assert fresh.clean_from == 16  # nothing known: every padding row is written


def test_large_host_buffers_are_private_zeroed_memory_that_outlives_its_mapping(tmp_path):
    """Batch buffers too large for small pages come from a private anonymous mapping (huge
    pages where the kernel has them): zeroed, writable, alive as long as the tensor, and
    copied on write into a forked worker rather than shared with it."""
    buf = HostBuffers(1 << 16, 4, 64, torch.bfloat16, pin=False)  # 32 MiB of states
    hidden = buf.hidden
    del buf
    assert hidden.dtype == torch.bfloat16 and hidden.numel() == (1 << 16) * 4 * 64
    assert not hidden.any()
    hidden[-1] = 1.5
    pid = os.fork()
    if pid == 0:  # the child writes its copy and leaves
        hidden[-1] = 2.5
        os._exit(0)
    os.waitpid(pid, 0)
    assert float(hidden[-1]) == 1.5
    if hasattr(mmap, "MADV_HUGEPAGE") and _thp_enabled():
        start = hidden.data_ptr()
        assert _huge_kib(start, hidden.nbytes) > 0


def _thp_enabled() -> bool:
    try:
        setting = Path("/sys/kernel/mm/transparent_hugepage/enabled").read_text()
    except OSError:
        return False
    return "[never]" not in setting


def _huge_kib(start: int, nbytes: int) -> int:
    """AnonHugePages of the mapping holding [start, start + nbytes) in this process."""
    lines = Path("/proc/self/smaps").read_text().splitlines()
    inside = False
    for line in lines:
        head = line.split()[0]
        if "-" in head and ":" not in head:
            lo, hi = (int(x, 16) for x in head.split("-"))
            inside = lo <= start and start + nbytes <= hi
        elif inside and head == "AnonHugePages:":
            return int(line.split()[1])
    return 0


@pytest.mark.parametrize("tier", [None, "fp8-token"])
def test_stale_padding_zeroed_on_the_checker_before_the_batch_is_delivered(
    tmp_path, monkeypatch, tier
):
    """A short batch in a buffer a long one used has its stale rows zeroed on the checker
    thread while its samples decode; the batch arrives only once they are zero (and, fp8,
    only then dequantized: padding dequantizes to zero)."""
    monkeypatch.setattr(fetch, "_ZERO_HERE_BYTES", 1)  # every stale row handed off
    zeroed_on: list[str] = []
    zero_rows = fetch._zero_rows

    def spy(stale):
        time.sleep(0.05)  # a slow zeroing: a batch handed out early would still hold stale rows
        zero_rows(stale)
        zeroed_on.append(threading.current_thread().name)

    monkeypatch.setattr(fetch, "_zero_rows", spy)
    ds = hsstore.create(tmp_path / "ds", layers=LAYERS, hidden_size=H, dtype=torch.bfloat16,
                        model={"name": "toy", "revision": None, "num_hidden_layers": 6,
                               "hidden_size": H}, tier=tier)  # fmt: skip
    g = torch.Generator().manual_seed(4)
    with ds.writer() as w:
        for i, t in enumerate([MAX_TOKENS, 3] * 4):  # buffers alternate long and short batches
            states = torch.randn(t, len(LAYERS), H, generator=g).to(torch.bfloat16)
            w.add(f"s{i}", torch.randint(0, 50, (t,), generator=g), torch.ones(t, dtype=torch.int64), states)  # fmt: skip
    ds = hsstore.open(ds.path)
    loader = Loader(ds.path, max_tokens=MAX_TOKENS, shuffle=False, num_threads=1, prefetch=2,
                    decode_path="pipelined")  # a checker thread  # fmt: skip
    for batch in loader:
        used = int(batch["lengths"].sum())
        assert torch.all(batch["per_layer_hidden_states"][0, used:] == 0)
        want = [ds[i].dequantized() if tier else ds[i].hidden for i in batch["sample_index"]]
        assert torch.equal(batch["per_layer_hidden_states"][0, :used], torch.cat(want))
    loader.close()
    assert zeroed_on and set(zeroed_on) == {"hsstore-check_0"}
