"""The FakeSession's optional capabilities, called the way the core calls them, and
what a LeaderLock makes of the fake server's scripted answers."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING

import pytest

from pgleaderlock import (
    ConnectionError,
    LockSession,
    LockState,
    StandbyError,
    UntrustedObjectError,
)
from pgleaderlock.backends import (
    AbortableSession,
    ConnectOptions,
    FencedSessions,
    FencingSession,
    KeepAliveSession,
    ProbingSession,
    WaitingSession,
    WatchableSession,
)
from pgleaderlock.core.session import SetupSession, TransportSession
from pgleaderlock.core.tables import TermTable
from pgleaderlock.testing import FakeServer, FakeSession
from support.fixture_types import MakeLock, MakeRecorder
from support.locks import fake_locks
from support.poll import eventually

if TYPE_CHECKING:
    pass

S = LockState
pytestmark = pytest.mark.timeout(30)

TERMS = TermTable()


@pytest.fixture
async def make(server: FakeServer) -> AsyncIterator[MakeLock]:
    async with fake_locks(server, load_plugins=False, health_interval_s=0.05) as make_lock:
        yield make_lock


async def _session(server: FakeServer, lease_s: float = 0.0) -> FakeSession:
    session = await server.connect()
    await session.identify()
    await session.configure(ConnectOptions("test", 1.0, lease_s=lease_s))
    return session


async def test_a_fake_session_has_every_capability_a_lock_uses(server: FakeServer) -> None:
    session = await server.connect()
    for capability in (
        LockSession,
        WaitingSession,
        WatchableSession,
        AbortableSession,
        SetupSession,
        ProbingSession,
        KeepAliveSession,
        TransportSession,
        FencingSession,
    ):
        assert isinstance(session, capability), capability.__name__
    info = await session.identify()
    assert (info.backend_pid, info.behind_pooler, info.in_recovery) == (
        session.backend_pid,
        False,
        False,
    )
    assert await session.backend_now() == session.backend_pid
    await session.close()


async def test_a_lock_configures_its_sessions_and_refuses_a_standby(
    make: MakeLock,
    recorder: MakeRecorder,
    server: FakeServer,
) -> None:
    lock = make(application_name="billing-leader")
    await lock.start()
    assert await lock.wait_for_leadership(5)
    session = server.holder(1, 2)
    assert session is not None
    assert session.options is not None
    assert session.options.application_name == "billing-leader"
    assert session.options.lease_s == lock.lease_s
    await lock.shutdown()

    server.in_recovery = True
    standby = make()
    rec = recorder(standby)
    await standby.start()
    await rec.wait_event("error")
    assert isinstance(rec.errors()[0], StandbyError)
    assert not standby.is_leader
    assert server.holder(1, 2) is None


async def test_started_probes_answer_keep_the_watch_and_fail_once_terminated(
    server: FakeServer,
) -> None:
    session = await _session(server)
    assert await session.try_lock(1, 2)
    assert await session.holds(1, 2)
    fired = asyncio.Event()
    session.watch(fired.set)
    for _ in range(3):
        probe = session.start_probe()
        assert probe is not None  # never None on a live session
        await asyncio.wait_for(probe, 5)
    assert not fired.is_set()
    server.terminate(session)
    await asyncio.wait_for(fired.wait(), 5)  # the watch outlived the probes
    probe = session.start_probe()
    with pytest.raises(ConnectionError) as info:
        await asyncio.wait_for(probe, 5)
    assert info.value.__cause__ is not None
    await session.close()


async def test_a_lock_gone_right_after_its_grant_is_caught_by_the_first_probe(
    server: FakeServer,
) -> None:
    """The core asks ``holds()`` at the first probe after every grant (a pooler that
    resets server connections would free the lock while the session lives on): a lock
    freed under a live session right after its grant is lost at that probe. Only then
    does the core take the cheap probe, which checks liveness alone."""
    async with fake_locks(server, load_plugins=False, health_interval_s=0.05) as make_lock:
        lock = make_lock()
        lost = asyncio.Event()
        freed: list[int] = []

        def free_it() -> None:  # the lock vanishes; the session itself is fine
            if not freed:
                holder = server.holder(1, 2)
                assert holder is not None
                del server._holds[(1, 2)]
                freed.append(holder.backend_pid or 0)

        lock.on_acquired(free_it)
        lock.on_lost(lost.set)
        await lock.start()
        async with asyncio.timeout(5):
            await lost.wait()
        assert server.calls["holds"] >= 1
        await eventually(lambda: lock.is_leader, what="leading again")


async def test_scripted_probes_fail_hang_and_answer_late(server: FakeServer) -> None:
    session = await _session(server)
    assert await session.try_lock(1, 2)
    assert await session.holds(1, 2)
    server.fail_calls["probe"] = ConnectionError("reset")
    with pytest.raises(ConnectionError, match="reset"):
        await asyncio.wait_for(session.start_probe(), 5)
    server.hang("probe")
    hung = session.start_probe()
    await eventually(lambda: server.calls["start_probe"] >= 2, what="the probe sent")
    assert not hung.done()
    server.release_hangs()
    await asyncio.wait_for(hung, 5)
    server.delays["start_probe"] = 0.05
    await asyncio.wait_for(session.start_probe(), 5)
    assert server.calls["probe"] == server.calls["start_probe"] + server.calls["holds"]
    assert session.acknowledged() is None
    server.acknowledged = False
    assert session.acknowledged() is False
    await session.close()


async def test_abort_frees_the_lock_and_fails_the_call_in_flight(server: FakeServer) -> None:
    session = await _session(server)
    other = await _session(server)
    assert await session.try_lock(1, 2)
    server.hang("unlock")
    call = asyncio.ensure_future(session.unlock(1, 2))
    await eventually(lambda: server.calls["unlock"] == 1, what="the unlock sent")
    session.abort()
    session.abort()  # idempotent
    with pytest.raises(ConnectionError):
        await asyncio.wait_for(call, 5)
    assert server.holder(1, 2) is None
    assert session.keep_alive() is None  # a closed session shows nothing
    assert await other.try_lock(1, 2)
    server.release_hangs()
    await session.close()
    await other.close()


async def test_the_lease_ends_an_idle_session_granted_a_lock(server: FakeServer) -> None:
    session = await _session(server, lease_s=0.05)
    follower = await _session(server, lease_s=0.05)
    assert await session.try_lock(1, 2)
    assert not await follower.try_lock(1, 2)
    fired = asyncio.Event()
    session.watch(fired.set)
    await asyncio.wait_for(fired.wait(), 5)  # the server ended it: FATAL on the socket
    assert session.lease_expired
    assert server.holder(1, 2) is None
    assert not follower.lease_expired  # never granted a lock: no lease
    with pytest.raises(ConnectionError) as info:
        await session.holds(1, 2)
    assert "idle-session timeout" in str(info.value.__cause__)
    await session.close()
    await follower.close()


async def test_prepare_table_checks_every_call_and_refuses_as_scripted(
    server: FakeServer,
) -> None:
    session = await _session(server)
    await session.prepare_table(TERMS)
    await session.prepare_table(TERMS)
    assert server.table_checks == [(session, TERMS), (session, TERMS)]  # no caching
    refusal = UntrustedObjectError("public.pgleaderlock_terms is owned by mallory")
    server.table_errors[TERMS.shown] = refusal
    with pytest.raises(UntrustedObjectError):
        await session.prepare_table(TERMS)
    assert await session.try_lock(1, 2)
    with pytest.raises(UntrustedObjectError):
        await session.bump_term(TERMS, 1, 2, 0.05)
    del server.table_errors[TERMS.shown]
    assert await session.bump_term(TERMS, 1, 2, 0.05) == 1 << 32 | 1
    await session.close()


async def test_terms_increase_per_key_and_wait_for_fenced_transactions(
    server: FakeServer,
) -> None:
    server.timeline = 3
    session = await _session(server)
    assert await session.bump_term(TERMS, 1, 2, 0.05) == 3 << 32 | 1
    assert await session.bump_term(TERMS, 1, 2, 0.05) == 3 << 32 | 2
    assert await session.bump_term(TERMS, 5, 6, 0.05) == 3 << 32 | 1  # per key
    mine = server.fenced_transaction(1, 2, role="app")
    theirs = server.fenced_transaction(1, 2, role="admin", endable=False)
    assert await session.bump_term(TERMS, 1, 2, 0.01) is None  # blocked: nothing changed
    assert server.term(1, 2) == 3 << 32 | 2
    bump = asyncio.ensure_future(session.bump_term(TERMS, 1, 2, 30))
    ended = await session.end_fenced(TERMS, [(1, 2)])
    assert ended == FencedSessions((mine.pid,), ((theirs.pid, "admin"),))
    assert mine.ended
    assert not bump.done()
    theirs.end()  # the last one commits: the waiting bump goes through at once
    assert await asyncio.wait_for(bump, 5) == 3 << 32 | 3
    assert server.term(1, 2) == 3 << 32 | 3
    await session.close()
