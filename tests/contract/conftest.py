"""The contract suite's fixtures: one ``target`` per installed backend flavour, and the
in-memory fake.

Every test that takes ``target`` runs once per flavour: each backend that
``pgleaderlock.backends.available()`` lists, with SQLAlchemy split into its two drivers
(``sqlalchemy+asyncpg`` through a pooled ``AsyncEngine`` the way an application holds
one, ``sqlalchemy+psycopg`` through a URL string with ``backend="sqlalchemy"``). A
backend registered later, by another distribution, is picked up here without a change:
it gets a ``postgresql://`` URL and ``backend=<its name>``.

The ``fake`` flavour runs the same tests on :class:`~pgleaderlock.testing.FakeServer`,
the stand-in behind the unit tests, so that the fake is held to what PostgreSQL does.
The fixtures that look at the server (``holders``, ``waiters``, ``terminate``,
``backend_alive``) read the fake instead. A test that needs what the fake cannot model
(a network between client and server, SQL on the server, poolers, credentials) says so
with ``@pytest.mark.postgres_only("one-line reason")`` and does not run on the fake.
"""

from __future__ import annotations

import importlib.util
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, NoReturn

import psycopg
import pytest

from pgleaderlock import LeaderLock, LockSession
from pgleaderlock.backends import ConnectOptions
from pgleaderlock.core.registry import available, resolve
from pgleaderlock.core.session import SetupSession
from pgleaderlock.testing import FakeServer
from support.fixture_types import LockPids, Terminate
from support.proxy import tcp_target
from support.server import dsn_to_url
from support.timings import lock_args, timings

Admin = psycopg.AsyncConnection[tuple[Any, ...]]

FAST: dict[str, Any] = timings(retry_s=0.02, health_interval_s=0.1)


@dataclass(frozen=True)
class Flavour:
    """One way of running the library: a backend name, and how the DSN is given."""

    id: str
    backend: str
    scheme: str = "postgresql"  # URL scheme handed to the backend
    engine: bool = False  # give a SQLAlchemy AsyncEngine instead of a URL
    fake: bool = False  # the in-memory FakeServer instead of PostgreSQL


FAKE = Flavour("fake", "fake", fake=True)
BUILTIN = ("psycopg", "asyncpg", "sqlalchemy")


def flavours() -> list[Flavour]:
    found: list[Flavour] = []
    for name in available():
        if name == "sqlalchemy":
            if importlib.util.find_spec("asyncpg") is not None:
                found.append(Flavour("sqlalchemy+asyncpg", name, "postgresql+asyncpg", True))
            found.append(Flavour("sqlalchemy+psycopg", name, "postgresql+psycopg"))
        else:
            found.append(Flavour(name, name))
    return [*found, FAKE]


FLAVOURS = flavours()


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers",
        "postgres_only(reason): the test needs a real PostgreSQL server for something the "
        "fake cannot model; it does not run on the fake flavour",
    )
    config.addinivalue_line(
        "markers",
        "fake_only(reason): the test reads what only the fake can show (e.g. its call "
        "counts); it runs on the fake flavour alone",
    )


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    """Parametrize ``target`` over the flavours; the fake only where it can stand in."""
    if "target" not in metafunc.fixturenames:
        return
    marker = metafunc.definition.get_closest_marker("postgres_only")
    fake_only = metafunc.definition.get_closest_marker("fake_only")
    for name, mark in (("postgres_only", marker), ("fake_only", fake_only)):
        if mark is not None and not (mark.args and str(mark.args[0]).strip()):
            raise pytest.UsageError(f"{metafunc.definition.nodeid}: {name} needs a reason")
    chosen = [f for f in FLAVOURS if not (f.fake and marker is not None)]
    if fake_only is not None:
        chosen = [f for f in chosen if f.fake]
    metafunc.parametrize("target", chosen, ids=[f.id for f in chosen], indirect=True)


def _no_server(what: str) -> NoReturn:
    pytest.fail(
        f"{what}: the fake flavour has no PostgreSQL server; mark the test "
        '@pytest.mark.postgres_only("<why>")'
    )


@dataclass
class Target:
    """A backend flavour bound to the test server; everything it opens is closed after
    the test."""

    flavour: Flavour
    pg_dsn: str = ""  # the test server (not for the fake flavour)
    fake: FakeServer | None = None  # the fake flavour's server
    locks: list[LeaderLock] = field(default_factory=list)
    sessions: list[LockSession] = field(default_factory=list)
    engines: dict[str, Any] = field(default_factory=dict)
    raw: list[Any] = field(default_factory=list)

    @property
    def id(self) -> str:
        return self.flavour.id

    @property
    def fast(self) -> dict[str, Any]:
        """Fast timings for locks in tests, as keyword arguments (``lock_args``)."""
        return lock_args(FAST)

    def server_address(self) -> tuple[str, int]:
        """(host, port) of the test server, for a proxy in front of it."""
        if self.fake is not None:
            _no_server("server_address()")
        return tcp_target(self.pg_dsn)

    def url(self, **override: object) -> str:
        if self.fake is not None:
            _no_server("url()")
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
        if self.fake is not None:
            if dsn is not None:
                _no_server("lock(dsn=...)")
            fake = {"connect_fn": self.fake.connect}
            lock = LeaderLock(None, *keys, **lock_args(fake, FAST, kwargs))
            self.locks.append(lock)
            return lock
        backend = {"backend": self.flavour.backend}
        lock = LeaderLock(
            dsn if dsn is not None else self.dsn(), *keys, **lock_args(backend, FAST, kwargs)
        )
        self.locks.append(lock)
        return lock

    async def session(
        self, options: ConnectOptions | None = None, *, setup: bool = True, **override: object
    ) -> LockSession:
        """A LockSession opened the way the core opens one (Backend.connect, or the
        fake's ``connect_fn``), identified and configured unless ``setup`` is False."""
        if self.fake is not None:
            if options is not None or override:
                _no_server("session(options/overrides)")
            fake_session = await self.fake.connect()
            self.sessions.append(fake_session)
            return fake_session
        backend, driver_dsn = resolve(self.flavour.backend, self.dsn(**override))
        backend.check_dsn(driver_dsn)
        options = options or ConnectOptions(f"pgleaderlock-contract-{self.id}", 3.0)
        session = await backend.connect(driver_dsn, options)
        self.sessions.append(session)
        if setup and isinstance(session, SetupSession):
            await session.identify()
            await session.configure(options)
        return session

    async def require(self, capability: type) -> None:
        """Skip the test unless this backend's sessions have ``capability``
        (``WaitingSession``, ``WatchableSession``): optional for third-party backends."""
        if not self.flavour.fake and self.flavour.backend in BUILTIN:
            return  # the built-in backends have every capability (checked in the suite)
        session = await self.session()
        if not isinstance(session, capability):
            pytest.skip(f"backend {self.flavour.backend!r} has no {capability.__name__}")

    def require_raw_connections(self) -> None:
        """Skip the test unless :meth:`raw_connect` knows this backend's driver."""
        if self.flavour.fake or self.flavour.backend not in BUILTIN:
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


@pytest.fixture
async def target(request: pytest.FixtureRequest) -> AsyncIterator[Target]:
    """The backend flavour under test, bound to the test server (or to a new
    FakeServer for the fake flavour); parametrized by :func:`pytest_generate_tests`."""
    flavour: Flavour = request.param
    if flavour.fake:
        target = Target(flavour, fake=FakeServer())
    else:
        target = Target(flavour, request.getfixturevalue("pg_dsn"))
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


# ---------------------------------------------------------------- looking at the server
#
# On PostgreSQL these are the shared fixtures of tests/conftest.py (pg_locks,
# pg_stat_activity, pg_terminate_backend from an admin session); on the fake flavour
# they read the FakeServer the same way. An overriding fixture that asks for its own name
# gets the one it overrides, so the real ones open an admin session only when used.


class FakeView:
    """What an admin session would see on PostgreSQL, read from a FakeServer."""

    def __init__(self, server: FakeServer) -> None:
        self.server = server

    async def holders(self, key1: int, key2: int) -> list[int]:
        holder = self.server.holder(key1, key2)
        return [] if holder is None else [holder.backend_pid or 0]

    async def waiters(self, key1: int, key2: int) -> list[int]:
        # FakeServer has no public view of its queues; pg_locks shows ungranted rows.
        queue = self.server._waiters.get((key1, key2), [])
        return [session.backend_pid or 0 for session, future in queue if not future.done()]

    async def terminate(self, pid: int | None) -> None:
        assert pid is not None
        for session in self.server.sessions:
            if session.backend_pid == pid:
                self.server.terminate(session)

    async def alive(self, pid: int) -> bool:
        return any(
            s.backend_pid == pid and not (s.closed or s.killed) for s in self.server.sessions
        )


def _fake_view(request: pytest.FixtureRequest) -> FakeView | None:
    """The fake's view when the test runs on the fake flavour, else None."""
    if "target" not in request.fixturenames:
        return None
    target: Target = request.getfixturevalue("target")
    return None if target.fake is None else FakeView(target.fake)


@pytest.fixture
def holders(request: pytest.FixtureRequest) -> LockPids:
    """``await holders(key1, key2)``: pids holding the lock (pg_locks, or the fake)."""
    view = _fake_view(request)
    return view.holders if view is not None else request.getfixturevalue("holders")


@pytest.fixture
def waiters(request: pytest.FixtureRequest) -> LockPids:
    """``await waiters(key1, key2)``: pids queued for the lock (pg_locks, or the fake)."""
    view = _fake_view(request)
    return view.waiters if view is not None else request.getfixturevalue("waiters")


@pytest.fixture
def terminate(request: pytest.FixtureRequest) -> Terminate:
    """``await terminate(pid)``: ``pg_terminate_backend(pid)``, or the fake's."""
    view = _fake_view(request)
    return view.terminate if view is not None else request.getfixturevalue("terminate")


@pytest.fixture
def backend_alive(request: pytest.FixtureRequest) -> Callable[[int], Awaitable[bool]]:
    """``await backend_alive(pid)``: is that server process still in pg_stat_activity
    or pg_locks (or, on the fake, that session still open)?"""
    view = _fake_view(request)
    if view is not None:
        return view.alive
    admin: Admin = request.getfixturevalue("admin")

    async def alive(pid: int) -> bool:
        cur = await admin.execute(
            "SELECT 1 FROM pg_stat_activity WHERE pid = %s UNION SELECT 1 FROM pg_locks"
            " WHERE pid = %s",
            (pid, pid),
        )
        return await cur.fetchone() is not None

    return alive


@pytest.fixture
async def hijacking_role(admin: Admin) -> AsyncIterator[tuple[str, str]]:
    """A login role whose ``search_path`` puts a schema with a ``pg_backend_pid()`` of
    its own before ``pg_catalog`` (that function adds a counter to the real pid): what a
    role's or database's settings can do to every unqualified name. Yields the role and
    the counter (a sequence) that tells whether the impostor ever ran.

    (This used to pose as a transaction-mode pooler, a session whose backend pid moves;
    the library's sessions now never resolve a name through ``search_path``, so only a
    real pooler can, in tests/deploy.)
    """
    tag = uuid.uuid4().hex[:10]
    role, schema = f"pgl_hijack_{tag}", f"pgl_hijack_{tag}"
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
        yield role, f"{schema}.calls"
    finally:
        await admin.execute(
            "SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE usename = %s", (role,)
        )
        await admin.execute(f"DROP SCHEMA IF EXISTS {schema} CASCADE")
        await admin.execute(f"DROP OWNED BY {role}")
        await admin.execute(f"DROP ROLE {role}")
