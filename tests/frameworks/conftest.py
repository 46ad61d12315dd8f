"""Fixtures for the FastAPI and APScheduler integration tests (``make_lock``, ``server``
and ``lock_name`` are tests/fix_locks.py's and tests/fix_db.py's)."""

from __future__ import annotations

from collections.abc import Awaitable, Callable

import psycopg
import pytest

Admin = psycopg.AsyncConnection[tuple[object, ...]]


@pytest.fixture
def sessions(admin: Admin) -> Callable[[str], Awaitable[list[int]]]:
    """``await sessions(lock_name)``: backend pids of the lock's sessions still connected."""

    async def sessions(name: str) -> list[int]:
        cur = await admin.execute(
            "SELECT pid FROM pg_stat_activity WHERE application_name LIKE %s",
            (f"pgleaderlock:{name}@%",),
        )
        return [row[0] for row in await cur.fetchall()]  # type: ignore[misc]

    return sessions
