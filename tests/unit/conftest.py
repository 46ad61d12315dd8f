from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable

import pytest

from pgleaderlock import FixedInterval, LeaderLock, LockState
from pgleaderlock.testing.fake import FakeServer


class Recorder:
    """Registers a callback for every event of a lock and records them in order."""

    def __init__(self, lock: LeaderLock) -> None:
        self.lock = lock
        self.events: list[tuple[str, object]] = []
        self._changed = asyncio.Condition()
        lock.on_acquired(lambda: self._add("acquired"))
        lock.on_released(lambda: self._add("released"))
        lock.on_lost(lambda: self._add("lost"))
        lock.on_acquire_failed(lambda: self._add("acquire_failed"))
        lock.on_stopped(lambda: self._add("stopped"))
        lock.on_error(lambda exc: self._add("error", exc))
        lock.on_state_change(lambda a, b: self._add("state", (a, b)))

    async def _add(self, name: str, arg: object = None) -> None:
        self.events.append((name, arg))
        async with self._changed:
            self._changed.notify_all()

    def names(self, *, states: bool = False) -> list[str]:
        return [n for n, _ in self.events if states or n != "state"]

    def states(self) -> list[LockState]:
        return [arg[1] for n, arg in self.events if n == "state"]  # type: ignore[index]

    def errors(self) -> list[BaseException]:
        return [arg for n, arg in self.events if n == "error"]  # type: ignore[misc]

    async def wait(self, predicate: Callable[[], bool], timeout: float = 5.0) -> None:
        async with asyncio.timeout(timeout), self._changed:
            await self._changed.wait_for(predicate)

    async def wait_event(self, name: str, count: int = 1, timeout: float = 5.0) -> None:
        await self.wait(lambda: self.names().count(name) >= count, timeout)

    async def wait_state(self, state: LockState, timeout: float = 5.0) -> None:
        await self.wait(lambda: self.lock.state is state, timeout)


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


@pytest.fixture
def recorder() -> Callable[[LeaderLock], Recorder]:
    return Recorder
