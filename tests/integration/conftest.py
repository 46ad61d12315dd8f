from __future__ import annotations

import random
from collections.abc import AsyncIterator, Awaitable, Callable

import psycopg
import pytest

Admin = psycopg.AsyncConnection[tuple[object, ...]]


@pytest.fixture
async def admin(pg_dsn: str) -> AsyncIterator[Admin]:
    """A separate session for looking at (and interfering with) the server."""
    async with await psycopg.AsyncConnection.connect(pg_dsn, autocommit=True) as conn:
        yield conn


@pytest.fixture
def keys() -> tuple[int, int]:
    """Keys no other test uses, so tests can share one server."""
    return random.randint(1, 2**31 - 1), random.randint(-(2**31), 2**31 - 1)


@pytest.fixture
def holders(admin: Admin) -> Callable[[int, int], Awaitable[list[int]]]:
    """``await holders(key1, key2)``: backend pids holding the lock, from pg_locks."""

    async def holders(key1: int, key2: int) -> list[int]:
        cur = await admin.execute(
            "SELECT pid FROM pg_locks WHERE locktype = 'advisory' AND granted AND objsubid = 2"
            " AND classid = %s::int8::oid AND objid = %s::int8::oid",
            (key1 & 0xFFFFFFFF, key2 & 0xFFFFFFFF),
        )
        return [row[0] for row in await cur.fetchall()]  # type: ignore[misc]

    return holders


@pytest.fixture
def terminate(admin: Admin) -> Callable[[int | None], Awaitable[None]]:
    """``await terminate(pid)``: pg_terminate_backend(pid)."""

    async def terminate(pid: int | None) -> None:
        await admin.execute("SELECT pg_terminate_backend(%s)", (pid,))

    return terminate
