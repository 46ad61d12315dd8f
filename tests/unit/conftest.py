from __future__ import annotations

from collections.abc import AsyncIterator, Callable

import pytest

from pgleaderlock import FixedInterval, LeaderLock
from pgleaderlock.testing.fake import FakeServer


@pytest.fixture
def server() -> FakeServer:
    return FakeServer()


@pytest.fixture
async def make_lock(server: FakeServer) -> AsyncIterator[Callable[..., LeaderLock]]:
    """Locks on the fake server with fast timings; all shut down after the test."""
    locks: list[LeaderLock] = []

    def make(**kwargs: object) -> LeaderLock:
        kwargs.setdefault("connect_fn", server.connect)
        kwargs.setdefault("retry_strategy", FixedInterval(0.01))
        kwargs.setdefault("health_interval_s", 0.02)
        kwargs.setdefault("health_timeout_s", 0.5)
        kwargs.setdefault("command_timeout_s", 0.5)
        kwargs.setdefault("connect_timeout_s", 0.5)
        lock = LeaderLock(None, 1, 2, **kwargs)  # type: ignore[arg-type]
        locks.append(lock)
        return lock

    yield make
    server.release_hangs()
    for lock in locks:
        await lock.shutdown(timeout_s=5)
    assert server.open_sessions == [], "a lock left a session open"
