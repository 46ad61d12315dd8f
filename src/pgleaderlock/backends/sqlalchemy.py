"""The SQLAlchemy backend: a dedicated driver connection obtained through SQLAlchemy.

Give ``LeaderLock`` an ``AsyncEngine`` (``create_async_engine(...)``) as its ``dsn``, or
a URL with ``backend="sqlalchemy"``; ``connect_fn`` may also return a started
``AsyncConnection``. Both ``postgresql+asyncpg://`` and ``postgresql+psycopg://`` work
(a URL without a driver uses psycopg).

How the lock's connection is kept out of every pool: the backend checks a connection
out of the engine's pool, takes the driver connection (``asyncpg.Connection`` or
``psycopg.AsyncConnection``) and **detaches** it from the pool
(``PoolProxiedConnection.detach()``). From then on the pool no longer knows the
connection: it cannot hand it to anyone else, recycle it (``pool_recycle``), reset it
on return, or close it on ``engine.dispose()``, and its slot in the pool is free again
at once. The lock owns the connection and closes it itself; the same I/O adapters as
the asyncpg and psycopg backends run on it. A URL gets an engine of its own with a
``NullPool`` (one per URL, holding no connections), so nothing is ever pooled there.

A connection from your engine's pool may carry session state from earlier use: the
backend rolls back an open transaction, switches to autocommit, releases any
session-level advisory lock the connection still holds (left behind by earlier use, it
would otherwise stay held for as long as the lock's long-lived session lives) and sets
``application_name`` and the lock's server settings (``set_config``), in one round trip.
"""

from __future__ import annotations

import asyncio
import functools
import re
import sys
from collections.abc import Awaitable, Callable, Sequence
from contextlib import AbstractAsyncContextManager
from typing import Any, cast

import psycopg
from sqlalchemy import Engine, make_url, text
from sqlalchemy.engine import URL, Dialect
from sqlalchemy.exc import ArgumentError
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine, AsyncSession, create_async_engine
from sqlalchemy.pool import NullPool

from ..lowlevel import (
    BackendUnavailableError,
    ConfigurationError,
    ConnectionError,
    ConnectOptions,
    FencedSessions,
    LibraryTable,
    LockSession,
    SessionInfo,
    TermTable,
    mask_dsn,
)
from .base import check_target_session_attrs, malformed_dsn, module_backend, translate
from .psycopg import PsycopgSession

__all__ = ["SQLAlchemySession", "backend", "check_dsn", "claims", "connect", "wrap"]

# SQLAlchemy driver name -> (adapter, pip extra that installs the driver)
_DRIVERS = {
    "asyncpg": ("asyncpg", "pgleaderlock[sqlalchemy]"),
    "psycopg": ("psycopg", "pgleaderlock[sqlalchemy]"),
    "psycopg_async": ("psycopg", "pgleaderlock[sqlalchemy]"),
}
_DEFAULT_DRIVER = "psycopg"
_URL = re.compile(r"^postgres(?:ql)?(?:\+[A-Za-z0-9_]+)?://", re.I)

_Inner = Any  # PsycopgSession or AsyncpgSession (asyncpg is optional, imported lazily)


def _connect_error(exc: BaseException, where: str) -> Exception:
    # SQLAlchemy wraps driver errors (DBAPIError, with the SQL and a link on later
    # lines): the message names the driver's own error, the cause is SQLAlchemy's.
    err = translate(getattr(exc, "orig", None) or exc, f"connect ({where})", ConnectionError)
    err.__cause__ = exc
    return err


def _adapter(driver_connection: object) -> _Inner:
    """The pgleaderlock I/O adapter for a driver connection taken from SQLAlchemy."""
    if isinstance(driver_connection, psycopg.AsyncConnection):
        return PsycopgSession(driver_connection)
    asyncpg = sys.modules.get("asyncpg")  # a live asyncpg connection means it is imported
    if asyncpg is not None and isinstance(driver_connection, asyncpg.Connection):
        from .asyncpg import AsyncpgSession

        return AsyncpgSession(driver_connection)
    raise ConfigurationError(
        f"SQLAlchemy gave a {type(driver_connection).__module__}."
        f"{type(driver_connection).__qualname__} connection; pgleaderlock supports the "
        "postgresql+asyncpg and postgresql+psycopg drivers"
    )


class SQLAlchemySession:
    """A [`LockSession`][pgleaderlock.LockSession] over a driver connection detached from a
    SQLAlchemy pool.

    The statements run through the asyncpg or psycopg adapter on the driver connection
    (the same code as the ``asyncpg`` and ``psycopg`` backends).

    Args:
        driver_connection: an ``asyncpg.Connection`` or ``psycopg.AsyncConnection``
            that no pool knows of any more.
        origin: where it came from, for ``repr()`` (a masked URL).
    """

    def __init__(self, driver_connection: object, *, origin: str = "") -> None:
        self._driver = driver_connection
        self._inner: _Inner = _adapter(driver_connection)
        self._origin = origin

    @property
    def connection(self) -> Any:
        """The underlying driver connection (``asyncpg.Connection`` or
        ``psycopg.AsyncConnection``)."""
        return self._driver

    @property
    def backend_pid(self) -> int | None:
        pid: int | None = self._inner.backend_pid
        return pid

    async def identify(self, options: ConnectOptions | None = None) -> SessionInfo:
        """Roll back what the connection's earlier user left open and report who serves
        it (``SetupSession``)."""
        info: SessionInfo = await self._inner.identify(options)
        return info

    async def backend_now(self) -> int:
        """Ask for the backend again (``SetupSession``)."""
        pid: int = await self._inner.backend_now()
        return pid

    async def configure(self, options: ConnectOptions) -> None:
        """Apply the lock's settings; free advisory locks left by the connection's
        earlier use in the engine's pool (``SetupSession``)."""
        await self._inner.configure(options)

    async def try_lock_many(self, keys: list[tuple[int, int]]) -> list[tuple[int, int]]:
        granted: list[tuple[int, int]] = await self._inner.try_lock_many(keys)
        return granted

    async def unlock_many(self, keys: list[tuple[int, int]]) -> int:
        count: int = await self._inner.unlock_many(keys)
        return count

    async def bump_terms(
        self, table: TermTable, keys: list[tuple[int, int]], wait_s: float
    ) -> dict[tuple[int, int], int] | None:
        terms: dict[tuple[int, int], int] | None = await self._inner.bump_terms(table, keys, wait_s)
        return terms

    async def end_fenced(self, table: TermTable, keys: list[tuple[int, int]]) -> FencedSessions:
        """End the fenced transactions of older terms (``FencingSession``)."""
        ended: FencedSessions = await self._inner.end_fenced(table, keys)
        return ended

    async def group_snapshot(self, prefix: str, trusted_roles: Sequence[str] = ()) -> list[Any]:
        rows: list[Any] = await self._inner.group_snapshot(prefix, trusted_roles)
        return rows

    async def notify(self, channel: str, payload: str) -> None:
        await self._inner.notify(channel, payload)

    async def prepare_table(self, table: LibraryTable) -> None:
        await self._inner.prepare_table(table)

    async def query(self, template: str, values: tuple[object, ...]) -> list[tuple[Any, ...]]:
        rows: list[tuple[Any, ...]] = await self._inner.query(template, values)
        return rows

    async def listen(self, channel: str) -> None:
        await self._inner.listen(channel)

    async def notifications(self, timeout_s: float) -> list[tuple[int, str]]:
        received: list[tuple[int, str]] = await self._inner.notifications(timeout_s)
        return received

    async def ping(self) -> None:
        await self._inner.ping()

    async def bump_term(self, table: TermTable, key1: int, key2: int, wait_s: float) -> int | None:
        """Increment the lock's fencing term (``FencingSession``)."""
        term: int | None = await self._inner.bump_term(table, key1, key2, wait_s)
        return term

    async def try_lock(self, key1: int, key2: int) -> bool:
        return bool(await self._inner.try_lock(key1, key2))

    async def unlock(self, key1: int, key2: int) -> bool:
        return bool(await self._inner.unlock(key1, key2))

    async def holds(self, key1: int, key2: int) -> bool:
        return bool(await self._inner.holds(key1, key2))

    async def wait_lock(self, key1: int, key2: int, timeout_s: float) -> bool:
        return bool(await self._inner.wait_lock(key1, key2, timeout_s))

    async def wait_lock_once(self, key1: int, key2: int, timeout_s: float) -> bool:
        return bool(await self._inner.wait_lock_once(key1, key2, timeout_s))

    def start_probe(self) -> asyncio.Future[None] | None:
        """The periodic probe as a future: the driver adapter's."""
        probe: asyncio.Future[None] | None = self._inner.start_probe()
        return probe

    def keep_alive(self) -> asyncio.Future[None] | None:
        """Renew the session's lease (``KeepAliveSession``): the driver adapter's."""
        alive: asyncio.Future[None] | None = self._inner.keep_alive()
        return alive

    def acknowledged(self) -> bool | None:
        """Has the server acknowledged everything this session sent (TCP)?"""
        acked: bool | None = self._inner.acknowledged()
        return acked

    def watch(self, callback: Callable[[], None] | None) -> None:
        self._inner.watch(callback)

    def abort(self) -> None:
        self._inner.abort()

    async def close(self) -> None:
        await self._inner.close()

    def __repr__(self) -> str:
        return f"<SQLAlchemySession {self._origin} via {self._inner!r}>"


def _check_dialect(dialect: Dialect) -> None:
    if dialect.name != "postgresql":
        raise ConfigurationError(
            f"the sqlalchemy backend needs a PostgreSQL engine, got dialect {dialect.name!r}"
        )
    if not dialect.is_async or dialect.driver not in _DRIVERS:
        raise ConfigurationError(
            f"the sqlalchemy backend needs an asyncio driver, postgresql+asyncpg or "
            f"postgresql+psycopg; got postgresql+{dialect.driver}"
        )


def _url(dsn: str) -> URL:
    """Parse a URL; ``postgres``/``postgresql`` without a driver means psycopg."""
    if not _URL.match(dsn):
        raise malformed_dsn(
            dsn,
            "the sqlalchemy backend needs a URL such as"
            " postgresql+asyncpg://user@host/dbname or an AsyncEngine",
        )
    try:
        url = make_url(dsn)
    except (ArgumentError, ValueError) as exc:
        raise malformed_dsn(dsn, exc) from None
    driver = url.get_driver_name() if "+" in url.drivername else _DEFAULT_DRIVER
    if driver not in _DRIVERS:
        raise ConfigurationError(
            f"the sqlalchemy backend needs an asyncio driver, postgresql+asyncpg or "
            f"postgresql+psycopg; got postgresql+{driver}"
        )
    attrs = url.query.get("target_session_attrs")
    check_target_session_attrs(attrs if isinstance(attrs, str) else None, dsn)
    return url.set(drivername=f"postgresql+{driver}")


@functools.lru_cache(maxsize=32)
def _engine(dsn: str) -> AsyncEngine:
    """The NullPool engine for a URL: it never holds a connection, so one per URL is
    shared by every lock (and every event loop)."""
    url = _url(dsn)
    try:
        return create_async_engine(url, poolclass=NullPool)
    except ImportError as exc:
        _, extra = _DRIVERS[url.get_driver_name()]
        raise BackendUnavailableError(
            f"the SQLAlchemy URL {url.drivername}:// needs a driver that is not installed "
            f"({exc}); install it with: pip install '{extra}'"
        ) from exc


def claims(obj: object) -> bool:
    """True for a SQLAlchemy ``AsyncEngine`` (or ``Engine``, refused with a clear error by
    [`check_dsn`][pgleaderlock.backends.sqlalchemy.check_dsn]), and for a
    ``postgresql[+driver]://`` URL when ``backend="sqlalchemy"`` is asked for by name."""
    if isinstance(obj, AsyncEngine | Engine):
        return True
    return isinstance(obj, str) and bool(_URL.match(obj))


def check_dsn(dsn: object) -> None:
    """Raise unless ``dsn`` is an ``AsyncEngine`` or URL of a supported asyncio driver.

    Raises:
        ConfigurationError: not an ``AsyncEngine`` or a PostgreSQL URL, a synchronous
            engine, or a driver other than asyncpg or psycopg.
        BackendUnavailableError: the URL's driver is not installed.
    """
    if isinstance(dsn, AsyncEngine):
        _check_dialect(dsn.dialect)
    elif isinstance(dsn, Engine):
        raise ConfigurationError(
            "got a synchronous SQLAlchemy Engine; pass an AsyncEngine "
            "(sqlalchemy.ext.asyncio.create_async_engine) or a URL"
        )
    elif isinstance(dsn, str):
        _engine(dsn)
    else:
        raise ConfigurationError(
            f"the sqlalchemy backend needs an AsyncEngine or a URL, got {type(dsn).__name__}"
        )


async def connect(dsn: AsyncEngine | str, options: ConnectOptions) -> LockSession:
    """Open a dedicated session: a connection from the engine's pool, detached from it.

    Args:
        dsn: an ``AsyncEngine`` (its pool, connect arguments and events are used) or a
            URL (an engine with a ``NullPool`` is made for it).
        options: ``application_name`` and the server settings, applied with
            ``set_config`` right after the connection is taken over.
    """
    engine = dsn if isinstance(dsn, AsyncEngine) else _engine(dsn)
    _check_dialect(engine.dialect)
    origin = mask_dsn(engine.url.render_as_string(hide_password=True))
    try:
        proxied = await engine.raw_connection()
    except Exception as exc:
        raise _connect_error(exc, origin) from exc
    driver_connection = proxied.driver_connection  # read it first: detach() clears it
    proxied.detach()
    return SQLAlchemySession(driver_connection, origin=origin)


def wrap(obj: object) -> LockSession | None:
    """Adapt a started SQLAlchemy ``AsyncConnection`` returned by ``connect_fn``.

    Its driver connection is detached from the engine's pool and handed to the lock;
    the ``AsyncConnection`` is invalidated (without I/O), so that closing it later does
    not touch the lock's connection.

    Raises:
        ConfigurationError: the connection is not started, closed, or not of a
            supported driver.
    """
    if not isinstance(obj, AsyncConnection):
        return None
    sync = obj.sync_connection
    if sync is None or sync.closed or sync.invalidated:
        raise ConfigurationError(
            "connect_fn returned a SQLAlchemy AsyncConnection that is not started or "
            "already closed; return `await engine.connect()`"
        )
    _check_dialect(sync.dialect)
    proxied = sync.connection
    driver_connection = proxied.driver_connection
    proxied.detach()
    sync.invalidate()  # no I/O: the pool entry is gone, so it only forgets the connection
    origin = mask_dsn(sync.engine.url.render_as_string(hide_password=True))
    return SQLAlchemySession(driver_connection, origin=origin)


def fetch_row(
    conn: object, template: str, values: tuple[object, ...]
) -> Awaitable[tuple[Any, ...] | None] | None:
    """One statement in the caller's transaction on a SQLAlchemy ``AsyncConnection`` or
    ``AsyncSession`` (which begin one if none is open)."""
    if not isinstance(conn, AsyncConnection | AsyncSession):
        return None
    return _fetch_row(conn, template, values)


async def _fetch_row(
    conn: AsyncConnection | AsyncSession, template: str, values: tuple[object, ...]
) -> tuple[Any, ...] | None:
    connection = conn if isinstance(conn, AsyncConnection) else await conn.connection()
    if _autocommit(connection):
        raise ConfigurationError(
            "fencing must run inside the transaction it protects; this connection runs "
            "in autocommit mode (isolation_level='AUTOCOMMIT', on the connection or its "
            "engine), where a row lock would end with its own statement"
        )
    names = [f"p{n}" for n in range(len(values))]
    query = text(template.format(*[f":{name}" for name in names]))
    result = await conn.execute(query, dict(zip(names, values, strict=True)))
    row = result.first()
    return None if row is None else tuple(row)


def transaction(conn: object) -> AbstractAsyncContextManager[object] | None:
    """``begin()`` of a SQLAlchemy ``AsyncConnection`` or ``AsyncSession``
    (``begin_nested()`` when a transaction is open already); ``None`` for another kind
    of connection."""
    if not isinstance(conn, AsyncConnection | AsyncSession):
        return None
    begin = conn.begin_nested if conn.in_transaction() else conn.begin
    return cast(AbstractAsyncContextManager[object], begin())


def _autocommit(conn: AsyncConnection) -> bool:
    """Does ``conn`` run every statement in a transaction of its own? Set by its
    execution options, or by the engine's ``isolation_level`` (which SQLAlchemy applies
    to the driver connection only): the driver connection knows either way."""
    sync = conn.sync_connection
    if sync is None:  # not started: execute() raises the usual error
        return False
    if sync.get_execution_options().get("isolation_level") == "AUTOCOMMIT":
        return True
    return bool(getattr(sync.connection.dbapi_connection, "autocommit", False))


backend = module_backend(__name__)
