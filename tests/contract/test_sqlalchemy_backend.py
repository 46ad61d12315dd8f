"""The SQLAlchemy backend's own promise: the lock's connection is never one a pool could
hand to someone else, recycle or reset. Against a real server, with both drivers."""

from __future__ import annotations

import asyncio
import importlib.util
from collections.abc import AsyncIterator, Callable
from typing import TYPE_CHECKING, Any

import pytest

from pgleaderlock import ConfigurationError, LeaderLock, LockOptions, LockState, Session
from support.fixture_types import LockPids, MakeRecorder
from support.timings import lock_args, timings

if TYPE_CHECKING:
    pass

sqlalchemy = pytest.importorskip("sqlalchemy")

from sqlalchemy import create_engine, text  # noqa: E402
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine, create_async_engine  # noqa: E402

from pgleaderlock.backends import sqlalchemy as sa_backend  # noqa: E402

S = LockState
pytestmark = [pytest.mark.integration, pytest.mark.timeout(60)]

DRIVERS = ["psycopg"] + (["asyncpg"] if importlib.util.find_spec("asyncpg") else [])
FAST: dict[str, Any] = timings(retry_s=0.02, health_interval_s=0.05)
ADVISORY_HERE = (
    "SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND pid = pg_backend_pid()"
)


@pytest.fixture(params=DRIVERS)
def driver(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture
def url(pg_dsn: str, driver: str, to_url: Callable[..., str]) -> str:
    return str(to_url(pg_dsn, f"postgresql+{driver}"))


@pytest.fixture
async def make_engine(url: str) -> AsyncIterator[Callable[..., AsyncEngine]]:
    """``make_engine(**pool)``: an engine on ``url`` with those pool settings; every
    engine made is disposed of at teardown."""
    made: list[AsyncEngine] = []

    def make(**pool: Any) -> AsyncEngine:
        made.append(create_async_engine(url, **pool))
        return made[-1]

    try:
        yield make
    finally:
        for engine in made:
            await engine.dispose()


@pytest.fixture
def engine(make_engine: Callable[..., AsyncEngine]) -> AsyncEngine:
    return make_engine(pool_size=2, max_overflow=0, pool_timeout=5)


async def pool_pids(engine: AsyncEngine, n: int) -> list[tuple[int, int]]:
    """Check out ``n`` pooled connections at once: (pid, advisory locks it holds)."""
    conns = [await engine.connect() for _ in range(n)]
    try:
        rows = []
        for conn in conns:
            pid = (await conn.execute(text("SELECT pg_backend_pid()"))).scalar_one()
            held = (await conn.execute(text(ADVISORY_HERE))).scalar_one()
            rows.append((pid, held))
        return rows
    finally:
        for conn in conns:
            await conn.close()


async def test_pool_never_holds_the_lock(
    engine: AsyncEngine, keys: tuple[int, int], holders: LockPids
) -> None:
    lock = LeaderLock(engine, *keys, **lock_args(FAST))
    assert lock.connect_options.application_name  # the engine was claimed by sqlalchemy
    async with lock:
        assert await lock.wait_for_leadership(10)
        pid = lock.backend_pid
        assert engine.pool.checkedout() == 0  # type: ignore[attr-defined]  # detached: the pool does not know it
        # Both pool slots are still there for the application, on other sessions.
        pooled = await pool_pids(engine, 2)
        assert pid not in [p for p, _ in pooled]
        assert all(held == 0 for _, held in pooled)
        # Disposing of (or recycling) the pool does not touch the lock's session.
        await engine.dispose()
        await asyncio.sleep(0.3)  # a few health probes
        assert lock.is_leader
        assert lock.backend_pid == pid
        assert await holders(*keys) == [pid]
    # After shutdown() no connection of the engine holds an advisory lock.
    assert await holders(*keys) == []
    pooled = await pool_pids(engine, 2)
    assert all(held == 0 for _, held in pooled)
    assert pid not in [p for p, _ in pooled]


async def test_pool_recycle_does_not_drop_leadership(
    make_engine: Callable[..., AsyncEngine], keys: tuple[int, int], holders: LockPids
) -> None:
    engine = make_engine(pool_size=1, max_overflow=0, pool_recycle=0.1)
    lock = LeaderLock(engine, *keys, **lock_args(FAST))
    rec: list[str] = []
    lock.on_lost(lambda: rec.append("lost"))
    async with lock:
        assert await lock.wait_for_leadership(10)
        pid = lock.backend_pid
        for _ in range(3):
            await asyncio.sleep(0.15)
            await pool_pids(engine, 1)  # the pool recycles its connection each time
        assert lock.is_leader
        assert lock.backend_pid == pid
        assert rec == []
    assert await holders(*keys) == []


async def test_locks_leaked_on_a_pooled_connection_are_released(
    make_engine: Callable[..., AsyncEngine], keys: tuple[int, int], holders: LockPids
) -> None:
    """A pooled connection that someone returned still holding advisory locks: when the
    backend takes it over, it releases them. Otherwise the lock's long-lived session
    would pin them for as long as it leads (and our own key would be held twice)."""
    other = (keys[0], keys[1] ^ 1)
    engine = make_engine(pool_size=1, max_overflow=0)
    async with engine.connect() as conn:
        leaker = (await conn.execute(text("SELECT pg_backend_pid()"))).scalar_one()
        for k1, k2 in (keys, other):
            await conn.execute(text("SELECT pg_advisory_lock(:a, :b)"), {"a": k1, "b": k2})
        await conn.commit()
    assert await holders(*other) == [leaker]  # the pool kept it, locks and all
    lock = LeaderLock(engine, *keys, **lock_args(FAST))
    async with lock:
        assert await lock.wait_for_leadership(10)
        assert lock.backend_pid == leaker  # the same (only) pooled connection
        assert await holders(*other) == []
        assert await holders(*keys) == [leaker]
    assert await holders(*keys) == []


async def test_connect_fn_async_connection_is_detached(
    engine: AsyncEngine, keys: tuple[int, int], holders: LockPids
) -> None:
    user_conns: list[AsyncConnection] = []

    async def connect() -> AsyncConnection:
        conn = await engine.connect()
        await conn.execute(text("SELECT 1"))  # in a transaction now
        user_conns.append(conn)
        return conn

    lock = LeaderLock(None, *keys, **lock_args(FAST, connect_fn=connect))
    async with lock:
        assert await lock.wait_for_leadership(10)
        pid = lock.backend_pid
        assert engine.pool.checkedout() == 0  # type: ignore[attr-defined]
        assert user_conns[-1].invalidated  # the AsyncConnection let go of it
        await user_conns[-1].close()  # and closing it does not close the lock's session
        await asyncio.sleep(0.2)  # kept: a window for a wrong close to show
        assert lock.is_leader
        assert await holders(*keys) == [pid]
    assert await holders(*keys) == []


async def test_connect_fn_unstarted_async_connection_is_refused(
    engine: AsyncEngine, keys: tuple[int, int], recorder: MakeRecorder
) -> None:
    async def connect() -> AsyncConnection:
        return engine.connect()  # forgot the await: not started

    lock = LeaderLock(None, *keys, **lock_args(FAST, connect_fn=connect))
    rec = recorder(lock)
    await lock.start()
    await rec.wait_state(S.STOPPED, timeout=10)
    assert isinstance(rec.errors()[0], ConfigurationError)
    assert "not started" in str(rec.errors()[0])


async def test_url_without_driver_uses_psycopg(
    pg_dsn: str, keys: tuple[int, int], to_url: Callable[..., str]
) -> None:
    lock = LeaderLock(
        to_url(pg_dsn, "postgresql"),
        *keys,
        **lock_args(FAST, options=LockOptions(session=Session(backend="sqlalchemy"))),
    )
    async with lock:
        assert await lock.wait_for_leadership(10)
        assert "PsycopgSession" in repr(lock._slot.session)
        assert "SQLAlchemySession" in repr(lock._slot.session)


@pytest.mark.parametrize(
    ("dsn", "message"),
    [
        ("postgresql+psycopg2://u@h/db", "asyncio driver"),
        ("mysql+aiomysql://u@h/db", "malformed DSN"),
        ("host=localhost dbname=x", "malformed DSN"),
    ],
)
def test_bad_urls_are_configuration_errors(dsn: str, message: str) -> None:
    with pytest.raises(ConfigurationError, match=message):
        LeaderLock(dsn, 1, 2, options=LockOptions(session=Session(backend="sqlalchemy")))


def test_sync_engine_is_refused() -> None:
    engine = create_engine("postgresql+psycopg://u@127.0.0.1/db")
    try:
        with pytest.raises(ConfigurationError, match="AsyncEngine"):
            LeaderLock(engine, 1, 2)
    finally:
        engine.dispose()


def test_claims() -> None:
    engine = create_async_engine("postgresql+psycopg://u@127.0.0.1/db")
    assert sa_backend.claims(engine)
    assert sa_backend.claims("postgresql+asyncpg://u@h/db")
    assert not sa_backend.claims("host=h dbname=db")
    assert not sa_backend.claims(object())
