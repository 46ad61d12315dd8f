"""The ``LockSession`` contract: a session whose server backend is terminated, and the
watch that reports it.

These call the adapters the way the core does (``Backend.connect``, then the session's
methods under ``asyncio.timeout``), one level below ``LeaderLock``. They run on the
in-memory ``FakeServer`` too (the ``fake`` flavour), except where marked
``postgres_only``. Shared helpers: ``support/sessions.py``.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, cast

import pytest

from pgleaderlock import ConnectionError, LockError, SessionNotDedicatedError
from pgleaderlock.backends import ProbingSession, WaitingSession, WatchableSession
from support.fixture_types import LockPids, Terminate
from support.poll import eventually
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
