"""One replica of a projector service: the ``events`` table projected into read models.

Every replica runs this same program. Two named workers, ``projection:balances`` and
``projection:counts``, are registered on a ``Coordinator`` with ``Fencing(enabled=True)``: each name
is led by exactly one replica of the group at a time, and its worker runs only there,
only while it leads. A worker reads the events after its checkpoint, applies a batch to
its read model, records each event in ``applied_events`` and saves the new checkpoint,
all in one transaction; the checkpoint methods fence that transaction with the name's
term, so a replica that lost the name can never move its checkpoint or commit a batch
after the next leader's. Killed at any point, a replica leaves the read model and the
checkpoint as of its last commit, and the next leader goes on from there: every event is
applied exactly once.

Run it (see README.md)::

    python projector.py --dsn postgresql://user:pass@localhost/db

It prints one JSON line per event on stdout (``started`` with the member id,
``leading``, ``fenced``, ``worker_stopped``, ``stopped``); the library's warnings go to
stderr. SIGTERM or SIGINT shuts it down cleanly: workers stopped, names released.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import os
import signal
import sys
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psycopg

from pgleaderlock import Coordinator, FencedError, Fencing, LockOptions, Timing, WorkerContext

Conn = psycopg.AsyncConnection[tuple[Any, ...]]
Event = tuple[int, str, str, int]  # id, account, kind, amount

SCHEMA = Path(__file__).with_name("schema.sql")
CHANNEL = "projector_events"
STATEMENT_TIMEOUT = "5s"
"""Server-side bound of every statement of a worker's connection."""
BATCH_TIMEOUT_S = 15.0
"""Client-side bound of one batch transaction."""


def say(event: str, **fields: object) -> None:
    """One JSON line on stdout."""
    print(json.dumps({"event": event, "pid": os.getpid(), **fields}), flush=True)


async def connect(dsn: str, application_name: str) -> Conn:
    """A connection with bounded statements: autocommit (each batch opens its own
    transaction), statement and lock timeouts, no transaction left idle for long."""
    conn = await psycopg.AsyncConnection.connect(
        dsn, autocommit=True, connect_timeout=5, application_name=application_name[:63]
    )
    try:
        await conn.execute(
            "SELECT set_config('statement_timeout', %s, false),"
            " set_config('lock_timeout', %s, false),"
            " set_config('idle_in_transaction_session_timeout', '30s', false)",
            (STATEMENT_TIMEOUT, STATEMENT_TIMEOUT),
        )
    except BaseException:
        await conn.close()
        raise
    return conn


async def setup_schema(dsn: str) -> None:
    """Create the example's tables if missing (schema.sql), one replica at a time."""
    async with await connect(dsn, "projector-setup") as conn, conn.transaction():
        await conn.execute("SELECT pg_advisory_xact_lock(hashtext('pgleaderlock-projector'))")
        await conn.execute(SCHEMA.read_text().encode())


# ---------------------------------------------------------------- the projections


async def apply_balances(conn: Conn, events: list[Event]) -> None:
    """``balances``: each account's balance and number of events."""
    await conn.execute(
        "INSERT INTO balances (account, balance, events)"
        " SELECT account, sum(delta), count(*)"
        " FROM unnest(%s::text[], %s::int8[]) AS e(account, delta) GROUP BY account"
        " ON CONFLICT (account) DO UPDATE SET balance = balances.balance + EXCLUDED.balance,"
        " events = balances.events + EXCLUDED.events",
        (
            [account for _, account, _, _ in events],
            [amount if kind == "deposit" else -amount for _, _, kind, amount in events],
        ),
    )


async def apply_counts(conn: Conn, events: list[Event]) -> None:
    """``event_counts``: the number and total amount of events of each kind."""
    await conn.execute(
        "INSERT INTO event_counts (kind, events, amount)"
        " SELECT kind, count(*), sum(amount)"
        " FROM unnest(%s::text[], %s::int8[]) AS e(kind, amount) GROUP BY kind"
        " ON CONFLICT (kind) DO UPDATE SET events = event_counts.events + EXCLUDED.events,"
        " amount = event_counts.amount + EXCLUDED.amount",
        ([kind for _, _, kind, _ in events], [amount for _, _, _, amount in events]),
    )


@dataclass(frozen=True)
class Projection:
    name: str
    apply: Callable[[Conn, list[Event]], Awaitable[None]]


PROJECTIONS = (
    Projection("projection:balances", apply_balances),
    Projection("projection:counts", apply_counts),
)


# ---------------------------------------------------------------- the worker


async def apply_batch(
    conn: Conn, ctx: WorkerContext, projection: Projection, size: int, hold_s: float
) -> int:
    """One transaction: the events after the checkpoint, applied to the read model and
    the ledger, and the new checkpoint. How many events it applied."""
    async with asyncio.timeout(BATCH_TIMEOUT_S), conn.transaction():
        position = await ctx.load_checkpoint(conn) or 0  # fenced
        cur = await conn.execute(
            "SELECT id, account, kind, amount FROM events WHERE id > %s ORDER BY id LIMIT %s",
            (position, size),
        )
        events: list[Event] = await cur.fetchall()
        if not events:
            return 0
        await projection.apply(conn, events)
        await conn.execute(
            "INSERT INTO applied_events (projection, event_id, term)"
            " SELECT %s, unnest(%s::int8[]), %s",
            (projection.name, [e[0] for e in events], ctx.term),
        )
        if hold_s:
            await asyncio.sleep(hold_s)  # a slow read model: kills land mid-transaction
        await ctx.save_checkpoint(conn, events[-1][0])  # fenced, commits with the batch
        return len(events)


async def wait_for_events(conn: Conn, timeout_s: float) -> None:
    """Until an insert into ``events`` is notified, or ``timeout_s`` (a safety net)."""
    async for _ in conn.notifies(timeout=timeout_s, stop_after=1):
        pass


def make_worker(
    dsn: str, projection: Projection, size: int, hold_s: float, poll_s: float
) -> Callable[[WorkerContext], Awaitable[None]]:
    async def worker(ctx: WorkerContext) -> None:
        """Runs while this replica leads ``projection.name``; cancelled the moment it
        does not. A crash (a lost connection) restarts it from the checkpoint."""
        say("leading", name=ctx.name, term=ctx.term, member=ctx.member)
        applied = 0
        try:
            async with await connect(dsn, f"projector:{ctx.member}:{ctx.name}") as conn:
                await conn.execute(f"LISTEN {CHANNEL}")
                while True:
                    count = await apply_batch(conn, ctx, projection, size, hold_s)
                    applied += count
                    if count < size:
                        await wait_for_events(conn, poll_s)
        except FencedError as exc:
            # A newer leadership of this name has begun: this one is over (the
            # coordinator cancels the worker in a moment anyway).
            say("fenced", name=ctx.name, term=ctx.term, error=str(exc))
        finally:
            say("worker_stopped", name=ctx.name, term=ctx.term, applied=applied)

    return worker


# ---------------------------------------------------------------- main


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dsn", default=os.environ.get("PG_DSN"))
    parser.add_argument("--group", default="projectors", help="the coordinator group")
    parser.add_argument("--sessions", choices=("dedicated", "shared"), default="dedicated")
    parser.add_argument("--batch", type=int, default=100, help="events per transaction")
    parser.add_argument("--hold-ms", type=float, default=0.0, help="time inside each batch")
    parser.add_argument("--poll-s", type=float, default=1.0, help="longest wait for a NOTIFY")
    args = parser.parse_args()
    if not args.dsn:
        sys.exit("set PG_DSN or pass --dsn")

    logging.basicConfig(  # the library's warnings (lost names, worker crashes) on stderr
        level=logging.WARNING, format=f"  projector {os.getpid()}: %(name)s: %(message)s"
    )
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    await setup_schema(args.dsn)
    coord = Coordinator(
        args.dsn,
        group=args.group,
        sessions=args.sessions,
        health_interval_s=1.0,
        options=LockOptions(
            timing=Timing(health_timeout_s=1.0),
            fencing=Fencing(enabled=True),  # terms per name: fenced checkpoints
        ),
    )
    for projection in PROJECTIONS:
        coord.add(
            projection.name,
            make_worker(args.dsn, projection, args.batch, args.hold_ms / 1000, args.poll_s),
        )

    async with coord:  # start(); on exit shutdown(): workers stopped, names released
        say("started", member=coord.member, group=coord.group, sessions=coord.sessions)
        await stop.wait()
    say("stopped", member=coord.member)


if __name__ == "__main__":
    with contextlib.suppress(KeyboardInterrupt):
        asyncio.run(main())
