"""The slots that carry states from SGLang's scheduler to the worker (hsstore.extractors.backends.sglang.capture).

The backend and the forward hook are the real ones, on the fake engine of tests/sglang_fake.py:
slots are reused across requests and released only when the states are freed; a capture that
fails or stops half-way is named, never stored, and leaves no slot behind; a killed worker's
shared memory is reclaimed by the next run.
"""

from __future__ import annotations

import errno
import gc
import os

import pytest
import torch
from sglang_fake import ForwardBatch, ForwardMode, LogitsOutput, factory
from test_extract_sglang import N, batch_of, hf_states, sglang_options

from hsstore.demo_model import build_tiny_model
from hsstore.extractors.backends.sglang import capture as sglang_capture
from hsstore.extractors.backends.sglang.backend import SGLangBackend, SGLangResponseError
from hsstore.extractors.backends.sglang.capture import (
    DIR_PREFIX,
    SlotReader,
    SlotWriter,
    shared_memory_root,
)
from hsstore.extractors.backends.sglang.checks import states_from_captures
from hsstore.extractors.backends.sglang.hook import capture_hook
from hsstore.extractors.runner import WorkerFailedError, run_extract
from hsstore.spec.layers import LayerSpec


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("tiny"), layers=N)


def names(directory) -> list[str]:
    return sorted(os.listdir(directory))


def slot_inodes(directory) -> set[int]:
    return {os.stat(os.path.join(directory, n)).st_ino for n in os.listdir(directory)}


def test_slots_are_held_while_the_states_live_and_reused_after(tiny):
    layers = [LayerSpec(3), LayerSpec(N, final_norm=True), LayerSpec(2)]
    batch = batch_of(tiny, 3)
    want = hf_states(tiny, batch, layers)
    backend = SGLangBackend(str(tiny), layers, engine_factory=factory(), dtype="bfloat16")
    directory = backend.capture_dir
    try:
        got = backend.run(batch)
        assert [n.endswith(".0.hs") for n in names(directory)] == [True] * 3  # held receipts
        assert backend.capture_stats["bytes"] == sum(g.numel() * 2 for g in got)
        for g, w in zip(got, want):
            assert g.dtype == torch.bfloat16 and g.shape == w.shape
            torch.testing.assert_close(g.float(), w, rtol=2e-2, atol=2e-2)
        first = [g.clone() for g in got]
        view = got[1][1:]  # a view keeps its slot as long as the whole tensor would
        del got, g
        gc.collect()
        assert sum(n.startswith("free-") for n in names(directory)) == 2
        del view
        gc.collect()
        assert names(directory) == ["free-0", "free-1", "free-2"]
        pool = slot_inodes(directory)
        again = backend.run(batch[::-1])  # reused slots, other contents: no stale rows
        assert slot_inodes(directory) == pool
        for g, f in zip(again, first[::-1]):
            assert torch.equal(g, f)
        del again
    finally:
        backend.close()
    assert not os.path.exists(directory)


def hook_and_batch(directory, h=4):
    config = {"mode": "shm", "aux_width": 2 * h, "hidden_size": h, "layout": [0, 2]}
    hook = capture_hook({**config, "dir": str(directory), "rid_prefix": "hs-"})
    batch = ForwardBatch(ForwardMode(True), ["hs-a"], [3], [0])
    out = LogitsOutput(torch.randn(3, 2 * h), torch.randn(3, h))
    return hook, (None, out.last_hidden_states, None, batch), out


def test_a_failed_write_is_named_and_gives_its_slot_back(tmp_path, monkeypatch):
    hook, args, out = hook_and_batch(tmp_path)
    reader = SlotReader(str(tmp_path))

    def full(fd, offset, length):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(sglang_capture.os, "posix_fallocate", full)  # /dev/shm is full
    hook(None, args, out)
    with pytest.raises(SGLangResponseError, match="capture failed: OSError.*No space left") as exc:
        states_from_captures(
            reader, "hs-a", num_tokens=3, layers=2, hidden_size=4, dtype=torch.float32,
            sample_id="s0",
        )  # fmt: skip
    assert exc.value.sample_id == "s0"
    assert names(tmp_path) == ["free-0"]  # the slot is back in the pool, the receipt gone
    monkeypatch.undo()
    hook(None, args, out)  # the same slot, now with room
    states = states_from_captures(
        reader, "hs-a", num_tokens=3, layers=2, hidden_size=4, dtype=torch.float32,
        sample_id="s0",
    )  # fmt: skip
    assert torch.equal(states, torch.stack([out.hidden_states[:, :4], out.last_hidden_states], 1))
    assert names(tmp_path) == ["hs-a.0.hs"]


def test_a_capture_started_but_never_finished_is_named(tmp_path):
    SlotWriter(str(tmp_path)).claim("hs-a", 0, 4096)  # a hook that stopped while writing
    with pytest.raises(SGLangResponseError, match="started but not finished") as exc:
        states_from_captures(
            SlotReader(str(tmp_path)), "hs-a", num_tokens=3, layers=2, hidden_size=4,
            dtype=torch.float32, sample_id="s7", wait_s=0.2,
        )  # fmt: skip
    assert exc.value.sample_id == "s7"


def test_a_problem_published_on_a_slot_frees_the_slot(tmp_path):
    writer = SlotWriter(str(tmp_path))
    slot = writer.claim("hs-a", 0, 4096)
    header = {"rid": "hs-a", "prefix": 0, "rows": 0, "layers": 0, "hidden": 0}
    writer.publish(slot, {**header, "dtype": "float32", "problem": "the copy failed"})
    (cap,) = SlotReader(str(tmp_path)).captures_of("hs-a")
    assert cap.states is None and cap.problem == "the copy failed"
    assert names(tmp_path) == ["free-0"]


def test_unreadable_receipt_names_its_file(tmp_path):
    (tmp_path / "hs-a.0.hs").write_bytes(b"{not json" + b"\0" * 100)
    with pytest.raises(ValueError, match=r"hs-a\.0\.hs: unreadable capture header"):
        SlotReader(str(tmp_path)).captures_of("hs-a")


def capture_dirs() -> set[str]:
    root = shared_memory_root()
    return {n for n in os.listdir(root) if n.startswith(DIR_PREFIX)}


def test_a_killed_workers_shared_memory_is_reclaimed_by_the_next_run(tiny, tmp_path):
    data = tmp_path / "p.jsonl"
    data.write_text('{"text": "one"}\n{"text": "two"}\n')
    before = capture_dirs()
    die = factory(faults={"die_once_file": str(tmp_path / "died")})
    with pytest.raises(WorkerFailedError, match="died"):
        run_extract(sglang_options(tiny, data, tmp_path / "ds", die))
    left = capture_dirs() - before
    assert left  # the worker died holding its capture directory
    run_extract(sglang_options(tiny, data, tmp_path / "ds", die))
    after = capture_dirs()
    assert not left & after
    assert not {d for d in after - before if not sglang_capture._alive(int(d.split("-")[2]))}


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_non_finite_states_are_refused_in_every_dtype(tmp_path, dtype, bad):
    hook, args, out = hook_and_batch(tmp_path)
    out.hidden_states, out.last_hidden_states = (
        out.hidden_states.to(dtype),
        out.last_hidden_states.to(dtype),
    )
    reader = SlotReader(str(tmp_path))
    kw = dict(num_tokens=3, layers=2, hidden_size=4, dtype=dtype, sample_id="s0")
    hook(None, args, out)
    assert states_from_captures(reader, "hs-a", **kw).isfinite().all()  # clean: accepted
    out.last_hidden_states[2, 1] = bad
    args[3].rids[0] = "hs-b"
    hook(None, args, out)
    with pytest.raises(SGLangResponseError, match="non-finite"):
        states_from_captures(reader, "hs-b", **kw)
