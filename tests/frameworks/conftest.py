"""Fixtures for the FastAPI and APScheduler integration tests."""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator, Awaitable, Callable

import psycopg
import pytest

from pgleaderlock import LeaderLock
from pgleaderlock.testing.fake import FakeServer
from support.locks import fake_locks

Admin = psycopg.AsyncConnection[tuple[object, ...]]


@pytest.fixture
def server() -> FakeServer:
    return FakeServer()


@pytest.fixture
async def fake_lock(server: FakeServer) -> AsyncIterator[Callable[..., LeaderLock]]:
    """``fake_lock(**kwargs)``: a lock on the in-memory server with fast timings; every
    lock is shut down after the test, and no session may be left open."""
    async with fake_locks(server) as make:
        yield make


@pytest.fixture
def lock_name() -> str:
    """A lock name no other test uses (the server is shared)."""
    return f"itest-{uuid.uuid4().hex[:16]}"


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
