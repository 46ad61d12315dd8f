"""One replica of an outbox relay: the leader copies rows from ``outbox`` to ``sink``.

Every replica runs this same program; the one whose lock leads relays. Each batch is
one fenced transaction: ``lock.fenced(conn)`` first, then read the checkpoint, copy the
next rows in order, advance the checkpoint, commit. A transaction that passed the fence
under term *t* and commits is ordered before every transaction of a later leader, so a
stale leader (frozen, its lock session gone, a new leader already relaying) can never
relay a row twice or out of order: its fence raises ``FencedError``, or the new leader's
term bump waits until its transaction has ended.

Run it through ``run.py`` (see README.md), or on its own against tables made by
``run.py --setup-only``::

    PG_DSN=postgresql://user:pass@localhost/db python relay.py
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import signal
import sys
import time
from typing import Any

import psycopg

from pgleaderlock import (
    FencedError,
    Fencing,
    FixedInterval,
    LeaderLock,
    LeaderTasks,
    LockOptions,
    Session,
    Timing,
)

LOCK_NAME = "example-fencing-outbox"
TERMS_TABLE = "outbox_relay_terms"


def say(event: str, **fields: object) -> None:
    """One JSON line on stdout: what ``run.py`` reads."""
    print(json.dumps({"event": event, "pid": os.getpid(), **fields}), flush=True)


def make_lock(dsn: str, fencing: bool = True) -> LeaderLock:
    return LeaderLock.from_name(
        LOCK_NAME,
        dsn,
        retry_strategy=FixedInterval(0.2),
        health_interval_s=1.0,
        options=LockOptions(
            timing=Timing(health_timeout_s=1.0),
            fencing=Fencing(enabled=fencing, table=TERMS_TABLE),
            # the terms table's holder
            session=Session(application_name=f"outbox-relay pid={os.getpid()}"),
        ),
    )


async def relay_batch(
    lock: LeaderLock, conn: psycopg.AsyncConnection[Any], batch: int, hold_s: float
) -> int:
    """Relay up to ``batch`` rows in one fenced transaction; how many it relayed."""
    async with conn.transaction(), lock.fenced(conn) as term:
        return await copy_rows(conn, batch, hold_s, term)


async def relay_batch_unfenced(
    conn: psycopg.AsyncConnection[Any], batch: int, hold_s: float
) -> int:
    """The same without the fence (``--no-fence``): what a plain leader election gives."""
    async with conn.transaction():
        return await copy_rows(conn, batch, hold_s, 0)


async def copy_rows(
    conn: psycopg.AsyncConnection[Any], batch: int, hold_s: float, term: int
) -> int:
    """In the caller's transaction: copy the rows after the checkpoint to the sink, in
    order, and advance the checkpoint; how many."""
    cur = await conn.execute("SELECT last_id FROM relay_checkpoint")
    (last_id,) = await cur.fetchone() or (0,)
    cur = await conn.execute(
        "SELECT id, payload FROM outbox WHERE id > %s ORDER BY id LIMIT %s", (last_id, batch)
    )
    rows = await cur.fetchall()
    if not rows:
        return 0
    await asyncio.sleep(hold_s)  # a slow sink: faults often land mid-transaction
    async with conn.cursor() as insert:
        await insert.executemany(
            "INSERT INTO sink (outbox_id, payload, term) VALUES (%s, %s, %s)",
            [(row_id, payload, term) for row_id, payload in rows],
        )
    await conn.execute("UPDATE relay_checkpoint SET last_id = %s", (rows[-1][0],))
    return len(rows)


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dsn", default=os.environ.get("PG_DSN"))
    parser.add_argument("--batch", type=int, default=20, help="rows per transaction")
    parser.add_argument("--hold-ms", type=float, default=20.0, help="time inside each batch")
    parser.add_argument("--no-fence", action="store_true", help="relay without fencing")
    args = parser.parse_args()
    if not args.dsn:
        sys.exit("set PG_DSN or pass --dsn")

    logging.basicConfig(  # the library's warnings (a lost lock, errors) on stderr
        level=logging.WARNING, format=f"  relay {os.getpid()}: %(name)s: %(message)s"
    )
    lock = make_lock(args.dsn, fencing=not args.no_fence)
    tasks = LeaderTasks(lock)

    @lock.on_acquired
    def acquired() -> None:
        say("leading", term=lock.term)

    @lock.on_lost
    def lost() -> None:
        say("lost")

    @tasks.task
    async def relay() -> None:
        """Runs while this replica leads; cancelled the moment it stops leading."""
        async with await psycopg.AsyncConnection.connect(
            args.dsn, application_name=f"outbox-relay-data pid={os.getpid()}", connect_timeout=5
        ) as conn:
            while True:
                try:
                    if args.no_fence:
                        relayed = await relay_batch_unfenced(conn, args.batch, args.hold_ms / 1000)
                    else:
                        relayed = await relay_batch(lock, conn, args.batch, args.hold_ms / 1000)
                except FencedError as exc:  # a newer leader exists: stop relaying
                    say("fenced", error=str(exc), at=time.time())
                    return
                if not relayed:
                    await asyncio.sleep(0.01)

    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    say("started")
    async with lock:  # start(); on exit shutdown() stops the relay task, then releases
        await stop.wait()
    await tasks.stop()
    say("stopped")


if __name__ == "__main__":
    asyncio.run(main())
