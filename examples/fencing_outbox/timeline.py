"""Measure one fenced hand-over and print it as a Mermaid sequence diagram.

Two fencing locks in one process: A leads and has a fenced transaction open when its
lock session is terminated (``pg_terminate_backend``); B, queued on the server, is
granted the lock. What happens next is timed from the terminate: B's term bump waits
for A's transaction, A commits under the old term, B leads under the next one, A's
next fence() is refused. The diagram on the docs' Fencing page is this script's output.

    PG_DSN=postgresql://user:pass@localhost/db python timeline.py
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import sys
import time
import uuid
from typing import Any

import psycopg

from pgleaderlock import FencedError, Fencing, FixedInterval, LeaderLock, LockOptions, LockState
from pgleaderlock.backends import key_to_oid

Conn = psycopg.AsyncConnection[Any]
HOLD_S = 0.03  # how long A's transaction stays open after the terminate


class Clock:
    """Milliseconds since the terminate, per event (the first time each is seen)."""

    def __init__(self) -> None:
        self.zero = 0.0
        self.events: dict[str, float] = {}

    def mark(self, event: str) -> None:
        self.events.setdefault(event, (time.monotonic() - self.zero) * 1000)

    def at(self, event: str) -> str:
        return f"{self.events[event]:+.1f} ms" if event in self.events else "(not seen)"


async def watch_server(admin: Conn, lock: LeaderLock, clock: Clock, done: asyncio.Event) -> None:
    """Poll pg_locks and pg_stat_activity: when B's session is granted the advisory lock,
    and when its term bump waits for a row lock."""
    k1, k2 = (key_to_oid(k) for k in lock.keys)
    while not done.is_set():
        pid = lock.backend_pid
        cur = await admin.execute(
            "SELECT EXISTS (SELECT 1 FROM pg_locks WHERE locktype = 'advisory' AND granted"
            " AND objsubid = 2 AND classid = %s::int8::oid AND objid = %s::int8::oid"
            " AND pid = %s), EXISTS (SELECT 1 FROM pg_stat_activity WHERE pid = %s"
            " AND wait_event_type = 'Lock')",
            (k1, k2, pid, pid),
        )
        granted, waits = await cur.fetchone() or (False, False)
        if granted:
            clock.mark("B granted")
        if granted and waits:
            clock.mark("B bump waits")
        await asyncio.sleep(0.0005)


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dsn", default=os.environ.get("PG_DSN"))
    args = parser.parse_args()
    if not args.dsn:
        sys.exit("set PG_DSN or pass --dsn")
    suffix = uuid.uuid4().hex[:8]
    table = f"timeline_terms_{suffix}"
    options = LockOptions(fencing=Fencing(enabled=True, table=table), load_plugins=False)
    name = f"timeline-{suffix}"
    a = LeaderLock.from_name(
        name, args.dsn, retry_strategy=FixedInterval(10.0), health_interval_s=1.0, options=options
    )
    b = LeaderLock.from_name(
        name, args.dsn, retry_strategy=FixedInterval(1.0), health_interval_s=1.0, options=options
    )
    clock = Clock()
    a.on_state_change(
        lambda old, new: clock.mark("A leaves LEADER") if old is LockState.LEADER else None
    )
    b.on_acquired(lambda: clock.mark("B LEADER"))
    async with (
        await psycopg.AsyncConnection.connect(args.dsn, autocommit=True) as admin,
        await psycopg.AsyncConnection.connect(args.dsn) as a_data,
        await psycopg.AsyncConnection.connect(args.dsn) as b_data,
    ):
        try:
            await a.start()
            assert await a.wait_for_leadership(10)
            term = a.term
            await b.start()
            await asyncio.sleep(0.5)  # B's session is queued on the server by now
            done = asyncio.Event()
            watcher = asyncio.create_task(watch_server(admin, b, clock, done))

            async with a_data.transaction():
                assert await a.fence(a_data) == term
                await a_data.execute("SELECT 1")  # the transaction's own work
                clock.zero = time.monotonic()
                await admin.execute("SELECT pg_terminate_backend(%s)", (a.backend_pid,))
                await asyncio.sleep(HOLD_S)
                clock.mark("A commit sent")
            clock.mark("A committed")
            assert await b.wait_for_leadership(10)
            try:
                async with a_data.transaction():
                    await a.fence(a_data)
            except FencedError:
                clock.mark("A fence refused")
            async with b_data.transaction():
                b_term = await b.fence(b_data)
            clock.mark("B fenced")
            done.set()
            await watcher
        finally:
            await asyncio.gather(a.shutdown(timeout_s=10), b.shutdown(timeout_s=10))
            await admin.execute(f"DROP TABLE IF EXISTS {table}".encode())

    lines = {
        "B granted": "PG-->>B: {}: advisory lock granted (polled)",
        "B bump waits": "B->>PG: {}: term bump waits for A's row lock (polled)",
        "A leaves LEADER": "PG-->>A: {}: A's lock session is gone, A leaves LEADER",
        "A committed": "A->>PG: {}: COMMIT of A's transaction (term t) returns",
        "B LEADER": "PG-->>B: {}: bump done (term t+1), B is LEADER",
        "A fence refused": "A->>PG: {}: A's next fence() raises FencedError",
        "B fenced": "B->>PG: {}: B's fence() passes: t+1",
    }
    print("```mermaid")
    print("sequenceDiagram")
    print("    participant A as A (leader, term t)")
    print("    participant PG as PostgreSQL")
    print("    participant B as B (queued for the lock)")
    print("    A->>PG: BEGIN, fence() passes: t, term row FOR SHARE")
    print("    Note over PG: 0 ms: pg_terminate_backend(A's lock session)")
    for event in sorted(lines, key=lambda e: clock.events.get(e, float("inf"))):
        print("    " + lines[event].format(clock.at(event)))
    print("```")
    print(f"t = {term}, t+1 = {b_term}")


if __name__ == "__main__":
    with contextlib.suppress(KeyboardInterrupt):
        asyncio.run(main())
