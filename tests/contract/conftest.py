"""The contract suite's fixtures: one ``target`` per installed backend flavour.

Every test that takes ``target`` runs once per flavour: each backend that
``pgleaderlock.backends.available()`` lists, with SQLAlchemy split into its two drivers
(``sqlalchemy+asyncpg`` through a pooled ``AsyncEngine`` the way an application holds
one, ``sqlalchemy+psycopg`` through a URL string with ``backend="sqlalchemy"``). A
backend registered later, by another distribution, is picked up here without a change:
it gets a ``postgresql://`` URL and ``backend=<its name>``.
"""

from __future__ import annotations

import importlib.util
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import psycopg
import pytest
from psycopg.conninfo import conninfo_to_dict

from pgleaderlock import FixedInterval, LeaderLock, LockSession
from pgleaderlock.backends import available, resolve
from pgleaderlock.core.session import ConnectOptions
from support.server import dsn_to_url

Admin = psycopg.AsyncConnection[tuple[Any, ...]]

FAST: dict[str, Any] = {
    "retry_strategy": FixedInterval(0.02),
    "health_interval_s": 0.1,
    "health_timeout_s": 1.0,
    "connect_timeout_s": 3.0,
    "command_timeout_s": 2.0,
}


@dataclass(frozen=True)
class Flavour:
    """One way of running the library: a backend name, and how the DSN is given."""

    id: str
    backend: str
    scheme: str = "postgresql"  # URL scheme handed to the backend
    engine: bool = False  # give a SQLAlchemy AsyncEngine instead of a URL


def flavours() -> list[Flavour]:
    found: list[Flavour] = []
    for name in available():
        if name == "sqlalchemy":
            if importlib.util.find_spec("asyncpg") is not None:
                found.append(Flavour("sqlalchemy+asyncpg", name, "postgresql+asyncpg", True))
            found.append(Flavour("sqlalchemy+psycopg", name, "postgresql+psycopg"))
        else:
            found.append(Flavour(name, name))
    return found


FLAVOURS = flavours()


@dataclass
class Target:
    """A backend flavour bound to the test server; everything it opens is closed after
    the test."""

    flavour: Flavour
    pg_dsn: str
    locks: list[LeaderLock] = field(default_factory=list)
    sessions: list[LockSession] = field(default_factory=list)
    engines: dict[str, Any] = field(default_factory=dict)
    raw: list[Any] = field(default_factory=list)

    @property
    def id(self) -> str:
        return self.flavour.id

    @property
    def fast(self) -> dict[str, Any]:
        """Fast timings for locks in tests."""
        return dict(FAST)

    def server_address(self) -> tuple[str, int]:
        """(host, port) of the test server, for a proxy in front of it."""
        info = conninfo_to_dict(self.pg_dsn)
        host = str(info.get("host") or "127.0.0.1")
        if host.startswith("/"):
            pytest.skip("the test server is reachable only over a unix socket")
        return host, int(info.get("port") or 5432)

    def url(self, **override: object) -> str:
        return dsn_to_url(self.pg_dsn, self.flavour.scheme, **override)

    def dsn(self, **override: object) -> object:
        """What to pass as ``LeaderLock(dsn)``: a URL, or a (shared) AsyncEngine."""
        url = self.url(**override)
        if not self.flavour.engine:
            return url
        if url not in self.engines:
            from sqlalchemy.ext.asyncio import create_async_engine

            self.engines[url] = create_async_engine(url, pool_size=2, max_overflow=2)
        return self.engines[url]

    def lock(self, keys: tuple[int, int], *, dsn: object = None, **kwargs: Any) -> LeaderLock:
        lock = LeaderLock(
            dsn if dsn is not None else self.dsn(),
            *keys,
            backend=self.flavour.backend,
            **{**FAST, **kwargs},
        )
        self.locks.append(lock)
        return lock

    async def session(
        self, options: ConnectOptions | None = None, **override: object
    ) -> LockSession:
        """A LockSession opened the way the core opens one (Backend.connect)."""
        backend, driver_dsn = resolve(self.flavour.backend, self.dsn(**override))
        backend.check_dsn(driver_dsn)
        session = await backend.connect(
            driver_dsn, options or ConnectOptions(f"pgleaderlock-contract-{self.id}", 3.0)
        )
        self.sessions.append(session)
        return session

    async def require(self, capability: type) -> None:
        """Skip the test unless this backend's sessions have ``capability``
        (``WaitingSession``, ``WatchableSession``): optional for third-party backends."""
        if self.flavour.backend in ("psycopg", "asyncpg", "sqlalchemy"):
            return  # the built-in backends have every capability (checked in the suite)
        session = await self.session()
        if not isinstance(session, capability):
            pytest.skip(f"backend {self.flavour.backend!r} has no {capability.__name__}")

    def require_raw_connections(self) -> None:
        """Skip the test unless :meth:`raw_connect` knows this backend's driver."""
        if self.flavour.backend not in ("psycopg", "asyncpg", "sqlalchemy"):
            pytest.skip(f"no raw connection known for backend {self.flavour.backend!r}")

    async def raw_connect(self, **override: object) -> object:
        """A raw driver connection of this flavour, as a connect_fn would return it: a
        psycopg or asyncpg connection, or a SQLAlchemy AsyncConnection that has begun a
        transaction (the adapter must roll it back)."""
        url = self.url(**override)
        conn: Any
        if self.flavour.backend == "psycopg":
            conn = await psycopg.AsyncConnection.connect(url)  # not autocommit
        elif self.flavour.backend == "asyncpg":
            import asyncpg

            conn = await asyncpg.connect(url)
        elif self.flavour.backend == "sqlalchemy":
            from sqlalchemy import text
            from sqlalchemy.ext.asyncio import create_async_engine

            engine = self.engines.get(url)
            if engine is None:
                engine = self.engines[url] = create_async_engine(url, pool_size=2)
            conn = await engine.connect()
            await conn.execute(text("SELECT 1"))  # autobegin: in a transaction now
        else:
            pytest.skip(f"no raw connection known for backend {self.flavour.backend!r}")
        self.raw.append(conn)
        return conn

    async def aclose(self) -> None:
        for lock in self.locks:
            await lock.shutdown()
        for session in self.sessions:
            await session.close()
        for conn in self.raw:
            try:
                if hasattr(conn, "terminate"):
                    conn.terminate()  # asyncpg
                else:
                    await conn.close()
            except Exception:
                pass
        for engine in self.engines.values():
            await engine.dispose()


@pytest.fixture(params=FLAVOURS, ids=[f.id for f in FLAVOURS])
async def target(request: pytest.FixtureRequest, pg_dsn: str) -> AsyncIterator[Target]:
    """The backend flavour under test, bound to the test server."""
    target = Target(request.param, pg_dsn)
    try:
        yield target
    finally:
        await target.aclose()


async def _run_sql(session: object, query: str) -> tuple[Any, ...]:
    conn = getattr(session, "connection", None)
    if isinstance(conn, psycopg.AsyncConnection):
        cur = await conn.execute(query)
        row = await cur.fetchone()
        assert row is not None
        return tuple(row)
    if type(conn).__module__.startswith("asyncpg"):
        return tuple(await conn.fetchrow(query))  # type: ignore[union-attr]
    pytest.skip(f"cannot run SQL on {type(session).__name__}'s connection")


@pytest.fixture(name="to_url")
def to_url_fixture() -> Callable[..., str]:
    """``to_url(dsn, scheme, **override)``: the test DSN as a URL of that scheme."""
    return dsn_to_url


@pytest.fixture
def run_sql() -> Callable[[object, str], Awaitable[tuple[Any, ...]]]:
    """``await run_sql(session, query)``: the first row of ``query``, run on the
    session's own driver connection (outside the adapter)."""
    return _run_sql


@pytest.fixture
def backend_alive(admin: Admin) -> Callable[[int], Awaitable[bool]]:
    """``await backend_alive(pid)``: is that server process still in pg_stat_activity
    or pg_locks?"""

    async def alive(pid: int) -> bool:
        cur = await admin.execute(
            "SELECT 1 FROM pg_stat_activity WHERE pid = %s UNION SELECT 1 FROM pg_locks"
            " WHERE pid = %s",
            (pid, pid),
        )
        return await cur.fetchone() is not None

    return alive


@pytest.fixture
async def fake_pooler_user(admin: Admin) -> AsyncIterator[str]:
    """A login role whose sessions see another ``pg_backend_pid()`` on every call.

    Its ``search_path`` puts a schema with its own ``pg_backend_pid()`` before
    ``pg_catalog``; that function adds a counter to the real pid. To the library this
    looks exactly like a transaction-mode pooler moving the session between server
    backends, with any driver and without a pooler.
    """
    tag = uuid.uuid4().hex[:10]
    role, schema = f"pgl_pooler_{tag}", f"pgl_pooler_{tag}"
    try:
        await admin.execute(f"CREATE ROLE {role} LOGIN")
    except psycopg.Error as exc:
        pytest.skip(f"cannot create a role on the test server: {exc}")
    try:
        await admin.execute(f"CREATE SCHEMA {schema}")
        await admin.execute(f"CREATE SEQUENCE {schema}.calls")
        await admin.execute(
            f"CREATE FUNCTION {schema}.pg_backend_pid() RETURNS integer LANGUAGE sql AS"
            f" $$ SELECT pg_catalog.pg_backend_pid()"
            f" + pg_catalog.nextval('{schema}.calls')::integer - 1 $$"
        )
        await admin.execute(f"GRANT USAGE ON SCHEMA {schema} TO {role}")
        await admin.execute(f"GRANT USAGE, UPDATE ON SEQUENCE {schema}.calls TO {role}")
        await admin.execute(f"ALTER ROLE {role} SET search_path = {schema}, pg_catalog")
        yield role
    finally:
        await admin.execute(
            "SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE usename = %s", (role,)
        )
        await admin.execute(f"DROP SCHEMA IF EXISTS {schema} CASCADE")
        await admin.execute(f"DROP OWNED BY {role}")
        await admin.execute(f"DROP ROLE {role}")
