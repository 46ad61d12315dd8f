"""Locks made by a test and shut down after it: ``kept`` for any lock, ``fake_locks`` for
locks on the in-memory server; ``another_holds``, a session of that server that holds
the lock first; ``leading``, a lock started and leading."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, ParamSpec, TypeVar

from pgleaderlock import LeaderLock
from pgleaderlock.testing.fake import FakeServer, FakeSession
from support.fixture_types import MakeLock
from support.timings import lock_args, timings

__all__ = ["FAKE_TIMINGS", "another_holds", "fake_locks", "kept", "leading"]

P = ParamSpec("P")
R = TypeVar("R")

FAKE_TIMINGS = timings(
    retry_s=0.01,
    health_interval_s=0.02,
    health_timeout_s=0.5,
    command_timeout_s=0.5,
    connect_timeout_s=0.5,
)
"""Timings for the in-memory server, where nothing takes more than a few milliseconds."""


@contextlib.asynccontextmanager
async def kept(
    build: Callable[P, LeaderLock],
    shutdown_s: float = 15.0,
    on_error: Callable[[LeaderLock, BaseException], None] | None = None,
) -> AsyncIterator[Callable[P, LeaderLock]]:
    """``build``, keeping every lock it makes; on leaving, all of them are shut down at
    once. A shutdown that raises is passed to ``on_error`` if given, else raised."""
    made: list[LeaderLock] = []

    def make(*args: P.args, **kwargs: P.kwargs) -> LeaderLock:
        lock = build(*args, **kwargs)
        made.append(lock)
        return lock

    try:
        yield make
    finally:
        shutdowns = (lock.shutdown(timeout_s=shutdown_s) for lock in made)
        results = await asyncio.gather(*shutdowns, return_exceptions=on_error is not None)
        for lock, result in zip(made, results, strict=True):
            if on_error is not None and isinstance(result, BaseException):
                on_error(lock, result)


@contextlib.asynccontextmanager
async def fake_locks(
    server: FakeServer,
    connect: Callable[[], Awaitable[Any]] | None = None,
    **defaults: Any,
) -> AsyncIterator[MakeLock]:
    """``make(**kwargs)``: a lock on ``server`` (keys 1, 2) with ``FAKE_TIMINGS``, then
    ``defaults``, then ``kwargs`` (flat settings or ``options=``: ``lock_args``); its sessions come from ``connect`` if given. On leaving,
    hung calls are released, every lock is shut down and no session may be left open."""

    def build(**kwargs: Any) -> LeaderLock:
        connect_fn = {"connect_fn": connect or server.connect}
        return LeaderLock(None, 1, 2, **lock_args(connect_fn, FAKE_TIMINGS, defaults, kwargs))

    async with kept(build, shutdown_s=5) as make:
        try:
            yield make
        finally:
            server.release_hangs()
    assert server.open_sessions == [], "a lock left a session open"


async def another_holds(server: FakeServer) -> FakeSession:
    """A session of ``server`` that holds the lock of ``make_lock`` (keys 1, 2)."""
    holder = await server.connect()
    assert await holder.try_lock(1, 2)
    return holder


async def leading(made: tuple[LeaderLock, R]) -> tuple[LeaderLock, R]:
    """``made`` (``recorded(...)``: a lock and its recorder), the lock started and leading
    (within 5 s)."""
    lock, _ = made
    await lock.start()
    assert await lock.wait_for_leadership(5)
    return made
