"""LeaderLock's start, shutdown and errors on the in-memory FakeServer: idempotent shutdown,
restart, ``async with``, what a shutdown interrupts, an external shutdown event,
``wait_for_leadership``, callbacks and their errors, database errors while acquiring,
retry strategies that give up, and bad input refused before any I/O."""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import pytest

from pgleaderlock import (
    ConfigurationError,
    ConnectionError,
    FixedInterval,
    LeaderLock,
    LockNotHeldError,
    LockOptions,
    LockState,
    RetryContext,
    Session,
    SessionNotDedicatedError,
    ShutdownError,
)
from pgleaderlock.testing import FakeServer
from support.fixture_types import MakeLock, MakeRecorded
from support.locks import another_holds, leading
from support.poll import eventually
from support.timings import lock_args

S = LockState
pytestmark = pytest.mark.timeout(30)


async def test_shutdown_is_idempotent_and_releases(
    recorded: MakeRecorded, server: FakeServer
) -> None:
    lock, rec = recorded()
    await lock.shutdown()  # never started: nothing to do
    await lock.start()
    await lock.start()  # idempotent
    assert await lock.wait_for_leadership(5)
    assert len(server.sessions) == 1
    await lock.shutdown()
    await lock.shutdown()
    assert rec.names().count("stopped") == 1
    assert server.calls["unlock"] == 1
    assert server.open_sessions == []


async def test_restart_after_shutdown(recorded: MakeRecorded) -> None:
    lock, rec = recorded()
    for _ in range(2):
        await lock.start()
        assert await lock.wait_for_leadership(5)
        await lock.shutdown()
    assert rec.names() == ["acquired", "released", "stopped"] * 2


async def test_context_manager(make_lock: MakeLock, server: FakeServer) -> None:
    lock = make_lock()
    async with lock as entered:
        assert entered is lock
        assert await lock.wait_for_leadership(5)
    assert lock.state is S.STOPPED
    assert server.holder(1, 2) is None


async def test_context_manager_shuts_down_on_exception(
    make_lock: MakeLock, server: FakeServer
) -> None:
    lock = make_lock()
    with pytest.raises(RuntimeError, match="user code failed"):
        async with lock:
            assert await lock.wait_for_leadership(5)
            raise RuntimeError("user code failed")
    assert lock.state is S.STOPPED
    assert server.holder(1, 2) is None


async def test_callbacks_order_sync_async_and_errors(recorded: MakeRecorded) -> None:
    lock, rec = recorded()
    calls: list[str] = []

    @lock.on_acquired
    def first() -> None:
        calls.append("first")

    @lock.on_acquired
    async def second() -> None:
        await asyncio.sleep(0)  # kept: an async callback that really yields
        calls.append("second")

    @lock.on_acquired
    def broken() -> None:
        raise ValueError("callback bug")

    @lock.on_acquired
    def fourth() -> None:
        calls.append("fourth")

    assert first.__name__ == "first"  # decorators return the function unchanged
    await lock.start()
    assert await lock.wait_for_leadership(5)
    await rec.wait_event("error")
    assert calls == ["first", "second", "fourth"]
    errors = rec.errors()
    assert len(errors) == 1
    assert isinstance(errors[0], ValueError)
    assert lock.is_leader  # never fatal


async def test_failing_error_callback_is_only_logged(
    make_lock: MakeLock, caplog: pytest.LogCaptureFixture
) -> None:
    lock = make_lock()
    seen: list[BaseException] = []

    @lock.on_error
    def bad_handler(exc: Exception) -> None:
        seen.append(exc)
        raise RuntimeError("handler bug")

    @lock.on_acquired
    def boom() -> None:
        raise ValueError("x")

    with caplog.at_level(logging.ERROR, logger="pgleaderlock"):
        await lock.start()
        assert await lock.wait_for_leadership(5)
    assert len(seen) == 1
    assert "callback_failed" in caplog.text
    assert lock.is_leader


async def test_connection_refused_is_retried_with_on_error(
    recorded: MakeRecorded, server: FakeServer
) -> None:
    server.refuse_connections = ConnectionError("could not connect")
    lock, rec = recorded()
    await lock.start()
    await rec.wait_event("error", count=3)
    assert lock.state in (S.FOLLOWER,)
    assert all(isinstance(e, ConnectionError) for e in rec.errors())
    assert "lost" not in rec.names()
    server.refuse_connections = None
    assert await lock.wait_for_leadership(5)


async def test_db_error_while_acquiring_reports_error_not_lost(
    recorded: MakeRecorded, server: FakeServer
) -> None:
    lock, rec = recorded()
    server.fail_calls["try_lock"] = ConnectionError("reset by peer")
    await lock.start()
    assert await lock.wait_for_leadership(5)
    assert rec.names() == ["error", "acquired"]
    assert len(server.sessions) == 2  # the failed session was closed and replaced


async def test_db_error_while_acquiring_without_auto_reacquire_stops(
    recorded: MakeRecorded, server: FakeServer
) -> None:
    lock, rec = recorded(auto_reacquire=False)
    server.fail_calls["try_lock"] = ConnectionError("reset by peer")
    await lock.start()
    await rec.wait_state(S.STOPPED)
    assert rec.names() == ["error", "stopped"]


async def test_retry_strategy_giving_up_stops(recorded: MakeRecorded, server: FakeServer) -> None:
    class TwoTries:
        def __init__(self) -> None:
            self.contexts: list[RetryContext] = []

        def next_delay_s(self, ctx: RetryContext) -> float | None:
            self.contexts.append(ctx)
            return 0.01 if ctx.attempt < 2 else None

    strategy = TwoTries()
    holder = await another_holds(server)
    lock, rec = recorded(retry_strategy=strategy)
    await lock.start()
    await rec.wait_state(S.STOPPED)
    assert [c.attempt for c in strategy.contexts] == [1, 2]
    assert strategy.contexts[1].elapsed_s >= strategy.contexts[0].elapsed_s
    assert rec.names() == ["acquire_failed", "acquire_failed", "stopped"]
    await holder.close()


async def test_non_retryable_error_stops(recorded: MakeRecorded, server: FakeServer) -> None:
    lock, rec = recorded()
    server.fail_calls["try_lock"] = SessionNotDedicatedError("pooler")
    await lock.start()
    await rec.wait_state(S.STOPPED)
    assert isinstance(rec.errors()[0], SessionNotDedicatedError)


async def test_interrupted_try_lock_closes_the_session(
    recorded: MakeRecorded, server: FakeServer
) -> None:
    """A try_lock whose reply never came may have been granted: never reuse that session."""
    server.hang("try_lock", grant_first=True)
    lock, rec = recorded(command_timeout_s=0.1)
    await lock.start()
    await rec.wait_event("error")
    first = server.sessions[0]
    assert first.closed
    assert server.holder(1, 2) is not first  # closing freed the lock it was granted
    server.release_hangs()
    assert await lock.wait_for_leadership(5)
    assert server.holder(1, 2) is not first


@pytest.mark.parametrize(
    ("call", "hang", "options"),
    [
        ("try_lock", {"grant_first": True}, {"command_timeout_s": 60}),
        ("connect", {}, {"connect_timeout_s": 60}),
    ],
    ids=["try_lock", "connect"],
)
async def test_shutdown_interrupts_a_hanging_call(
    make_lock: MakeLock,
    server: FakeServer,
    call: str,
    hang: dict[str, Any],
    options: dict[str, Any],
) -> None:
    server.hang(call, **hang)
    lock = make_lock(**options)
    await lock.start()
    await eventually(lambda: server.calls[call] > 0, 5, f"a {call}")
    async with asyncio.timeout(2):
        await lock.shutdown()
    assert lock.state is S.STOPPED
    assert server.holder(1, 2) is None
    assert server.open_sessions == []


async def test_shutdown_timeout_raises_cleans_up_and_reports_the_stop(
    recorded: MakeRecorded, server: FakeServer
) -> None:
    lock, rec = recorded()
    gate = asyncio.Event()

    @lock.on_released
    async def stuck() -> None:
        await gate.wait()

    await lock.start()
    assert await lock.wait_for_leadership(5)
    with pytest.raises(ShutdownError):
        await lock.shutdown(timeout_s=0.1)
    assert lock.state is S.STOPPED
    assert server.open_sessions == []
    assert rec.names()[-1] == "stopped"  # a forced stop is still reported
    assert rec.states()[-1] is S.STOPPED


async def test_shutdown_from_a_callback_does_not_deadlock(recorded: MakeRecorded) -> None:
    lock, rec = recorded()

    @lock.on_acquired
    async def stop_now() -> None:
        await lock.shutdown()

    await lock.start()
    await rec.wait_state(S.STOPPED)
    assert rec.names() == ["acquired", "released", "stopped"]


async def test_external_shutdown_event(recorded: MakeRecorded) -> None:
    event = asyncio.Event()
    _, rec = await leading(recorded(shutdown_event=event))
    event.set()
    await rec.wait_state(S.STOPPED)
    assert rec.names() == ["acquired", "released", "stopped"]


async def test_external_shutdown_event_while_following(
    recorded: MakeRecorded, server: FakeServer
) -> None:
    holder = await another_holds(server)
    event = asyncio.Event()
    lock, rec = recorded(shutdown_event=event, retry_strategy=FixedInterval(30))
    await lock.start()
    await rec.wait_event("acquire_failed")
    event.set()
    await rec.wait_state(S.STOPPED, timeout=2)
    await holder.close()


async def test_wait_for_leadership(make_lock: MakeLock, server: FakeServer) -> None:
    lock = make_lock()
    assert await lock.wait_for_leadership(0.05) is False  # not started
    holder = await another_holds(server)
    await lock.start()
    assert await lock.wait_for_leadership(0.1) is False
    await holder.close()
    assert await lock.wait_for_leadership(5) is True


async def test_wait_for_leadership_returns_false_when_stopped(
    make_lock: MakeLock, server: FakeServer
) -> None:
    holder = await another_holds(server)
    lock = make_lock()
    await lock.start()
    waiter = asyncio.create_task(lock.wait_for_leadership())
    # the holder's try_lock was the first; the lock's own attempt fails
    await eventually(lambda: server.calls["try_lock"] >= 2, 5, "the lock's attempt")
    await lock.shutdown()
    assert await asyncio.wait_for(waiter, 2) is False
    await holder.close()


async def test_lock_not_held_error_reported_when_flap_damping_off(
    recorded: MakeRecorded, server: FakeServer, caplog: pytest.LogCaptureFixture
) -> None:
    _, rec = await leading(recorded())
    with caplog.at_level(logging.WARNING, logger="pgleaderlock"):
        session = server.holder(1, 2)
        assert session is not None
        server._free(session)
        await rec.wait_event("lost")
    assert "health_check_failed" in caplog.text
    assert LockNotHeldError.__name__ in caplog.text


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"key1": 2**31}, "key1=2147483648 is outside the signed 32-bit range"),
        ({"key2": -(2**31) - 1}, "key2=.* is outside"),
        ({"key1": True}, "key1 must be an int"),
        ({"key1": "1"}, "key1 must be an int"),
        ({"health_interval_s": 0}, "health_interval_s must be a positive"),
        ({"health_interval_s": -1}, "health_interval_s"),
        ({"health_timeout_s": float("nan")}, "health_timeout_s"),
        ({"reconnect_grace_s": 0}, "reconnect_grace_s"),
        ({"connect_timeout_s": -5}, "connect_timeout_s"),
        ({"command_timeout_s": 0}, "command_timeout_s"),
        ({"tcp_user_timeout_s": 6.0}, "must exceed health_interval_s \\+ health_timeout_s = 7"),
        ({"auto_reacquire": "yes"}, "auto_reacquire must be a bool"),
        ({"retry_strategy": object()}, "next_delay_s"),
        ({"dsn": None}, "a DSN is required"),
        ({"dsn": "   "}, "a DSN is required"),
    ],
)
def test_bad_input_is_rejected_before_io(kwargs: dict[str, Any], match: str) -> None:
    args = {"dsn": "postgresql://u@localhost/db", "key1": 1, "key2": 2, **kwargs}
    with pytest.raises(ConfigurationError, match=match):  # options: from their groups
        LeaderLock(args.pop("dsn"), args.pop("key1"), args.pop("key2"), **lock_args(args))


@pytest.mark.parametrize(
    ("backend", "dsn", "match"),
    [
        (None, "host=h password=s3cret port=5432 nonsense", "malformed DSN"),
        ("psycopg", "host=h password=s3cret port=notaport", "malformed DSN.*bad port"),
        ("psycopg", "host=h password=s3cret connect_timeout=x", "bad connect_timeout"),
        ("psycopg", "host=h password=s3cret target_session_attrs=any", "must live on the primary"),
        ("asyncpg", "postgresql://u:s3cret@h:99999/db", "malformed DSN.*out of range"),
        ("asyncpg", "host=h password=s3cret", "malformed DSN.*not the key=value form"),
        ("asyncpg", "postgresql://u:s3cret@h/db?connect_timeout=x", "bad connect_timeout"),
        ("asyncpg", "postgresql://u:s3cret@h/db?target_session_attrs=any", "on the primary"),
        ("sqlalchemy", "mysql+aiomysql://u:s3cret@h/db", "malformed DSN.*needs a URL"),
        ("sqlalchemy", "postgresql+psycopg://u:s3cret@h:x/db", "malformed DSN"),
    ],
)
def test_malformed_dsn_is_rejected_and_masked(backend: str | None, dsn: str, match: str) -> None:
    """Each backend's DSN errors, before any I/O, with the password masked."""
    if backend is not None:
        pytest.importorskip(backend)
    options = LockOptions(session=Session(backend=backend))
    with pytest.raises(ConfigurationError, match=match) as info:
        LeaderLock(dsn, 1, 2, options=options)
    assert "s3cret" not in str(info.value)
    assert "***" in str(info.value)


def test_configuration_error_is_a_value_error() -> None:
    with pytest.raises(ValueError):
        LeaderLock("postgresql://h/db", 1, 2**40)


def test_restart_on_another_event_loop() -> None:
    """A lock outlives its event loop: e.g. an app whose lifespan runs twice."""
    server = FakeServer()
    lock = LeaderLock(None, 1, 2, connect_fn=server.connect, retry_strategy=FixedInterval(0.01))
    assert lock.retry_strategy is not None

    async def cycle() -> bool:
        await lock.start()
        leader = await lock.wait_for_leadership(5)
        await lock.shutdown()
        return leader

    assert asyncio.run(cycle())
    assert asyncio.run(cycle())
    assert server.open_sessions == []
