"""Fixtures for the FastAPI and APScheduler integration tests."""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator, Awaitable, Callable

import psycopg
import pytest

from pgleaderlock import FixedInterval, LeaderLock
from pgleaderlock.testing.fake import FakeServer

Admin = psycopg.AsyncConnection[tuple[object, ...]]

FAST_FAKE = {
    "retry_strategy": FixedInterval(0.01),
    "health_interval_s": 0.02,
    "health_timeout_s": 0.5,
    "command_timeout_s": 0.5,
    "connect_timeout_s": 0.5,
}

FAST_PG = {
    "retry_strategy": FixedInterval(0.05),
    "health_interval_s": 0.2,
    "health_timeout_s": 1.0,
    "connect_timeout_s": 3.0,
    "command_timeout_s": 2.0,
}


@pytest.fixture
def server() -> FakeServer:
    return FakeServer()


@pytest.fixture
async def fake_lock(server: FakeServer) -> AsyncIterator[Callable[..., LeaderLock]]:
    """``fake_lock(**kwargs)``: a lock on the in-memory server with fast timings; every
    lock is shut down after the test, and no session may be left open."""
    locks: list[LeaderLock] = []

    def make(**kwargs: object) -> LeaderLock:
        lock = LeaderLock(None, 1, 2, connect_fn=server.connect, **{**FAST_FAKE, **kwargs})  # type: ignore[arg-type]
        locks.append(lock)
        return lock

    yield make
    server.release_hangs()
    for lock in locks:
        await lock.shutdown(timeout_s=5)
    assert server.open_sessions == [], "a lock left a session open"


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
