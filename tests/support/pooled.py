"""Helpers of the tests through a real PgBouncer (tests/deploy/test_poolers_*.py): locks
(one, or a leader and a follower: ``Through``) and plain clients through the pooler,
queries bounded by a timeout, and the settings that a lock may leave on the pooled server
connections, read directly and through the pooler."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable, Iterable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Final, Literal, NamedTuple

import psycopg

from pgleaderlock import FixedInterval, LeaderLock, LockOptions, Session
from pgleaderlock.testing.beliefs import BeliefLog
from support.fixture_types import LockPids, MakeRecorder, Terminate
from support.pgbouncer import PgBouncer, PoolMode
from support.timings import FAULT_TIMINGS, lock_args

if TYPE_CHECKING:
    from conftest import Recorder

Backend = Literal["psycopg", "asyncpg"]
Admin = psycopg.AsyncConnection[tuple[Any, ...]]
PsyConn = psycopg.AsyncConnection[tuple[Any, ...]]
Record = Callable[[str, object], None]

BACKENDS: Final[tuple[Backend, ...]] = ("psycopg", "asyncpg")
POOLED: Final[tuple[PoolMode, ...]] = ("transaction", "statement")

FAST: Final[dict[str, Any]] = {**FAULT_TIMINGS, "retry_strategy": FixedInterval(0.1)}
"""Short timings: a refusal, a loss or a take-over shows within a second or two."""

REFUSAL_BOUND_S: Final = 5.0
"""``wait_for_leadership()`` must raise within this (it takes milliseconds)."""
TAKEOVER_BOUND_S: Final = 10.0
"""A follower must lead within this after the leader is gone (it takes milliseconds)."""
QUERY_TIMEOUT_S: Final = 5.0
FREED_BOUND_S: Final = 5.0
"""A lock whose holder is gone must be free within this (it takes milliseconds)."""


def lock_dsn(bouncer: PgBouncer, backend: Backend) -> str:
    """The pooler's URL with the backend in its scheme (a candidate process has no
    ``backend=`` argument)."""
    return bouncer.dsn().replace("postgresql://", f"postgresql+{backend}://", 1)


def bouncer_lock(
    bouncer: PgBouncer, keys: tuple[int, int], backend: Backend, name: str, **kwargs: Any
) -> LeaderLock:
    return LeaderLock(
        bouncer.dsn(),
        *keys,
        **lock_args(
            {**FAST, **kwargs}, name=name, options=LockOptions(session=Session(backend=backend))
        ),
    )


class LockPair(NamedTuple):
    """Two locks on the same keys through one pooler, in one `BeliefLog`, recorded."""

    beliefs: BeliefLog
    leader: LeaderLock
    follower: LeaderLock
    rec_leader: Recorder
    rec_follower: Recorder


@dataclass(frozen=True)
class Through:
    """Locks of the test's driver on the test's keys through one PgBouncer, and the
    test's fixtures that look at them (``holders``: pg_locks, read on the server
    directly; ``recorder``; ``record_property``). Made by the fixture ``through``."""

    bouncer: PgBouncer
    backend: Backend
    keys: tuple[int, int]
    recorder: MakeRecorder
    holders: LockPids
    record_property: Record

    def lock(self, name: str, keys: tuple[int, int] | None = None) -> LeaderLock:
        """A lock named ``name`` through the pooler (on ``keys``, by default the test's)."""
        return bouncer_lock(self.bouncer, keys or self.keys, self.backend, name)

    async def held(self, keys: tuple[int, int] | None = None) -> list[int]:
        """The server backends that hold ``keys`` (by default the test's)."""
        return await self.holders(*(keys or self.keys))

    def show(self, metric: str, seconds: float) -> None:
        show(self.record_property, metric, seconds)

    @asynccontextmanager
    async def pair(
        self, names: tuple[str, str] = ("leader", "follower")
    ) -> AsyncIterator[LockPair]:
        """Two locks named ``names`` (not started). On the way out both shut down;
        then, if the body passed, the lock must be freed (the time it took is shown)
        and the beliefs must be safe."""
        beliefs = BeliefLog()
        locks = [self.lock(name) for name in names]
        for lock, name in zip(locks, names, strict=True):
            beliefs.attach(lock, name)
        leader, follower = locks
        try:
            yield LockPair(
                beliefs, leader, follower, self.recorder(leader), self.recorder(follower)
            )
        finally:
            await asyncio.gather(leader.shutdown(timeout_s=10), follower.shutdown(timeout_s=10))
        self.show("lock free after both shut down", await assert_freed(self.holders, self.keys))
        beliefs.report().assert_safe()


MakeThrough = Callable[[PgBouncer], Through]
"""The fixture ``through``: ``through(bouncer)``."""


def show(record_property: Record, metric: str, seconds: float) -> None:
    """Print a measured time and record it as a JUnit property (in ms)."""
    print(f"{metric}: {seconds * 1000:.1f} ms")
    record_property(metric, round(seconds * 1000, 2))


@asynccontextmanager
async def plain_client(dsn: str, **kwargs: Any) -> AsyncIterator[PsyConn]:
    """A client as an application has one: autocommit, no prepared statements (a pooled
    mode would break them), nothing set."""
    conn = await psycopg.AsyncConnection.connect(
        dsn, autocommit=True, connect_timeout=5, prepare_threshold=None, **kwargs
    )
    async with conn:
        yield conn


async def fetch(conn: PsyConn, sql: str, params: tuple[Any, ...] | None = None) -> tuple[Any, ...]:
    async with asyncio.timeout(QUERY_TIMEOUT_S):
        cur = await conn.execute(sql, params)
        row = await cur.fetchone()
    assert row is not None
    return row


@asynccontextmanager
async def raw_lock_left_behind(
    bouncer: PgBouncer, keys: tuple[int, int], holders: LockPids, terminate: Terminate
) -> AsyncIterator[int]:
    """A plain client through ``bouncer`` takes the advisory lock ``keys`` with raw SQL
    and disconnects; the server connection that ran the statement must still hold it a
    moment later. Yields that server backend's pid, and terminates it on the way out (the
    only sure way to free the lock: end that server session)."""
    async with plain_client(bouncer.dsn()) as conn:
        taken, server = await fetch(
            conn, "SELECT pg_try_advisory_lock(%s, %s), pg_backend_pid()", keys
        )
        assert taken is True
    try:
        await asyncio.sleep(0.2)
        assert await holders(*keys) == [server]
        yield server
    finally:
        await terminate(server)


async def assert_freed(holders: LockPids, keys: tuple[int, int]) -> float:
    """Wait until no server backend holds the lock (bounded); return how long it took.

    Right after two locks shut down *together* the follower's server backend can be
    granted the lock by the leader's release before the cancellation of its wait
    arrives; its client is gone by then, and PgBouncer resets (or closes) that server
    connection within milliseconds, which frees it."""
    began = time.monotonic()
    while held := await holders(*keys):
        assert time.monotonic() - began < FREED_BOUND_S, f"lock still held by {held}"
        await asyncio.sleep(0.002)
    return time.monotonic() - began


def watched_settings(lock: LeaderLock) -> list[str]:
    """Every setting the lock applies to its own session, and ``statement_timeout``
    (some may be unknown to this server version: see `direct_defaults`)."""
    return sorted({"statement_timeout", *lock.connect_options.server_settings})


def select_settings(names: Iterable[str]) -> str:
    """``SELECT current_setting(%s, true), ...``: NULL for a setting the server does
    not know (the lock skips those too)."""
    return "SELECT " + ", ".join("current_setting(%s, true)" for _ in names)


async def direct_defaults(pg_dsn: str, names: Iterable[str]) -> dict[str, str | None]:
    """What a fresh direct session of the test server sees for ``names``."""
    names = list(names)
    async with plain_client(pg_dsn) as conn:
        row = await fetch(conn, select_settings(names), tuple(names))
    return dict(zip(names, row, strict=True))


async def pooled_server_settings(
    bouncer: PgBouncer, names: Iterable[str]
) -> dict[int, dict[str, str | None]]:
    """What plain clients through the pooler see for ``names``, on *every* server
    connection of the pool: as many clients as the pool has servers each hold one for a
    moment (a short sleep in the same statement), so none is left out.

    Returns:
        Server backend pid -> setting -> value.
    """
    names = list(names)
    sql = select_settings(names).replace("SELECT", "SELECT pg_backend_pid(),", 1)
    sql += ", pg_sleep(0.3)::text"

    async def one() -> tuple[Any, ...]:
        async with plain_client(bouncer.dsn()) as conn:
            return await fetch(conn, sql, tuple(names))

    servers = {int(str(s["remote_pid"])) for s in await asyncio.to_thread(bouncer.show, "SERVERS")}
    clients = max(bouncer.default_pool_size, len(servers))
    rows = await asyncio.gather(*(one() for _ in range(clients)))
    seen = {int(row[0]): dict(zip(names, row[1:-1], strict=True)) for row in rows}
    assert servers <= set(seen), f"servers {servers - set(seen)} were not visited"
    return seen


async def assert_no_settings_left(bouncer: PgBouncer, pg_dsn: str, names: Iterable[str]) -> None:
    names = list(names)
    defaults = await direct_defaults(pg_dsn, names)
    seen = await pooled_server_settings(bouncer, names)
    changed = {
        pid: {n: v for n, v in values.items() if v != defaults[n]}
        for pid, values in seen.items()
        if values != defaults
    }
    assert not changed, (
        f"settings left on pooled server connections: {changed} (defaults {defaults})"
    )
