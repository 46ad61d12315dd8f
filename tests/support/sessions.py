"""Helpers of the ``LockSession`` contract tests (tests/contract/test_session_*.py):
conditions to poll for, sessions of a target set up to hold or wait for a lock, and the
check that a wait was granted once."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable
from typing import TYPE_CHECKING, Protocol, cast

from pgleaderlock.backends import BaseSession, LockSession, WaitingSession, WatchableSession
from support.fixture_types import LockPids

if TYPE_CHECKING:
    from contract.conftest import Target


async def negated(awaitable: Awaitable[object]) -> bool:
    return not await awaitable


async def equals(awaitable: Awaitable[object], expected: object) -> bool:
    return await awaitable == expected


async def sorted_equals(awaitable: Awaitable[list[int]], expected: list[int]) -> bool:
    return sorted(await awaitable) == expected


def is_builtin(target: Target) -> bool:
    return not target.flavour.fake and target.flavour.backend in (
        "psycopg",
        "asyncpg",
        "sqlalchemy",
    )


def in_slices(session: LockSession) -> None:
    """Make a built-in session wait as it does behind a pooler or on PostgreSQL 13: each
    ``wait_lock()`` one wait on the server, under a ``lock_timeout``."""
    inner = getattr(session, "_inner", session)  # the SQLAlchemy session's adapter
    if isinstance(inner, BaseSession):
        inner._can_wait_on = False


class Waiting(LockSession, WaitingSession, Protocol):
    """A session that may wait on the server for the lock."""


class Watchable(LockSession, WatchableSession, Protocol):
    """A session that notices at once that the server ended it."""


async def holder_and_waiter(target: Target, keys: tuple[int, int]) -> tuple[LockSession, Waiting]:
    """Two sessions of ``target`` (skipped unless it waits on the server): the first
    holds ``keys``, the second is free to wait for them."""
    await target.require(WaitingSession)
    a = await target.session()
    b = await target.session()
    assert isinstance(b, WaitingSession)
    assert await a.try_lock(*keys)
    return a, cast(Waiting, b)


async def watchable_holder(target: Target, keys: tuple[int, int]) -> Watchable:
    """A session of ``target`` (skipped unless it can be watched) that holds ``keys``."""
    await target.require(WatchableSession)
    session = await target.session()
    assert isinstance(session, WatchableSession)
    assert await session.try_lock(*keys)
    return cast(Watchable, session)


async def assert_granted_once(
    holder: LockSession, waiter: Waiting, keys: tuple[int, int], holders: LockPids
) -> None:
    """``waiter``'s next wait is granted ``keys`` (freed by ``holder``) and counted once:
    one unlock frees the lock, and ``holder`` can take it again."""
    async with asyncio.timeout(5):
        assert await waiter.wait_lock(*keys, 1.0) is True
    assert await holders(*keys) == [waiter.backend_pid]
    assert await waiter.unlock(*keys)
    assert await holders(*keys) == []  # one unlock freed it
    assert await holder.try_lock(*keys)
