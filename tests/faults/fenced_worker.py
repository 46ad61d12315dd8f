"""A candidate process for tests/faults/test_fencing_faults.py and
test_frozen_leader.py: a fencing ``LeaderLock`` and, only while it leads, a loop of
transactions on a second connection (of the lock's driver), as fast as it can:

    BEGIN; fence(); UPDATE counter SET value = value + 1 RETURNING value;
    INSERT INTO log (value, term, worker) VALUES (...); COMMIT

With ``--no-fence`` the worker skips ``fence()`` and trusts its lock's leadership alone:
it records ``lock.term`` as it was when the transaction began (the lock still bumps its
term, so that the terms of both variants order the leaderships the same way).

Run by path, with the DSN in ``$PGLEADERLOCK_CANDIDATE_DSN``::

    python tests/faults/fenced_worker.py --key1 K1 --key2 K2 --name w1 \\
        --fencing-table T --counter C --log L [--no-fence] \\
        [--backend asyncpg] [--defaults] [--lease S] [--fencing-grace S]

``--defaults`` keeps the library's timings (else short ones for fault runs); ``--lease``
and ``--fencing-grace`` set those knobs.

It prints the JSON lines of ``pgleaderlock.testing.candidate``: ``ready``, ``state``,
``acquired`` (``term``), ``lost``, ``error``, ``exit`` (``commits``, ``fenced``,
``failed``), and its own: ``holding`` (``term``, ``point``), ``fenced`` (``term``, ``held``: a
``FencedError``, rolled back), ``work_error`` and, after a hold, ``committed``
(``value``, ``term``). stdin takes ``hold before`` or
``hold after`` (the next transaction stops before, or after, its fence point until
``go``), ``go`` and ``shutdown``; EOF (the parent is gone) shuts it down too.
"""

from __future__ import annotations

import abc
import argparse
import asyncio
import contextlib
import os
import random
import sys
from pathlib import Path
from typing import Any

import psycopg

from pgleaderlock import (
    FencedError,
    Fencing,
    FixedInterval,
    LeaderLock,
    LockOptions,
    LockState,
    Session,
)
from pgleaderlock.backends import ConnectionError as LockConnectionError
from pgleaderlock.testing.candidate import DSN_ENV, write_event

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/, for support
from support.child import stdin_commands
from support.timings import FAULT_TIMINGS, lock_args

STATEMENT_S = 5.0
"""Bound of each transaction (rescheduled after a hold)."""
HOLD_S = 30.0
"""Bound of a hold: the parent says ``go`` long before."""


class Worker:
    def __init__(self, opts: argparse.Namespace, dsn: str) -> None:
        self.opts = opts
        self.dsn = dsn
        self.name: str = opts.name
        fast = {**FAULT_TIMINGS, "retry_strategy": FixedInterval(0.02), "command_timeout_s": 3.0}
        knobs: dict[str, Any] = {"load_plugins": False} if opts.defaults else fast
        for knob, value in (("lease_s", opts.lease), ("fencing_grace_s", opts.fencing_grace)):
            if value is not None:
                knobs[knob] = value
        self.lock = LeaderLock(
            dsn,
            opts.key1,
            opts.key2,
            **lock_args(
                knobs,
                options=LockOptions(
                    fencing=Fencing(enabled=True, table=opts.fencing_table),
                    session=Session(application_name=f"fenced-{self.name}", backend=opts.backend),
                ),
            ),
        )
        self.db: Work = (
            AsyncpgWork(dsn, self.name)
            if opts.backend == "asyncpg"
            else PsycopgWork(dsn, self.name)
        )
        self.stop = asyncio.Event()
        self.hold: str | None = None  # "before" / "after": at the next transaction
        self.go = asyncio.Event()
        self.commits = self.fenced = self.failed = 0
        self.update = f"UPDATE {opts.counter} SET value = value + 1 WHERE id = 1 RETURNING value"
        self.insert = (
            f"INSERT INTO {opts.log} (value, term, worker) VALUES (%s, %s, %s) RETURNING value"
        )

    def emit(self, event: str, **data: object) -> None:
        write_event(event, self.lock.backend_pid, **data)

    async def run(self) -> None:
        lock = self.lock
        lock.on_state_change(lambda old, new: self.emit("state", old=old.value, new=new.value))
        lock.on_acquired(lambda: self.emit("acquired", term=lock.term))
        lock.on_lost(lambda: self.emit("lost"))
        lock.on_error(lambda exc: self.emit("error", error=f"{type(exc).__name__}: {exc}"[:300]))
        try:
            async with stdin_commands(self.stop, self.command):
                work = asyncio.get_running_loop().create_task(self.work())
                try:
                    await lock.start()
                    self.emit("ready", pid=os.getpid())
                    await self.stop.wait()
                finally:
                    self.stop.set()
                    self.go.set()
                    await asyncio.gather(work, return_exceptions=True)
        finally:
            await lock.shutdown(timeout_s=10)
        self.emit("exit", commits=self.commits, fenced=self.fenced, failed=self.failed)

    def command(self, line: str) -> None:
        if line.startswith("hold "):
            self.go.clear()
            self.hold = line.split()[1]
        elif line == "go":
            self.go.set()

    async def work(self) -> None:
        work = self.db
        try:
            while not self.stop.is_set():
                if self.lock.state is not LockState.LEADER:
                    await asyncio.sleep(0.005)
                    continue
                try:
                    await work.open()
                    await self.transaction(work)
                except FencedError:
                    self.fenced += 1
                except (psycopg.Error, LockConnectionError, OSError, TimeoutError) as exc:
                    self.work_failed(exc)
                except Exception as exc:  # asyncpg's errors, when the work uses asyncpg
                    if not type(exc).__module__.startswith("asyncpg"):
                        raise
                    self.work_failed(exc)
                await asyncio.sleep(random.uniform(0.0, 0.002))
        finally:
            await work.close()

    def work_failed(self, exc: Exception) -> None:
        self.failed += 1
        self.emit("work_error", error=f"{type(exc).__name__}: {exc}"[:200])

    async def transaction(self, work: Work) -> None:
        term = self.lock.term
        if term is None:
            return
        hold, self.hold = self.hold, None
        loop = asyncio.get_running_loop()
        try:
            async with asyncio.timeout(STATEMENT_S) as bound, work.transaction() as conn:
                if hold == "before":
                    bound.reschedule(loop.time() + HOLD_S + STATEMENT_S)
                    await self.wait_for_go(term, hold)
                    bound.reschedule(loop.time() + STATEMENT_S)
                if not self.opts.no_fence:
                    term = await self.lock.fence(conn)
                if hold == "after":
                    bound.reschedule(loop.time() + HOLD_S + STATEMENT_S)
                    await self.wait_for_go(term, hold)
                    bound.reschedule(loop.time() + STATEMENT_S)
                value = await work.value(self.update)
                await work.value(self.insert, value, term, self.name)
        except FencedError:
            self.emit("fenced", term=term, held=hold is not None)
            raise
        self.commits += 1
        if hold is not None:
            self.emit("committed", value=value, term=term)

    async def wait_for_go(self, term: int, point: str) -> None:
        self.emit("holding", term=term, point=point)
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(HOLD_S):
                await self.go.wait()


class Work(abc.ABC):
    """The worker's own connection, on which its transactions run (the driver of the
    lock: psycopg, or asyncpg)."""

    def __init__(self, dsn: str, name: str) -> None:
        self.dsn, self.application_name = dsn, f"fenced-{name}-work"

    @abc.abstractmethod
    async def open(self) -> None:
        """Connect, unless connected."""

    @abc.abstractmethod
    def transaction(self) -> contextlib.AbstractAsyncContextManager[Any]:
        """A transaction; yields the connection to fence."""

    @abc.abstractmethod
    async def value(self, sql: str, *args: object) -> Any:
        """Run ``sql`` (``%s`` placeholders) in the transaction: its first value."""

    @abc.abstractmethod
    async def close(self) -> None:
        """Close the connection, if any."""


class PsycopgWork(Work):
    conn: psycopg.AsyncConnection[tuple[Any, ...]] | None = None

    async def open(self) -> None:
        if self.conn is None or self.conn.closed:
            self.conn = await psycopg.AsyncConnection.connect(
                self.dsn, autocommit=True, connect_timeout=2,
                application_name=self.application_name,
            )  # fmt: skip

    @contextlib.asynccontextmanager
    async def transaction(self) -> Any:
        assert self.conn is not None
        try:
            async with self.conn.transaction():
                yield self.conn
        except psycopg.OperationalError:
            await self.close()  # the session was ended: a new one next time
            raise

    async def value(self, sql: str, *args: object) -> Any:
        assert self.conn is not None
        row = await (await self.conn.execute(sql.encode(), args or None)).fetchone()
        return None if row is None else row[0]

    async def close(self) -> None:
        if self.conn is not None:
            await self.conn.close()
        self.conn = None


class AsyncpgWork(Work):
    conn: Any = None

    async def open(self) -> None:
        import asyncpg

        if self.conn is None or self.conn.is_closed():
            self.conn = await asyncpg.connect(
                self.dsn, timeout=2, server_settings={"application_name": self.application_name}
            )

    @contextlib.asynccontextmanager
    async def transaction(self) -> Any:
        try:
            async with self.conn.transaction():
                yield self.conn
        except BaseException:
            if self.conn.is_closed():
                await self.close()
            raise

    async def value(self, sql: str, *args: object) -> Any:
        n = iter(range(1, len(args) + 1))
        return await self.conn.fetchval(sql.replace("%s", "$%d") % tuple(n) if args else sql, *args)

    async def close(self) -> None:
        if self.conn is not None:
            self.conn.terminate()
        self.conn = None


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--key1", type=int, required=True)
    parser.add_argument("--key2", type=int, required=True)
    parser.add_argument("--name", required=True)
    parser.add_argument("--fencing-table", required=True)
    parser.add_argument("--counter", required=True)
    parser.add_argument("--log", required=True)
    parser.add_argument("--no-fence", action="store_true")
    parser.add_argument("--backend", help="the lock's backend (psycopg: default, asyncpg)")
    parser.add_argument("--defaults", action="store_true", help="the library's own timings")
    parser.add_argument("--lease", type=float, help="lease_s")
    parser.add_argument("--fencing-grace", type=float, help="fencing_grace_s")
    opts = parser.parse_args()
    asyncio.run(Worker(opts, os.environ[DSN_ENV]).run())
    return 0


if __name__ == "__main__":
    sys.exit(main())
