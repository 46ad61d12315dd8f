"""The chaos soak: every feature of the library at once, in several replica processes,
under random faults, on a throwaway cluster; then the invariants checked over the record.

Each replica (``tests/support/chaos_replica.py``) runs a fenced ``LeaderLock`` whose
``LeaderTasks`` commit fenced rows every 100 ms, a ``Scheduler`` on that lock (a slot every
2 s, ``catch_up="all"``, ``interrupted="rerun"``, written through ``run.transaction``), a
``Semaphore(slots=2, fencing=True)`` whose holders commit fenced rows, and a
``Coordinator(fencing=True)`` with 16 names whose workers commit checkpointed rows; the
library's default timings. Faults (``tests/support/chaos_soak.py``): SIGKILL, two
SIGKILLs at once, SIGTERM, SIGSTOP for 12-20 s, ``pg_terminate_backend`` of a lock's
session, fast and immediate restarts of the server. The checker
(``tests/support/chaos_check.py``) prints the faults, every finding by kind (0 expected),
the leaderless time per fault, the names re-led after a SIGKILL (all, and by what else
went on: the kill alone, a frozen replica, a server restart, no other replica running),
the slots.

    .venv/bin/python benchmarks/chaos.py --minutes 20 --replicas 4 --seed 7

Exit status: 0 when nothing was found, 1 otherwise. The record (every process's JSON
lines and stderr, the final database) stays in ``--out`` (default: a new temp dir).
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import tempfile
from pathlib import Path

from _common import describe_machine, interrupt_on_signals, machine_info

from support.chaos_check import check
from support.chaos_data import SoakData
from support.chaos_soak import Soak, SoakConfig


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--minutes", type=float, default=20.0, help="the whole run")
    parser.add_argument("--replicas", type=int, default=4)
    parser.add_argument("--seed", type=int, help="default: a random one (printed)")
    parser.add_argument("--names", type=int, default=16)
    parser.add_argument("--tail", type=float, default=20.0, help="seconds without faults")
    parser.add_argument("--out", type=Path, help="where the record goes")
    parser.add_argument("--json", type=Path, help="also write the figures here")
    parser.add_argument(
        "--watchdog", action="store_true", help="replicas dump their stacks when stalled (risky)"
    )
    parser.add_argument(
        "--check", type=Path, metavar="OUT", help="only check the record a run left in OUT"
    )
    args = parser.parse_args()
    interrupt_on_signals()
    if args.check is None:
        seed = args.seed if args.seed is not None else random.randrange(1 << 32)
        out = args.out or Path(tempfile.mkdtemp(prefix="chaos-"))
        info = machine_info()
        print(describe_machine({**info, "server_version": "15 (throwaway cluster)"}))
        print(f"Seed {seed}; the record goes to {out}", flush=True)
        config = SoakConfig(
            seconds=args.minutes * 60, replicas=args.replicas, seed=seed, names=args.names,
            tail_s=args.tail, watchdog=args.watchdog,
        )  # fmt: skip
        Soak(config, out).run()
    else:
        out, seed = args.check, None
    report = check(SoakData.load(out))
    print(report.format())
    if args.json:
        figures = {
            "seed": seed,
            "findings": dict(report.counts()),
            "faults": dict(report.faults),
            "leaderless": report.leaderless,
            "releds": report.releds,
            "releds_by": report.releds_by,
            "never_reled": report.never_reled,
            "slots": report.slots,
            "rows": dict(report.rows),
            "list": [str(f) for f in report.findings],
        }
        args.json.write_text(json.dumps(figures, indent=1))
    return 1 if report.findings else 0


if __name__ == "__main__":
    sys.exit(main())
