"""Per-attempt overhead: one try_lock + unlock through the library vs the raw driver.

For every installed backend flavour (psycopg, asyncpg, SQLAlchemy over asyncpg and over
psycopg) this times the round trips the core makes on an acquisition and a release:
``LockSession.try_lock`` then ``LockSession.unlock``, each bounded by the core's
``CallGuard`` exactly as the lifecycle task calls them, next to the raw driver running
the very same statements on its own connection, plainly and inside ``asyncio.timeout()``
(what a careful application would write by hand). The three
are interleaved one iteration at a time, in rotating order, so that the machine's load
(other processes, the server on the same cores) falls on all of them alike. The table
quotes medians; the target is a library overhead under 10%.

Usage::

    python benchmarks/roundtrip.py                       # test-database chain (see docs)
    python benchmarks/roundtrip.py --dsn postgresql://postgres@127.0.0.1:5432/postgres
    python benchmarks/roundtrip.py --rounds 30 --iterations 300 --flavour asyncpg
    python benchmarks/roundtrip.py --profile asyncpg     # where does the library's time go?
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import cProfile
import gc
import importlib.metadata
import os
import platform
import pstats
import statistics
import sys
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

import _common  # noqa: F401 - puts tests/ on sys.path, for support.*
import psycopg
from _common import RAW_SETUP, raw_lock_values

from pgleaderlock.backends import TRY_LOCK, UNLOCK
from pgleaderlock.core.calls import CallGuard
from pgleaderlock.core.registry import available, resolve
from pgleaderlock.core.session import ConnectOptions, LockSession
from support.server import dsn_to_url, resolve_test_dsn

KEYS_LIB = (731_001, 1)
KEYS_RAW = (731_001, 2)
TIMEOUT_S = 5.0
Op = Callable[[], Awaitable[None]]


@dataclass
class Flavour:
    name: str
    backend: str
    scheme: str
    driver: str  # the raw driver to compare with: "psycopg" or "asyncpg"


def flavours() -> list[Flavour]:
    found = []
    names = available()
    have_asyncpg = "asyncpg" in names
    if "psycopg" in names:
        found.append(Flavour("psycopg", "psycopg", "postgresql", "psycopg"))
    if have_asyncpg:
        found.append(Flavour("asyncpg", "asyncpg", "postgresql", "asyncpg"))
    if "sqlalchemy" in names:
        if have_asyncpg:
            found.append(
                Flavour("sqlalchemy+asyncpg", "sqlalchemy", "postgresql+asyncpg", "asyncpg")
            )
        found.append(Flavour("sqlalchemy+psycopg", "sqlalchemy", "postgresql+psycopg", "psycopg"))
    return found


# ------------------------------------------------------------------ the two contenders


def library_op(session: LockSession) -> Op:
    """What the core does per attempt: each call bounded by the lock's CallGuard (the
    same object LeaderLock uses, aborting the session if a call overruns)."""
    k1, k2 = KEYS_LIB
    call = CallGuard(lambda: None)

    async def op() -> None:
        await call(session.try_lock(k1, k2), TIMEOUT_S, interruptible="stop")
        await call(session.unlock(k1, k2), TIMEOUT_S, interruptible="force")

    return op


async def raw_op(driver: str, dsn: str) -> tuple[Op, Op, Callable[[], Awaitable[None]]]:
    """The raw driver running the statements the adapter sends, on its own connection:
    plain, and inside the same ``asyncio.timeout()`` the core uses (to tell the cost of
    the core's bound from the adapter's own)."""
    k1, k2 = KEYS_RAW
    if driver == "psycopg":
        conn = await psycopg.AsyncConnection.connect(dsn, autocommit=True)
        await conn.execute(RAW_SETUP)  # so that it may run the library's own statements
        extra = raw_lock_values(conn.info.backend_pid)
        try_lock = TRY_LOCK.sql(k1, k2, *extra)
        unlock = UNLOCK.sql(k1, k2, *extra[:2])

        async def op() -> None:
            cur = await conn.execute(try_lock)
            await cur.fetchone()
            cur = await conn.execute(unlock)
            await cur.fetchone()

        async def op_timeout() -> None:
            async with asyncio.timeout(TIMEOUT_S):
                cur = await conn.execute(try_lock)
                await cur.fetchone()
            async with asyncio.timeout(TIMEOUT_S):
                cur = await conn.execute(unlock)
                await cur.fetchone()

        return op, op_timeout, conn.close
    import asyncpg

    aconn = await asyncpg.connect(dsn_to_url(dsn, "postgresql"))
    await aconn.execute(RAW_SETUP)
    extra = raw_lock_values(aconn.get_server_pid())
    try_lock_p = TRY_LOCK.sql(*[f"${n}" for n in range(1, 7)])
    unlock_p = UNLOCK.sql(*[f"${n}" for n in range(1, 5)])

    async def aop() -> None:
        await aconn.fetchrow(try_lock_p, k1, k2, *extra)
        await aconn.fetchrow(unlock_p, k1, k2, *extra[:2])

    async def aop_timeout() -> None:
        async with asyncio.timeout(TIMEOUT_S):
            await aconn.fetchrow(try_lock_p, k1, k2, *extra)
        async with asyncio.timeout(TIMEOUT_S):
            await aconn.fetchrow(unlock_p, k1, k2, *extra[:2])

    async def aclose() -> None:
        await aconn.close()

    return aop, aop_timeout, aclose


# ------------------------------------------------------------------ measuring


async def timed(op: Op, iterations: int, out: list[float]) -> None:
    clock = time.perf_counter
    for _ in range(iterations):
        start = clock()
        await op()
        out.append(clock() - start)


@dataclass
class Result:
    flavour: str
    lib: list[float]
    raw: list[float]
    raw_timeout: list[float]

    @staticmethod
    def median(values: list[float]) -> float:
        return statistics.median(values)

    @property
    def overhead(self) -> float:
        """The library over the raw driver."""
        return self.median(self.lib) / self.median(self.raw) - 1

    @property
    def adapter_overhead(self) -> float:
        """The library over the raw driver inside the same asyncio.timeout()."""
        return self.median(self.lib) / self.median(self.raw_timeout) - 1


async def measure(flavour: Flavour, dsn: str, rounds: int, iterations: int) -> Result:
    backend, driver_dsn = resolve(
        flavour.backend, dsn_to_url(dsn, flavour.scheme) if flavour.backend != "psycopg" else dsn
    )
    session = await backend.connect(driver_dsn, ConnectOptions("pgleaderlock-bench", 5.0))
    raw, raw_timeout, raw_close = await raw_op(flavour.driver, dsn)
    lib = library_op(session)
    contenders: list[tuple[Op, list[float]]] = [(lib, []), (raw, []), (raw_timeout, [])]
    try:
        for op, _ in contenders:  # warm up: statement caches, code paths
            await timed(op, max(50, iterations // 5), [])
        gc.collect()
        gc.disable()
        clock = time.perf_counter
        try:
            # Interleaved one iteration at a time, the order rotating, so that the
            # machine's load (other processes, the server) falls on all three alike.
            for i in range(rounds * iterations):
                k = i % len(contenders)
                for op, out in contenders[k:] + contenders[:k]:
                    start = clock()
                    await op()
                    out.append(clock() - start)
        finally:
            gc.enable()
        return Result(flavour.name, *(out for _, out in contenders))
    finally:
        await session.close()
        await raw_close()


async def profile(flavour: Flavour, dsn: str, iterations: int) -> None:
    backend, driver_dsn = resolve(
        flavour.backend, dsn_to_url(dsn, flavour.scheme) if flavour.backend != "psycopg" else dsn
    )
    session = await backend.connect(driver_dsn, ConnectOptions("pgleaderlock-bench", 5.0))
    try:
        op = library_op(session)
        await timed(op, 200, [])
        profiler = cProfile.Profile()
        profiler.enable()
        await timed(op, iterations, [])
        profiler.disable()
    finally:
        await session.close()
    stats = pstats.Stats(profiler)
    stats.sort_stats("tottime").print_stats(25)


# ------------------------------------------------------------------ reporting


def versions() -> str:
    parts = []
    for dist in ("psycopg", "asyncpg", "SQLAlchemy"):
        with contextlib.suppress(importlib.metadata.PackageNotFoundError):
            parts.append(f"{dist} {importlib.metadata.version(dist)}")
    return ", ".join(parts)


async def server_version(dsn: str) -> str:
    async with await psycopg.AsyncConnection.connect(dsn, autocommit=True) as conn:
        cur = await conn.execute("SELECT version()")
        row = await cur.fetchone()
        assert row is not None
        return str(row[0]).split(" on ")[0]


def us(seconds: float) -> str:
    return f"{seconds * 1e6:.1f} µs"


async def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dsn", help="server to use (default: the test-database chain)")
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--iterations", type=int, default=250, help="per round")
    parser.add_argument("--flavour", action="append", help="only these flavours")
    parser.add_argument("--profile", metavar="FLAVOUR", help="cProfile the library path")
    args = parser.parse_args()

    cleanup: Callable[[], None] = lambda: None  # noqa: E731
    description = "given with --dsn"
    dsn = args.dsn or os.environ.get("PG_DSN")
    if not dsn:
        dsn, cleanup, description = resolve_test_dsn()
    try:
        chosen = [f for f in flavours() if not args.flavour or f.name in args.flavour]
        if args.profile:
            flavour = next(f for f in flavours() if f.name == args.profile)
            await profile(flavour, dsn, args.iterations * args.rounds)
            return 0
        print("# pgleaderlock round trip: try_lock + unlock, library vs raw driver\n")
        print(
            f"- machine: {platform.machine()}, {os.cpu_count()} CPUs, {platform.system()} "
            f"{platform.release()}, Python {platform.python_version()}"
        )
        print(f"- server: {await server_version(dsn)} ({description})")
        print(f"- drivers: {versions()}")
        print(
            f"- {args.rounds * args.iterations} iterations per contender, interleaved one "
            "at a time; medians. Each iteration: try_lock + unlock (two round trips)\n"
        )
        print(
            "| backend | library | raw driver | overhead | raw in asyncio.timeout | adapter alone |"
        )
        print("|---|---:|---:|---:|---:|---:|")
        worst = 0.0
        for flavour in chosen:
            r = await measure(flavour, dsn, args.rounds, args.iterations)
            worst = max(worst, r.overhead)
            print(
                f"| {r.flavour} | {us(r.median(r.lib))} | {us(r.median(r.raw))} "
                f"| {r.overhead:+.1%} | {us(r.median(r.raw_timeout))} "
                f"| {r.adapter_overhead:+.1%} |",
                flush=True,
            )
        print(
            "\noverhead = library / raw driver - 1 (target < 10%: "
            f"{'met' if worst < 0.10 else 'MISSED'}); adapter alone = library / raw driver "
            "in asyncio.timeout() - 1."
        )
        return 0
    finally:
        cleanup()


if __name__ == "__main__":
    sys.exit(asyncio.run(main()))
