"""The asyncpg backend's own edges: pooled connections, DSN forms, error mapping."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import pytest

from pgleaderlock import (
    ConfigurationError,
    ConnectionError,
    LeaderLock,
    LockError,
    LockOptions,
    Session,
    SessionNotDedicatedError,
)
from pgleaderlock.core.session import ConnectOptions
from support.fixture_types import LockPids, MakeRecorder
from support.server import driver_connection
from support.timings import lock_args, timings

if TYPE_CHECKING:
    pass

asyncpg = pytest.importorskip("asyncpg")

from pgleaderlock.backends import asyncpg as asyncpg_backend  # noqa: E402
from pgleaderlock.backends.base import translate  # noqa: E402
from support.server import Admin  # noqa: E402

pytestmark = [pytest.mark.integration, pytest.mark.timeout(60)]

FAST: dict[str, Any] = timings(retry_s=0.02, health_interval_s=0.1)


@pytest.fixture
def url(pg_dsn: str, to_url: Callable[..., str]) -> str:
    return str(to_url(pg_dsn))


async def test_pooled_connection_is_refused(
    url: str, keys: tuple[int, int], recorder: MakeRecorder
) -> None:
    pool = await asyncpg.create_pool(url, min_size=1, max_size=2)
    held: list[Any] = []  # asyncpg has no type information
    try:

        async def connect() -> Any:
            conn = await pool.acquire()
            held.append(conn)
            return conn

        lock = LeaderLock(None, *keys, **lock_args(FAST, connect_fn=connect))
        rec = recorder(lock)
        await lock.start()
        await rec.wait_event("stopped", timeout=10)
        assert isinstance(rec.errors()[0], ConfigurationError)
        assert "asyncpg pool" in str(rec.errors()[0])
        with pytest.raises(ConfigurationError, match="asyncpg pool"):
            await lock.wait_for_leadership(1)  # stopped for good: waiting cannot help
        # The refused connection went back to its pool (else close() would wait for it).
        assert pool.get_idle_size() == pool.get_size()
        # A raw Connection that belongs to a pool is refused too.
        conn = await pool.acquire()
        try:
            with pytest.raises(ConfigurationError, match="pool"):
                asyncpg_backend.wrap(conn._con)
        finally:
            await pool.release(conn)
    finally:
        await asyncio.wait_for(pool.close(), 10)


async def test_connect_fn_connection_in_a_transaction_is_rolled_back(
    url: str,
    keys: tuple[int, int],
    admin: Admin,
    holders: LockPids,
) -> None:
    conns: list[Any] = []  # asyncpg has no type information

    async def connect() -> Any:
        conn = await asyncpg.connect(url)
        await conn.transaction().start()
        conns.append(conn)
        return conn

    lock = LeaderLock(None, *keys, **lock_args(FAST, connect_fn=connect))
    try:
        async with lock:
            assert await lock.wait_for_leadership(10)
            assert not conns[-1].is_in_transaction()
            assert await holders(*keys) == [lock.backend_pid]
            await asyncio.sleep(0.3)  # probes
            cur = await admin.execute(
                "SELECT state FROM pg_stat_activity WHERE pid = %s", (lock.backend_pid,)
            )
            row = await cur.fetchone()
            assert row is not None
            assert row[0] in ("idle", "active")
        assert await holders(*keys) == []
    finally:
        for conn in conns:
            conn.terminate()


async def test_dsn_settings_are_kept_and_ours_win(url: str) -> None:
    query = "statement_timeout=12345&application_name=from-dsn"
    async with driver_connection(asyncpg_backend.connect, url, query, "from-options") as conn:
        assert await conn.fetchval("SHOW statement_timeout") == "12345ms"
        assert await conn.fetchval("SHOW application_name") == "from-options"


@pytest.mark.parametrize(
    "dsn",
    ["host=localhost dbname=postgres", "mysql://u@h/db", "postgresql://u@h:notaport/db"],
)
def test_malformed_dsn(dsn: str) -> None:
    with pytest.raises(ConfigurationError, match="malformed DSN"):
        LeaderLock(dsn, 1, 2, options=LockOptions(session=Session(backend="asyncpg")))


def test_scheme_selects_asyncpg_and_is_stripped() -> None:
    lock = LeaderLock("postgresql+asyncpg://u:pw@h/db", 1, 2)
    assert lock.backend is not None
    assert lock.backend.name == "asyncpg"
    assert lock._slot._dsn == "postgresql://u:pw@h/db"


class _Closed:
    def is_closed(self) -> bool:
        return True


class _Open:
    def is_closed(self) -> bool:
        return False


@pytest.mark.parametrize(
    ("exc", "conn", "expected"),
    [
        # What an asyncpg victim of pg_terminate_backend has been seen to raise:
        (
            asyncpg.exceptions.ConnectionDoesNotExistError("closed in the middle"),
            None,
            ConnectionError,
        ),
        (asyncpg.exceptions.InterfaceError("connection is closed"), _Open(), ConnectionError),
        (
            asyncpg.exceptions.InternalClientError("cannot switch to state 11"),
            _Open(),
            ConnectionError,
        ),
        (asyncpg.exceptions.AdminShutdownError("terminating connection"), _Open(), ConnectionError),
        (ConnectionResetError(104, "reset"), _Open(), ConnectionError),
        (TimeoutError(), None, ConnectionError),
        # A server error on a closed session is a connection error too.
        (asyncpg.exceptions.SyntaxOrAccessError("x"), _Closed(), ConnectionError),
        # Server errors on a live session: psycopg's classification, so every backend agrees.
        (asyncpg.exceptions.SyntaxOrAccessError("x"), _Open(), LockError),
        (asyncpg.exceptions.NumericValueOutOfRangeError("x"), _Open(), LockError),
        (asyncpg.exceptions.LockNotAvailableError("x"), _Open(), ConnectionError),
        (asyncpg.exceptions.QueryCanceledError("x"), _Open(), ConnectionError),
        (asyncpg.exceptions.TooManyConnectionsError("x"), _Open(), ConnectionError),
        # Our prepared statement is not on this backend: a transaction-mode pooler.
        (asyncpg.exceptions.InvalidSQLStatementNameError("x"), _Open(), SessionNotDedicatedError),
        (
            asyncpg.exceptions.DuplicatePreparedStatementError("x"),
            _Open(),
            SessionNotDedicatedError,
        ),
    ],
)
def test_error_mapping(exc: BaseException, conn: object, expected: type[Exception]) -> None:
    err = translate(exc, "try_lock", asyncpg_backend._classify(exc, conn))
    assert type(err) is expected
    assert err.__cause__ is exc
    assert str(err).startswith("try_lock: ")


def test_error_messages_are_masked() -> None:
    exc = OSError("could not connect to postgresql://app:hunter2@db/x")
    err = asyncpg_backend._connect_error(exc)
    assert "hunter2" not in str(err)


async def test_vanished_prepared_statements_mean_a_pooler(url: str, keys: tuple[int, int]) -> None:
    """On a transaction-mode pooler the next statement may run on a backend that never
    saw the session's prepared statements: refused like a pid change."""
    session = await asyncpg_backend.connect(url, ConnectOptions("x", 3))
    try:
        assert await session.try_lock(*keys)
        assert await session.holds(*keys)  # the first probe asks pg_locks
        assert await session.holds(*keys)  # later ones only that the session is alive
        await session.connection.execute("DEALLOCATE ALL")  # type: ignore[attr-defined]
        with pytest.raises(SessionNotDedicatedError, match="transaction-mode pooler"):
            await session.holds(*keys)
    finally:
        await session.close()
