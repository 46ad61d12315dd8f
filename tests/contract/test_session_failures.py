"""The ``LockSession`` contract for sessions that fail: a server backend terminated (and
the watch that reports it), ``abort()``, and calls bounded on a network that stops
answering (a TCP proxy between client and server).

How these run (every backend, the fake too): see test_session_contract.py.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, TypeVar, cast

import pytest

from pgleaderlock import ConnectionError, LockError, SessionNotDedicatedError
from pgleaderlock.backends import (
    AbortableSession,
    LockSession,
    ProbingSession,
    WaitingSession,
    WatchableSession,
)
from support.fixture_types import LockPids, Terminate
from support.poll import eventually
from support.proxy import TcpProxy
from support.sessions import equals, holder_and_waiter, watchable_holder

if TYPE_CHECKING:
    from contract.conftest import Target

pytestmark = [pytest.mark.integration, pytest.mark.timeout(60)]


async def gone(backend_alive: Callable[[int], Awaitable[bool]], pid: int) -> bool:
    """Whether the server process ``pid`` has ended (after a ``terminate``)."""
    return not await backend_alive(pid)


@pytest.mark.parametrize("method", ["try_lock", "unlock", "holds", "wait_lock"])
async def test_terminated_session_raises_connection_error(
    target: Target,
    keys: tuple[int, int],
    terminate: Terminate,
    backend_alive: Callable[[int], Awaitable[bool]],
    method: str,
) -> None:
    """After pg_terminate_backend every method raises ConnectionError (whatever the
    driver's own exception type), with the driver error as the cause."""
    if method == "wait_lock":
        await target.require(WaitingSession)
    session = await target.session()
    assert await session.try_lock(*keys)
    pid = session.backend_pid
    assert pid is not None
    await terminate(pid)
    await eventually(lambda: gone(backend_alive, pid), 5, "the backend gone")
    by_method: dict[str, Callable[[], Awaitable[bool]]] = {
        "try_lock": lambda: session.try_lock(*keys),
        "unlock": lambda: session.unlock(*keys),
        "holds": lambda: session.holds(*keys),
        "wait_lock": lambda: cast(WaitingSession, session).wait_lock(*keys, 1.0),
    }
    call = by_method[method]
    for _ in range(2):  # and again on the dead session
        with pytest.raises(ConnectionError) as info:
            async with asyncio.timeout(5):
                await call()
        assert not isinstance(info.value, LockError)
        assert not isinstance(info.value, SessionNotDedicatedError)
        assert info.value.__cause__ is not None
    await session.close()
    await session.close()  # idempotent


async def test_terminated_during_wait_raises_connection_error(
    target: Target,
    keys: tuple[int, int],
    terminate: Terminate,
    waiters: LockPids,
) -> None:
    _holder, b = await holder_and_waiter(target, keys)
    assert await b.try_lock(*keys) is False
    wait = asyncio.ensure_future(b.wait_lock(*keys, 30))
    try:
        await eventually(lambda: equals(waiters(*keys), [b.backend_pid]), 5, "b to queue")
        await terminate(b.backend_pid)
        with pytest.raises(ConnectionError) as info:
            async with asyncio.timeout(5):
                await wait
        assert not isinstance(info.value, LockError)
    finally:
        wait.cancel()
        await asyncio.gather(wait, return_exceptions=True)


async def test_watch_reports_termination_at_once(
    target: Target, keys: tuple[int, int], terminate: Terminate
) -> None:
    session = await watchable_holder(target, keys)
    fired = asyncio.Event()
    calls: list[float] = []

    def alarm() -> None:
        calls.append(time.monotonic())
        fired.set()

    session.watch(alarm)
    await asyncio.sleep(0.05)  # kept: a window for a wrong alarm to show
    assert calls == []  # an idle, healthy session stays quiet
    started = time.monotonic()
    await terminate(session.backend_pid)
    async with asyncio.timeout(2):
        await fired.wait()
    assert calls[0] - started < 1.0
    await asyncio.sleep(0.05)  # kept: a window for a second alarm to show
    assert len(calls) == 1  # once
    with pytest.raises(ConnectionError):
        await session.holds(*keys)


@pytest.mark.postgres_only("the fake has no quick probe (an optional capability)")
async def test_started_probes_answer_keep_the_watch_and_report_the_end(
    target: Target, keys: tuple[int, int], terminate: Terminate
) -> None:
    """The cheap probe started as a future (when to use it instead of ``holds()`` is the
    core's choice): it answers, leaves the watch armed (the watch still reports a
    termination afterwards), and fails with ConnectionError on a session the server
    ended. Every built-in backend has one: psycopg's is a protocol ``Sync``, the others
    run the ``ALIVE`` statement."""
    session = await target.session()
    assert isinstance(session, ProbingSession)  # every built-in backend
    assert await session.try_lock(*keys)
    first = session.start_probe()
    assert first is not None
    async with asyncio.timeout(5):
        await first  # without a watch: the probe reads the answer itself
    assert isinstance(session, WatchableSession)
    fired = asyncio.Event()
    second = session.start_probe()
    assert second is not None
    session.watch(fired.set)  # armed while a probe that reads for itself is in flight
    async with asyncio.timeout(5):
        await second
    for _ in range(3):
        probe = session.start_probe()
        assert probe is not None
        async with asyncio.timeout(5):
            await probe
    assert not fired.is_set()  # the answers went to the probes, not to the watch
    assert await session.holds(*keys)  # and the session is in order for statements
    session.watch(fired.set)
    await terminate(session.backend_pid)
    async with asyncio.timeout(2):
        await fired.wait()  # the watch survived the probes
    probe = session.start_probe()
    assert probe is not None
    with pytest.raises(ConnectionError) as info:
        async with asyncio.timeout(5):
            await probe
    assert info.value.__cause__ is not None


async def test_watch_armed_after_termination_fires(
    target: Target,
    keys: tuple[int, int],
    terminate: Terminate,
    backend_alive: Callable[[int], Awaitable[bool]],
) -> None:
    """A watch armed on an idle session that the server already ended still reports it
    (the socket holds the FATAL message and EOF), from the event loop, once."""
    session = await watchable_holder(target, keys)
    pid = session.backend_pid
    assert pid is not None
    await terminate(pid)
    await eventually(lambda: gone(backend_alive, pid), 5, "the backend gone")
    fired = asyncio.Event()
    calls: list[str] = []

    def alarm() -> None:
        calls.append("fired")
        fired.set()

    session.watch(alarm)
    assert calls == []  # never from inside watch() itself
    async with asyncio.timeout(2):
        await fired.wait()
    await asyncio.sleep(0.05)  # kept: a window for a second alarm to show
    assert calls == ["fired"]


async def test_watch_is_disarmed_by_none_by_calls_and_by_close(
    target: Target, keys: tuple[int, int], terminate: Terminate
) -> None:
    calls: list[str] = []
    session = await watchable_holder(target, keys)
    session.watch(lambda: calls.append("removed"))
    session.watch(None)
    session.watch(lambda: calls.append("replaced"))
    session.watch(lambda: calls.append("armed"))
    assert await session.holds(*keys)  # any call disarms the watch
    await terminate(session.backend_pid)
    await asyncio.sleep(0.3)  # kept: a window for a disarmed watch to fire wrongly
    assert calls == []

    other = await target.session()
    assert isinstance(other, WatchableSession)
    await other.holds(*keys)
    other.watch(lambda: calls.append("closed"))
    await other.close()
    await asyncio.sleep(0.1)  # kept: a window for a wrong alarm to show
    assert calls == []


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
