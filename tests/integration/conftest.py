from __future__ import annotations

import random
from collections.abc import AsyncIterator

import psycopg
import pytest


@pytest.fixture
async def admin(pg_dsn: str) -> AsyncIterator[psycopg.AsyncConnection[tuple[object, ...]]]:
    """A separate session for looking at (and interfering with) the server."""
    async with await psycopg.AsyncConnection.connect(pg_dsn, autocommit=True) as conn:
        yield conn


@pytest.fixture
def keys() -> tuple[int, int]:
    """Keys no other test uses, so tests can share one server."""
    return random.randint(1, 2**31 - 1), random.randint(-(2**31), 2**31 - 1)


async def holders(
    admin: psycopg.AsyncConnection[tuple[object, ...]], key1: int, key2: int
) -> list[int]:
    """Backend pids holding the advisory lock (key1, key2), from pg_locks."""
    cur = await admin.execute(
        "SELECT pid FROM pg_locks WHERE locktype = 'advisory' AND granted AND objsubid = 2"
        " AND classid = %s::int8::oid AND objid = %s::int8::oid",
        (key1 & 0xFFFFFFFF, key2 & 0xFFFFFFFF),
    )
    return [row[0] for row in await cur.fetchall()]  # type: ignore[misc]


async def terminate(admin: psycopg.AsyncConnection[tuple[object, ...]], pid: int) -> None:
    await admin.execute("SELECT pg_terminate_backend(%s)", (pid,))
