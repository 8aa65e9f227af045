"""A longer soak of the commit protocol: the explorer of the test suite (tests/explorer.py)
over many more seeds, on a local filesystem, with a killed writer process every so often.

    python -m tools.soak_commits --schedules 20000 --crash-every 200 [--rate 0.04] [--dir D]
    python -m tools.soak_commits --schedules 0 --damage 5000    # metadata damage schedules only

Prints a line per thousand schedules and ends with ``key=value`` totals; exits 1 if anything
was lost, reported wrongly, unopenable, damaged, hung or raised an error not hsstore's own.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile

from tests.damage_explorer import run_damage_schedule
from tests.explorer import Results, run_crash_schedule, run_schedule


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--schedules", type=int, default=5000)
    ap.add_argument("--first-seed", type=int, default=100_000)
    ap.add_argument("--crash-every", type=int, default=250, help="0: no killed writers")
    ap.add_argument("--rate", type=float, default=0.04, help="share of storage calls faulted")
    ap.add_argument("--dir", default=None, help="scratch folder (default: /dev/shm or $TMPDIR)")
    ap.add_argument("--damage", type=int, default=0,
                    help="also run this many metadata damage schedules (tests/damage_explorer.py)")  # fmt: skip
    args = ap.parse_args(argv)
    shm = "/dev/shm" if os.access("/dev/shm", os.W_OK) else None
    scratch = tempfile.mkdtemp(prefix="hsstore-soak-", dir=args.dir or shm)
    results = Results()
    try:
        for k in range(args.schedules):
            seed = args.first_seed + k
            location = os.path.join(scratch, f"d{seed}")
            if args.crash_every and k % args.crash_every == args.crash_every - 1:
                run_crash_schedule(location, seed, results)
            else:
                run_schedule(location, seed, results, rate=args.rate)
            shutil.rmtree(location, ignore_errors=True)
            if (k + 1) % 1000 == 0:
                print(results.summary(), flush=True)
        for k in range(args.damage):
            seed = args.first_seed + k
            location = os.path.join(scratch, f"m{seed}")
            run_damage_schedule(location, seed, results)
            shutil.rmtree(location, ignore_errors=True)
            if (k + 1) % 1000 == 0:
                print(results.summary(), flush=True)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    for line in (results.lost + results.unopenable + results.silent + results.damaged)[:20]:
        print(line)
    for line in results.locked[:20]:
        print(line)
    for line in (results.hangs + results.raw)[:20]:
        print(line)
    print(results.summary())
    return 1 if results.failures else 0


if __name__ == "__main__":
    sys.exit(main())
