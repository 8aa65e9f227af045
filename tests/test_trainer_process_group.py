"""The trainer's process group is freed by destroy_process_group(), before the interpreter exits.

Two ranks (gloo, CPU) set up as the trainer does, wrap a module in DDP, run a collective and
destroy the group. Nothing may keep the group alive after that: otherwise gloo's threads and
connections are torn down only while the interpreter finalizes, as the other rank exits too.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

from tools.ports import free_port

ROOT = Path(__file__).resolve().parents[1]

RANK = textwrap.dedent(
    """
    import weakref
    import torch
    from hsstore.trainers.eagle3.train import distributed_setup

    rank, world, _ = distributed_setup()
    group = weakref.ref(torch.distributed.group.WORLD)
    ddp = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(4, 4))
    ddp(torch.randn(2, 4)).sum().backward()  # gradients all-reduced through the group
    found = [None] * world
    torch.distributed.all_gather_object(found, rank)
    del ddp
    torch.distributed.destroy_process_group()
    print(f"rank {rank} of {found}: group freed {group() is None}", flush=True)
    """
)


def test_destroying_the_process_group_frees_it_after_ddp():
    base = {**os.environ, "OMP_NUM_THREADS": "1", "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(free_port()), "WORLD_SIZE": "2"}  # fmt: skip

    def start(rank: int) -> subprocess.Popen[str]:
        env = {**base, "RANK": str(rank), "LOCAL_RANK": str(rank)}
        pipe = subprocess.PIPE
        return subprocess.Popen([sys.executable, "-c", RANK], cwd=ROOT, env=env, text=True,
                                stdout=pipe, stderr=pipe)  # fmt: skip

    ranks = [start(r) for r in range(2)]
    for r, proc in enumerate(ranks):
        out, err = proc.communicate(timeout=120)
        assert proc.returncode == 0, err[-3000:]
        assert out.split() == ["rank", str(r), "of", "[0,", "1]:", "group", "freed", "True"], err
