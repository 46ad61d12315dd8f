"""A candidate process for tests/faults/test_fencing.py: a fencing ``LeaderLock`` and,
only while it leads, a loop of transactions on a second connection, as fast as it can:

    BEGIN; fence(); UPDATE counter SET value = value + 1 RETURNING value;
    INSERT INTO log (value, term, worker) VALUES (...); COMMIT

With ``--no-fence`` the worker skips ``fence()`` and trusts its lock's leadership alone:
it records ``lock.term`` as it was when the transaction began (the lock still bumps its
term, so that the terms of both variants order the leaderships the same way).

Run by path, with the DSN in ``$PGLEADERLOCK_CANDIDATE_DSN``::

    python tests/faults/fenced_worker.py --key1 K1 --key2 K2 --name w1 \\
        --fencing-table T --counter C --log L [--no-fence]

It prints the JSON lines of ``pgleaderlock.testing.candidate``: ``ready``, ``state``,
``acquired`` (``term``), ``lost``, ``error``, ``exit`` (``commits``, ``fenced``,
``failed``), and its own: ``holding`` (``term``, ``point``), ``fenced`` (``term``, ``held``: a
``FencedError``, rolled back), ``work_error`` and, after a hold, ``committed``
(``value``, ``term``). stdin takes ``hold before`` or
``hold after`` (the next transaction stops before, or after, its fence point until
``go``), ``go`` and ``shutdown``; EOF (the parent is gone) shuts it down too.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import random
import sys
from typing import Any

import psycopg

from pgleaderlock import FencedError, FixedInterval, LeaderLock, LockState
from pgleaderlock.testing.candidate import DSN_ENV, write_event

STATEMENT_S = 5.0
"""Bound of each transaction (rescheduled after a hold)."""
HOLD_S = 30.0
"""Bound of a hold: the parent says ``go`` long before."""


class Worker:
    def __init__(self, opts: argparse.Namespace, dsn: str) -> None:
        self.opts = opts
        self.dsn = dsn
        self.name: str = opts.name
        self.lock = LeaderLock(
            dsn,
            opts.key1,
            opts.key2,
            fencing=True,
            fencing_table=opts.fencing_table,
            application_name=f"fenced-{self.name}",
            retry_strategy=FixedInterval(0.02),
            health_interval_s=0.5,
            health_timeout_s=0.5,
            connect_timeout_s=2.0,
            command_timeout_s=3.0,  # the term bump may wait for a frozen fenced transaction
            load_plugins=False,
        )
        self.stop = asyncio.Event()
        self.hold: str | None = None  # "before" / "after": at the next transaction
        self.go = asyncio.Event()
        self.commits = self.fenced = self.failed = 0
        self.update = f"UPDATE {opts.counter} SET value = value + 1 WHERE id = 1 RETURNING value"
        self.insert = f"INSERT INTO {opts.log} (value, term, worker) VALUES (%s, %s, %s)"

    def emit(self, event: str, **data: object) -> None:
        write_event(event, self.lock.backend_pid, **data)

    async def run(self) -> None:
        lock = self.lock
        lock.on_state_change(lambda old, new: self.emit("state", old=old.value, new=new.value))
        lock.on_acquired(lambda: self.emit("acquired", term=lock.term))
        lock.on_lost(lambda: self.emit("lost"))
        lock.on_error(lambda exc: self.emit("error", error=f"{type(exc).__name__}: {exc}"[:300]))
        loop = asyncio.get_running_loop()
        reader = asyncio.StreamReader()
        transport, _ = await loop.connect_read_pipe(
            lambda: asyncio.StreamReaderProtocol(reader), sys.stdin
        )
        commands = loop.create_task(self.commands(reader))
        work = loop.create_task(self.work())
        try:
            await lock.start()
            self.emit("ready", pid=os.getpid())
            await self.stop.wait()
        finally:
            self.stop.set()
            self.go.set()
            commands.cancel()
            await asyncio.gather(commands, work, return_exceptions=True)
            transport.close()
            await lock.shutdown(timeout_s=10)
        self.emit("exit", commits=self.commits, fenced=self.fenced, failed=self.failed)

    async def commands(self, reader: asyncio.StreamReader) -> None:
        while not self.stop.is_set():
            line = (await reader.readline()).decode().strip()
            if line.startswith("hold "):
                self.go.clear()
                self.hold = line.split()[1]
            elif line == "go":
                self.go.set()
            elif line == "shutdown" or not line:
                self.stop.set()

    async def work(self) -> None:
        conn: psycopg.AsyncConnection[tuple[Any, ...]] | None = None
        try:
            while not self.stop.is_set():
                if self.lock.state is not LockState.LEADER:
                    await asyncio.sleep(0.005)
                    continue
                try:
                    if conn is None or conn.closed:
                        conn = await psycopg.AsyncConnection.connect(
                            self.dsn,
                            autocommit=True,
                            connect_timeout=2,
                            application_name=f"fenced-{self.name}-work",
                        )
                    await self.transaction(conn)
                except FencedError:
                    self.fenced += 1
                except (psycopg.Error, OSError, TimeoutError) as exc:
                    self.failed += 1
                    self.emit("work_error", error=f"{type(exc).__name__}: {exc}"[:200])
                    if conn is not None:
                        await conn.close()
                    conn = None
                    await asyncio.sleep(0.01)
                await asyncio.sleep(random.uniform(0.0, 0.002))
        finally:
            if conn is not None:
                await conn.close()

    async def transaction(self, conn: psycopg.AsyncConnection[tuple[Any, ...]]) -> None:
        term = self.lock.term
        if term is None:
            return
        hold, self.hold = self.hold, None
        loop = asyncio.get_running_loop()
        try:
            async with asyncio.timeout(STATEMENT_S) as bound, conn.transaction():
                if hold == "before":
                    await self.wait_for_go(term, hold)
                    bound.reschedule(loop.time() + STATEMENT_S)
                if not self.opts.no_fence:
                    term = await self.lock.fence(conn)
                if hold == "after":
                    await self.wait_for_go(term, hold)
                    bound.reschedule(loop.time() + STATEMENT_S)
                cur = await conn.execute(self.update.encode())
                row = await cur.fetchone()
                assert row is not None
                await conn.execute(self.insert.encode(), (row[0], term, self.name))
        except FencedError:
            self.emit("fenced", term=term, held=hold is not None)
            raise
        self.commits += 1
        if hold is not None:
            self.emit("committed", value=row[0], term=term)

    async def wait_for_go(self, term: int, point: str) -> None:
        self.emit("holding", term=term, point=point)
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(HOLD_S):
                await self.go.wait()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--key1", type=int, required=True)
    parser.add_argument("--key2", type=int, required=True)
    parser.add_argument("--name", required=True)
    parser.add_argument("--fencing-table", required=True)
    parser.add_argument("--counter", required=True)
    parser.add_argument("--log", required=True)
    parser.add_argument("--no-fence", action="store_true")
    opts = parser.parse_args()
    asyncio.run(Worker(opts, os.environ[DSN_ENV]).run())
    return 0


if __name__ == "__main__":
    sys.exit(main())
