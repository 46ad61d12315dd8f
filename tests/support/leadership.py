"""A fencing lock that loses its session and leads again, for the tests of work that
fences with the leadership it began under (``tests/server/test_fencing_leadership.py``,
``tests/frameworks/test_fencing_leadership_pg.py``)."""

from __future__ import annotations

from typing import Any

import psycopg

from pgleaderlock import LeaderLock
from support.poll import eventually
from support.server import lock_holders
from support.timings import timings

__all__ = ["TIMINGS", "fenced_insert", "lead_again", "queued", "terms_in"]

Admin = psycopg.AsyncConnection[tuple[Any, ...]]

TIMINGS = timings(retry_s=0.05, health_interval_s=0.1, command_timeout_s=5.0, load_plugins=False)
"""The fencing locks' timings in these tests."""


async def queued(admin: Admin, lock: LeaderLock) -> None:
    """Wait until ``lock``'s session waits on the server for the advisory lock."""

    async def waiting() -> bool:
        pid = lock.backend_pid
        return pid is not None and pid in await lock_holders(admin, *lock.keys, granted=False)

    await eventually(waiting, 10.0, f"{lock.label} queued for the lock")


async def lead_again(admin: Admin, lock: LeaderLock, rival: LeaderLock | None = None) -> int:
    """End the session of ``lock`` (which leads) with ``pg_terminate_backend``; with a
    ``rival``, the rival (started here, queued on the server first) leads next, under a
    term of its own, and then shuts down. Wait until ``lock`` leads again; its new term.
    """
    old = lock.term
    assert old is not None
    assert lock.is_leader
    if rival is not None:
        await rival.start()
        await queued(admin, rival)
    await admin.execute("SELECT pg_terminate_backend(%s)", (lock.backend_pid,))
    if rival is not None:
        assert await rival.wait_for_leadership(10)
        assert (rival.term or 0) > old
        await rival.shutdown()
    await eventually(
        lambda: lock.is_leader and (lock.term or 0) > old, 15.0, f"{lock.label} leads again"
    )
    assert lock.term is not None
    return lock.term


async def fenced_insert(fence: Any, dsn: str, table: str) -> int:
    """In a transaction of its own: ``await fence(conn)`` (returns a term), then insert
    that term into ``table``; the term (``FencedError`` passes through, rolled back)."""
    async with (
        await psycopg.AsyncConnection.connect(dsn, connect_timeout=5) as conn,
        conn.transaction(),
    ):
        term = int(await fence(conn))
        await conn.execute(f"INSERT INTO {table} (term) VALUES (%s)".encode(), (term,))
    return term


async def terms_in(admin: Admin, table: str) -> list[int]:
    """The terms inserted into ``table``, sorted."""
    cur = await admin.execute(f"SELECT term FROM {table} ORDER BY term".encode())
    return [int(row[0]) for row in await cur.fetchall()]
