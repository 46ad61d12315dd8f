"""One replica of the schedule fault run (test_schedule_faults.py), as its own process.

A ``LeaderLock`` (fencing, a 1.5 s lease) with a ``Scheduler`` of two jobs, both every
second:

- ``tx``: its writes go through ``run.transaction`` (a transactional sink); catch-up
  ``all``, interrupted runs run again. It inserts (slot, term, pid) into ``<prefix>_tx``
  and holds the transaction open a random while, so that faults land inside it.
- ``plain``: writes outside any transaction (a sink that cannot roll back); catch-up
  ``latest`` with a 0.3 s misfire grace, interrupted runs are recorded lost. It inserts (slot, pid) into
  ``<prefix>_plain`` as it starts, then works a random while.

The DSN comes in ``PG_DSN``. SIGTERM (or stdin closing) is a graceful stop: the lock
drains (the runs in progress finish), then everything closes.
"""

from __future__ import annotations

import asyncio
import os
import random
import signal
import sys
from pathlib import Path
from typing import Any

import psycopg

from pgleaderlock import Fencing, FixedInterval, LeaderLock, LockOptions, Session, Timing
from pgleaderlock.schedule import Policy, Run, Scheduler

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/, for support
from support.child import stdin_commands


async def main(name: str, prefix: str, replica: str) -> None:
    dsn = os.environ["PG_DSN"]
    lock = LeaderLock.from_name(
        name,
        dsn=dsn,
        health_interval_s=0.3,
        retry_strategy=FixedInterval(0.05),
        options=LockOptions(
            fencing=Fencing(enabled=True, grace_s=1.0),
            timing=Timing(
                lease_s=1.5,
                health_timeout_s=0.5,
                connect_timeout_s=2.0,
                command_timeout_s=2.0,
                drain_s=3.0,
            ),
            session=Session(application_name=f"sched-soak-{replica}"),
            load_plugins=False,
        ),
    )
    sched = Scheduler(lock)
    pid = os.getpid()

    def connect() -> Any:  # a connection per run: an old one may have been ended by fencing
        return psycopg.AsyncConnection.connect(dsn, autocommit=True)

    @sched.every(seconds=1, policy=Policy(catch_up="all", interrupted="rerun"))
    async def tx(run: Run) -> None:
        async with await connect() as conn, run.transaction(conn) as term:
            await conn.execute(
                f"INSERT INTO {prefix}_tx (slot, term, pid) VALUES (%s, %s, %s)",
                (run.slot, term, pid),
            )
            await asyncio.sleep(random.uniform(0.0, 0.3))

    @sched.every(
        seconds=1, policy=Policy(catch_up="latest", interrupted="lost", misfire_grace_s=0.3)
    )
    async def plain(run: Run) -> None:
        async with await connect() as conn:
            await conn.execute(
                f"INSERT INTO {prefix}_plain (slot, pid) VALUES (%s, %s)", (run.slot, pid)
            )
        await asyncio.sleep(random.uniform(0.0, 0.3))

    stop = asyncio.Event()
    try:
        async with stdin_commands(stop, signals=(signal.SIGTERM,)):
            await sched.start()
            await lock.start()
            print("started", flush=True)
            await stop.wait()
            await lock.shutdown()  # drains: the runs in progress finish first
    finally:
        await sched.shutdown()
        await lock.shutdown()


if __name__ == "__main__":
    asyncio.run(main(*sys.argv[1:4]))
