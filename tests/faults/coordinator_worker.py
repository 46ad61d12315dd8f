"""A replica process for tests/faults/test_coordinator_*.py (``support/coordinator_group.py``
starts it): one ``Coordinator`` running named workers, printing what they do as JSON lines.

Run by path, with the DSN in ``$PGLEADERLOCK_CANDIDATE_DSN``::

    python tests/faults/coordinator_worker.py --group G --mode shared|dedicated \\
        --prefix P --names N [--fencing --log-table L --checkpoint-table C \\
        --fencing-table T] [--name R]

The names are ``P:0`` .. ``P:N-1``. Each worker, while this replica leads its name, runs
until cancelled; with ``--fencing`` it runs transactions in a loop, each::

    BEGIN; pos = load_checkpoint() (fenced); save_checkpoint(pos + 1);
    INSERT INTO L (name, position, term, member) VALUES (...); COMMIT

so the log of a name must hold every position once, with terms that never go back.

It prints the lines of ``pgleaderlock.testing.candidate.write_event``: ``ready``
(``member``, ``pid``), ``begin`` (``name``, ``term``: a worker started),
``end`` (``name``, ``how``: ``cancelled`` or ``returned``), ``status`` (``owned``,
``moves``, ``members``; printed when one changes), ``fenced`` (``name``, ``term``: a
transaction refused by its fence, rolled back), ``work_error`` and, last, ``exit``
(``commits``, ``fenced``, ``moves``). stdin takes ``shutdown``; EOF (the parent is gone),
SIGTERM and SIGINT shut the coordinator down too (its names are released for the others).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import sys
from pathlib import Path
from typing import Any

import psycopg

from pgleaderlock import Coordinator, FencedError, WorkerContext
from pgleaderlock.testing.candidate import DSN_ENV, write_event

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/, for support
from support.child import stdin_commands
from support.timings import FAULT_TIMINGS, lock_args

TRANSACTION_S = 5.0
"""Bound of one fenced transaction."""
PAUSE_S = 0.05
"""Between two fenced transactions of a worker."""
IDLE_TICK_S = 60.0
"""Longer than any bound of the tests (see ``Replica``)."""
STATUS_S = 0.05
"""How often the status is looked at (printed when it changed)."""


class Replica:
    def __init__(self, opts: argparse.Namespace, dsn: str) -> None:
        self.opts = opts
        self.dsn = dsn
        kwargs: dict[str, Any] = {}
        if opts.fencing:
            kwargs.update(
                fencing=True,
                fencing_table=opts.fencing_table,
                checkpoint_table=opts.checkpoint_table,
            )
        # The idle tick (a settled member's look at the group, a safety net) is longer
        # than the tests' bounds for balancing again: every change must be told.
        fast = {**FAULT_TIMINGS, "command_timeout_s": 3.0, "idle_tick_s": IDLE_TICK_S}
        self.coord = Coordinator(
            dsn, **lock_args(fast, kwargs, group=opts.group, sessions=opts.mode)
        )
        for i in range(opts.names):
            self.coord.add(f"{opts.prefix}:{i}", self.work)
        self.stop = asyncio.Event()
        self.commits = self.fenced = 0
        self.insert = (
            f"INSERT INTO {opts.log_table} (name, position, term, member) VALUES (%s, %s, %s, %s)"
        )

    async def run(self) -> None:
        async with stdin_commands(self.stop, signals=(signal.SIGTERM, signal.SIGINT)):
            status = asyncio.get_running_loop().create_task(self.status())
            try:
                await self.coord.start()
                write_event("ready", member=self.coord.member, pid=os.getpid())
                await self.stop.wait()
            finally:
                await self.coord.shutdown()
                status.cancel()
                await asyncio.gather(status, return_exceptions=True)
        self.report_status(force=True)
        write_event("exit", commits=self.commits, fenced=self.fenced, moves=self.coord.moves)

    last: tuple[int, int, int] | None = None

    def report_status(self, *, force: bool = False) -> None:
        now = (len(self.coord.owned), self.coord.moves, len(self.coord.view().members))
        if force or now != self.last:
            self.last = now
            write_event("status", owned=now[0], moves=now[1], members=now[2])

    async def status(self) -> None:
        while True:
            self.report_status()
            await asyncio.sleep(STATUS_S)

    async def work(self, ctx: WorkerContext) -> None:
        write_event("begin", name=ctx.name, term=ctx.term)
        how = "cancelled"
        try:
            if self.opts.fencing:
                await self.fenced_loop(ctx)
            else:
                await asyncio.Event().wait()
            how = "returned"
        finally:
            write_event("end", name=ctx.name, how=how)

    async def fenced_loop(self, ctx: WorkerContext) -> None:
        conn: psycopg.AsyncConnection[tuple[Any, ...]] | None = None
        try:
            while True:
                try:
                    if conn is None:
                        conn = await psycopg.AsyncConnection.connect(
                            self.dsn,
                            autocommit=True,
                            connect_timeout=2,
                            application_name=f"cw-{ctx.member}",
                        )
                    async with asyncio.timeout(TRANSACTION_S), conn.transaction():
                        position = (await ctx.load_checkpoint(conn) or 0) + 1
                        await ctx.save_checkpoint(conn, position)
                        await conn.execute(
                            self.insert.encode(), (ctx.name, position, ctx.term, ctx.member)
                        )
                    self.commits += 1
                except FencedError:
                    self.fenced += 1
                    write_event("fenced", name=ctx.name, term=ctx.term)
                except (psycopg.Error, OSError, TimeoutError) as exc:
                    write_event(
                        "work_error", name=ctx.name, error=f"{type(exc).__name__}: {exc}"[:200]
                    )
                    if conn is not None:
                        await conn.close()
                    conn = None
                await asyncio.sleep(PAUSE_S)
        finally:
            if conn is not None:
                await conn.close()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--group", required=True)
    parser.add_argument("--mode", choices=("shared", "dedicated"), required=True)
    parser.add_argument("--prefix", required=True)
    parser.add_argument("--names", type=int, required=True)
    parser.add_argument("--name", help="the replica's name (for ps; unused)")
    parser.add_argument("--fencing", action="store_true")
    parser.add_argument("--log-table", default="")
    parser.add_argument("--checkpoint-table", default="pgleaderlock_subscriptions")
    parser.add_argument("--fencing-table", default="pgleaderlock_terms")
    opts = parser.parse_args()
    asyncio.run(Replica(opts, os.environ[DSN_ENV]).run())
    return 0


if __name__ == "__main__":
    sys.exit(main())
