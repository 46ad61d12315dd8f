"""The ``LockSession`` contract: ``abort()``, and calls bounded on a network that stops
answering (a TCP proxy between client and server).

These call the adapters the way the core does (``Backend.connect``, then the session's
methods under ``asyncio.timeout``), one level below ``LeaderLock``. They run on the
in-memory ``FakeServer`` too (the ``fake`` flavour), except where marked
``postgres_only``. Shared helpers: ``support/sessions.py``.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable
from typing import TYPE_CHECKING, TypeVar

import pytest

from pgleaderlock import ConnectionError
from pgleaderlock.backends import AbortableSession, LockSession, WaitingSession
from support.fixture_types import LockPids
from support.poll import eventually
from support.proxy import TcpProxy

if TYPE_CHECKING:
    from contract.conftest import Target


pytestmark = [pytest.mark.integration, pytest.mark.timeout(60)]


T = TypeVar("T")


async def bounded_like_the_core(session: LockSession, call: Awaitable[T], timeout_s: float) -> T:
    """What the core does when a call times out: abort() the session, then cancel."""
    task = asyncio.current_task()
    assert task is not None

    def expire() -> None:
        if isinstance(session, AbortableSession):
            session.abort()
        task.cancel()

    handle = asyncio.get_running_loop().call_later(timeout_s, expire)
    try:
        return await call
    except asyncio.CancelledError:
        task.uncancel()
        raise TimeoutError from None
    finally:
        handle.cancel()


async def test_sessions_can_abort(target: Target) -> None:
    await target.require(AbortableSession)
    session = await target.session()
    assert isinstance(session, AbortableSession)
    session.abort()
    session.abort()  # idempotent
    with pytest.raises(ConnectionError):
        await session.try_lock(1, 2)
    await session.close()


@pytest.mark.postgres_only("a TCP proxy between client and server")
async def test_timed_out_call_on_a_stuck_network_returns_at_once(
    target: Target, keys: tuple[int, int]
) -> None:
    async with TcpProxy(*target.server_address()) as proxy:
        session = await target.session(host="127.0.0.1", port=proxy.port)
        assert await session.try_lock(*keys)
        proxy.stall()
        started = time.monotonic()
        with pytest.raises(TimeoutError):
            await bounded_like_the_core(session, session.holds(*keys), 0.2)
        assert time.monotonic() - started < 0.5  # no cancel request waited for
        # The core closes a session after an interrupted call:
        started = time.monotonic()
        async with asyncio.timeout(2):
            await session.close()
            await session.close()
        assert time.monotonic() - started < 0.5


@pytest.mark.postgres_only("a TCP proxy between client and server")
async def test_cancelled_wait_on_a_stuck_network_is_bounded(
    target: Target,
    keys: tuple[int, int],
    waiters: LockPids,
) -> None:
    """The cancel request for a wait cannot get through: give up within ~1 s."""
    await target.require(WaitingSession)
    async with TcpProxy(*target.server_address()) as proxy:
        holder = await target.session()
        session = await target.session(host="127.0.0.1", port=proxy.port)
        assert isinstance(session, WaitingSession)
        assert await holder.try_lock(*keys)
        wait = asyncio.ensure_future(session.wait_lock(*keys, 30))

        async def queued() -> bool:
            return session.backend_pid in await waiters(*keys)

        await eventually(queued, 5, "the wait queued on the server")
        proxy.stall()
        started = time.monotonic()
        wait.cancel()
        await asyncio.gather(wait, return_exceptions=True)
        assert time.monotonic() - started < 2.0
        async with asyncio.timeout(2):
            await session.close()
        await proxy.cut()


@pytest.mark.postgres_only("a TCP proxy between client and server")
async def test_close_is_bounded_on_a_stuck_network(target: Target, keys: tuple[int, int]) -> None:
    async with TcpProxy(*target.server_address()) as proxy:
        session = await target.session(host="127.0.0.1", port=proxy.port)
        assert await session.try_lock(*keys)
        proxy.stall()
        started = time.monotonic()
        async with asyncio.timeout(2):
            await session.close()
        assert time.monotonic() - started < 0.5
        with pytest.raises(ConnectionError):
            async with asyncio.timeout(2):
                await session.holds(*keys)
