"""The counters and helpers of ``overhead.py``: calls into a session, log records by
level, the server's statement counters, and locks started and shut down in bulk.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import os
import resource
from collections.abc import Awaitable, Callable
from typing import Any, ClassVar

import psycopg

from pgleaderlock import LeaderLock, LockOptions
from pgleaderlock.backends.psycopg import PsycopgSession


class Calls:
    """Counts the calls into every ``PsycopgSession`` of this process (a wrapper on the
    class: the library itself is not changed)."""

    counts: ClassVar[collections.Counter[str]] = collections.Counter()

    @classmethod
    def install(cls) -> None:
        """Wrap the session methods that issue a statement."""
        for name in ("try_lock", "unlock", "wait_lock", "holds"):
            original = getattr(PsycopgSession, name)
            if getattr(original, "_counted", False):
                continue

            def make(method: str, fn: Callable[..., Awaitable[Any]]) -> Callable[..., Any]:
                async def counted(self: PsycopgSession, *args: Any) -> Any:
                    cls.counts[method] += 1
                    return await fn(self, *args)

                counted._counted = True  # type: ignore[attr-defined]
                return counted

            setattr(PsycopgSession, name, make(name, original))

    @classmethod
    def total(cls) -> int:
        """Statements issued through sessions so far."""
        return sum(cls.counts.values())


class LogCounter(logging.Handler):
    """Counts the library's warnings and errors by event name instead of printing them."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.counts: collections.Counter[str] = collections.Counter()
        self.samples: dict[str, str] = {}

    def emit(self, record: logging.LogRecord) -> None:
        fields = getattr(record, "pgleaderlock", {})
        key = f"{record.levelname.lower()}:{fields.get('name', record.msg)}"
        self.counts[key] += 1
        self.samples.setdefault(key, record.getMessage())

    def report(self, section: str) -> None:
        """Print what the library logged during ``section`` (with one example each)."""
        for key, count in self.counts.items():
            print(f"\n[{section}] the library logged {key} x{count}, e.g.: {self.samples[key]}")
        self.counts.clear()
        self.samples.clear()


LOG_COUNTER = LogCounter()


class Server:
    """An admin session that reads the server's statement counters."""

    def __init__(self, conn: psycopg.AsyncConnection[Any]) -> None:
        self.conn = conn
        self.statements = False

    @classmethod
    async def connect(cls, dsn: str) -> Server:
        """Connect; enable ``pg_stat_statements`` if the server has it loaded."""
        server = cls(await psycopg.AsyncConnection.connect(dsn, autocommit=True))
        try:
            await server.conn.execute("CREATE EXTENSION IF NOT EXISTS pg_stat_statements")
            await server.conn.execute("SELECT pg_stat_statements_reset()")
            server.statements = True
        except psycopg.Error:
            server.statements = False
        return server

    async def counters(self) -> dict[str, int]:
        """Probes and all statements (pg_stat_statements) and committed transactions."""
        out: dict[str, int] = {}
        if self.statements:
            cur = await self.conn.execute(
                "SELECT coalesce(sum(calls) FILTER (WHERE query LIKE '%pg_catalog.pg_locks%'), 0),"
                " coalesce(sum(calls), 0) FROM pg_stat_statements"
                " WHERE query NOT LIKE '%pg_stat%' AND query NOT LIKE '%pg_stat_statements%'"
            )
            row = await cur.fetchone()
            assert row is not None
            out["probes"], out["statements"] = int(row[0]), int(row[1])
        cur = await self.conn.execute(
            "SELECT xact_commit FROM pg_stat_database WHERE datname = current_database()"
        )
        row = await cur.fetchone()
        out["xact_commit"] = int(row[0]) if row else 0
        return out

    async def close(self) -> None:
        """Close the admin session."""
        await self.conn.close()


NO_PLUGINS = LockOptions(load_plugins=False)


def make_locks(dsn: str, prefix: str, count: int, **kwargs: Any) -> list[LeaderLock]:
    """``count`` locks with distinct names (so distinct keys): all of them can lead."""
    pid = os.getpid()
    return [
        LeaderLock.from_name(f"{prefix}-{pid}-{i}", dsn=dsn, options=NO_PLUGINS, **kwargs)
        for i in range(count)
    ]


async def start_and_lead(locks: list[LeaderLock], timeout_s: float) -> int:
    """Start every lock; return how many became leader within ``timeout_s``."""
    await asyncio.gather(*(lock.start() for lock in locks))
    leading = await asyncio.gather(*(lock.wait_for_leadership(timeout_s) for lock in locks))
    return sum(leading)


async def shutdown_all(locks: list[LeaderLock]) -> None:
    """Shut every lock down (concurrently)."""
    await asyncio.gather(*(lock.shutdown(timeout_s=30) for lock in locks), return_exceptions=True)


def cpu_seconds() -> float:
    """User + system CPU time of this process."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def mib(n_bytes: float) -> str:
    """Bytes as MiB."""
    return f"{n_bytes / 2**20:.1f} MiB"


def kib(n_bytes: float) -> str:
    """Bytes as KiB."""
    return f"{n_bytes / 1024:.0f} KiB"
