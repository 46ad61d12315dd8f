"""The kinds of connection ``lock.fence(conn)`` takes, for the fencing tests on a real
server (tests/server/test_fencing*.py), and their helpers: a unique name, a table's rows,
a lock started until it leads, a lock queued on the server."""

from __future__ import annotations

import abc
import asyncio
import contextlib
import uuid
from collections.abc import AsyncIterator, Callable
from typing import Any

import asyncpg
import psycopg
from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncEngine, AsyncSession, create_async_engine

from pgleaderlock import LeaderLock
from support.poll import eventually
from support.server import Admin, dsn_to_url, lock_holders


class Kind(abc.ABC):
    """A kind of connection that ``fence()`` takes: a transaction on it (committed when
    the block ends without an exception), the same kind with no transaction open, and
    how to run a statement on it."""

    def __init__(self, dsn: str) -> None:
        self.dsn = dsn

    @abc.abstractmethod
    def transaction(self) -> contextlib.AbstractAsyncContextManager[Any]: ...

    @abc.abstractmethod
    def outside(self) -> contextlib.AbstractAsyncContextManager[Any]:
        """A connection of this kind on which ``fence()`` would run outside any
        transaction (autocommit)."""

    @abc.abstractmethod
    async def execute(self, conn: Any, sql: str) -> None: ...

    async def fence(self, lock: LeaderLock, conn: Any) -> int:
        return await lock.fence(conn)

    async def aclose(self) -> None:
        return None


class PsycopgBlock(Kind):
    """psycopg ``AsyncConnection`` in autocommit mode, inside ``conn.transaction()``."""

    @contextlib.asynccontextmanager
    async def transaction(self) -> AsyncIterator[Any]:
        async with (
            await psycopg.AsyncConnection.connect(
                self.dsn, autocommit=True, connect_timeout=5
            ) as conn,
            conn.transaction(),
        ):
            yield conn

    @contextlib.asynccontextmanager
    async def outside(self) -> AsyncIterator[Any]:
        async with await psycopg.AsyncConnection.connect(
            self.dsn, autocommit=True, connect_timeout=5
        ) as conn:
            yield conn

    async def execute(self, conn: Any, sql: str) -> None:
        await conn.execute(sql.encode())


class PsycopgImplicit(PsycopgBlock):
    """psycopg ``AsyncConnection`` not in autocommit mode: the first statement (the
    fence) begins the transaction, leaving the ``async with`` block commits it."""

    @contextlib.asynccontextmanager
    async def transaction(self) -> AsyncIterator[Any]:
        async with await psycopg.AsyncConnection.connect(self.dsn, connect_timeout=5) as conn:
            yield conn


class Asyncpg(Kind):
    """asyncpg ``Connection`` inside ``conn.transaction()``."""

    def __init__(self, dsn: str) -> None:
        super().__init__(dsn)
        self.url = dsn_to_url(dsn)

    @contextlib.asynccontextmanager
    async def connection(self) -> AsyncIterator[Any]:
        conn = await asyncpg.connect(self.url, timeout=5)
        try:
            yield conn
        finally:
            await conn.close(timeout=5)

    @contextlib.asynccontextmanager
    async def transaction(self) -> AsyncIterator[Any]:
        async with self.connection() as conn, conn.transaction():
            yield conn

    def outside(self) -> contextlib.AbstractAsyncContextManager[Any]:
        return self.connection()

    async def execute(self, conn: Any, sql: str) -> None:
        await conn.execute(sql, timeout=5)


class AsyncpgPool(Asyncpg):
    """A connection of an asyncpg pool (a ``PoolConnectionProxy``), inside
    ``conn.transaction()``."""

    def __init__(self, dsn: str) -> None:
        super().__init__(dsn)
        self._pool: Any = None

    @contextlib.asynccontextmanager
    async def connection(self) -> AsyncIterator[Any]:
        if self._pool is None:
            self._pool = await asyncpg.create_pool(self.url, min_size=1, max_size=2, timeout=5)
        async with self._pool.acquire(timeout=5) as conn:
            yield conn

    async def aclose(self) -> None:
        if self._pool is not None:
            await asyncio.wait_for(self._pool.close(), 10)


class SAConnection(Kind):
    """SQLAlchemy ``AsyncConnection`` inside ``conn.begin()``."""

    def __init__(self, dsn: str, driver: str) -> None:
        super().__init__(dsn)
        url = dsn_to_url(dsn, f"postgresql+{driver}")
        self.engine: AsyncEngine = create_async_engine(
            url, pool_size=2, max_overflow=0, pool_timeout=5
        )

    @contextlib.asynccontextmanager
    async def transaction(self) -> AsyncIterator[Any]:
        async with self.engine.connect() as conn, conn.begin():
            yield conn

    @contextlib.asynccontextmanager
    async def outside(self) -> AsyncIterator[Any]:
        async with self.engine.connect() as conn:
            yield await conn.execution_options(isolation_level="AUTOCOMMIT")

    async def execute(self, conn: Any, sql: str) -> None:
        await conn.execute(text(sql))

    async def aclose(self) -> None:
        await self.engine.dispose()


class SASession(SAConnection):
    """SQLAlchemy ``AsyncSession`` inside ``session.begin()``; outside a transaction:
    a session bound to the engine with ``isolation_level="AUTOCOMMIT"``."""

    @contextlib.asynccontextmanager
    async def transaction(self) -> AsyncIterator[Any]:
        async with AsyncSession(self.engine) as session, session.begin():
            yield session

    @contextlib.asynccontextmanager
    async def outside(self) -> AsyncIterator[Any]:
        autocommit = self.engine.execution_options(isolation_level="AUTOCOMMIT")
        async with AsyncSession(autocommit) as session:
            yield session


class SyncPsycopg(Kind):
    """A synchronous psycopg ``Connection`` with ``lock.fence_sync(conn)`` (the threaded
    lock's way), not in autocommit mode: the fence begins the transaction. Every call
    runs in a worker thread, as it would next to a running event loop."""

    @contextlib.asynccontextmanager
    async def connection(self, *, autocommit: bool) -> AsyncIterator[Any]:
        def connect() -> psycopg.Connection[tuple[Any, ...]]:
            return psycopg.connect(self.dsn, autocommit=autocommit, connect_timeout=5)

        conn = await asyncio.to_thread(connect)
        try:
            yield conn
        finally:
            await asyncio.to_thread(conn.close)

    @contextlib.asynccontextmanager
    async def transaction(self) -> AsyncIterator[Any]:
        async with self.connection(autocommit=False) as conn:
            yield conn
            await asyncio.to_thread(conn.commit)

    def outside(self) -> contextlib.AbstractAsyncContextManager[Any]:
        return self.connection(autocommit=True)

    async def execute(self, conn: Any, sql: str) -> None:
        await asyncio.to_thread(conn.execute, sql.encode())

    async def fence(self, lock: LeaderLock, conn: Any) -> int:
        return await asyncio.to_thread(lock.fence_sync, conn)


class SyncPsycopgBlock(SyncPsycopg):
    """A synchronous psycopg ``Connection`` in autocommit mode inside
    ``with conn.transaction():`` (entered and left in a worker thread)."""

    @contextlib.asynccontextmanager
    async def transaction(self) -> AsyncIterator[Any]:
        async with self.connection(autocommit=True) as conn:
            block = conn.transaction()
            await asyncio.to_thread(block.__enter__)
            try:
                yield conn
            except BaseException as exc:
                await asyncio.to_thread(block.__exit__, type(exc), exc, exc.__traceback__)
                raise
            await asyncio.to_thread(block.__exit__, None, None, None)


KINDS: dict[str, Callable[[str], Kind]] = {
    "psycopg": PsycopgBlock,
    "psycopg-implicit": PsycopgImplicit,
    "asyncpg": Asyncpg,
    "asyncpg-pool": AsyncpgPool,
    "sqlalchemy-conn-asyncpg": lambda dsn: SAConnection(dsn, "asyncpg"),
    "sqlalchemy-conn-psycopg": lambda dsn: SAConnection(dsn, "psycopg"),
    "sqlalchemy-session-asyncpg": lambda dsn: SASession(dsn, "asyncpg"),
    "sqlalchemy-session-psycopg": lambda dsn: SASession(dsn, "psycopg"),
    "sync-psycopg": SyncPsycopg,
    "sync-psycopg-block": SyncPsycopgBlock,
}


def unique(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex[:12]}"


async def rows(admin: Admin, table: str) -> list[tuple[Any, ...]]:
    cur = await admin.execute(f"SELECT * FROM {table} ORDER BY 1".encode())
    return await cur.fetchall()


async def leads(lock: LeaderLock) -> int:
    """Start ``lock``, wait until it leads; its term."""
    await lock.start()
    assert await lock.wait_for_leadership(10)
    assert lock.term is not None
    return lock.term


async def queued(admin: Admin, lock: LeaderLock) -> None:
    """Wait until ``lock``'s session waits on the server for the advisory lock."""

    async def waiting() -> bool:
        pid = lock.backend_pid
        return pid is not None and pid in await lock_holders(admin, *lock.keys, granted=False)

    await eventually(waiting, 10.0, f"{lock.label} queued for the lock")
