"""A LeaderLock on the FakeServer through the session capabilities the fake now has:
the idle leader's probe loop (probes started as futures, the watch, keep-alives, late
probes), and fencing terms. No server; nothing here measures time."""

from __future__ import annotations

import asyncio
import functools
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import pytest

from pgleaderlock import (
    ConnectionError,
    FixedInterval,
    LeaderLock,
    LockState,
    MissingPrivilegeError,
)
from pgleaderlock.core import SessionSlot, run_on_session
from pgleaderlock.testing import FakeServer
from support.fixture_types import MakeLock, MakeRecorder
from support.locks import fake_locks
from support.poll import eventually

if TYPE_CHECKING:
    from conftest import Recorder

S = LockState
pytestmark = pytest.mark.timeout(30)

TIMINGS: dict[str, Any] = {"health_interval_s": 0.05, "health_timeout_s": 0.2}


@dataclass(frozen=True)
class Fake:
    """What each test here uses: ``make(**kwargs)`` a lock (keys 1, 2) on ``server``,
    probing every 50 ms; ``recorder(lock)`` its callbacks."""

    make: MakeLock
    recorder: MakeRecorder
    server: FakeServer

    async def leader(self, **kwargs: Any) -> tuple[LeaderLock, Recorder]:
        """A lock made with ``kwargs``, recorded, started, and leading."""
        lock = self.make(**kwargs)
        recorded = self.recorder(lock)
        await _leading(lock)
        return lock, recorded


@pytest.fixture
async def fake(server: FakeServer, recorder: MakeRecorder) -> AsyncIterator[Fake]:
    """The locks are shut down after the test, which leaves no session open."""
    async with fake_locks(server, load_plugins=False, **TIMINGS) as make_lock:
        yield Fake(make_lock, recorder, server)


async def _leading(lock: LeaderLock) -> None:
    await lock.start()
    assert await lock.wait_for_leadership(5)


# ---------------------------------------------------------------- the idle leader


async def test_an_idle_leader_stays_leader_over_many_started_probes(fake: Fake) -> None:
    server = fake.server
    lock, rec = await fake.leader()
    session = server.holder(1, 2)
    before = server.calls["start_probe"]
    await eventually(lambda: server.calls["start_probe"] >= before + 20, what="20 probes")
    assert lock.is_leader
    assert server.holder(1, 2) is session
    assert server.hold_count(1, 2) == 1  # probing never takes the lock again
    assert server.calls["connect"] == 1
    assert rec.names() == ["acquired"]
    assert rec.states() == [S.FOLLOWER, S.ACQUIRING, S.LEADER]


async def test_a_failed_probe_costs_the_leadership_then_the_lock_comes_back(fake: Fake) -> None:
    server = fake.server
    lock, rec = await fake.leader()
    first = server.holder(1, 2)
    assert first is not None
    server.fail_calls["start_probe"] = ConnectionError("connection reset by peer")
    await rec.wait_event("lost")
    assert first.closed  # a failed session is never reused
    await rec.wait_event("acquired", count=2)
    assert lock.is_leader
    assert server.holder(1, 2) not in (None, first)
    assert rec.names()[:3] == ["acquired", "lost", "acquired"]


async def test_a_probe_that_hangs_past_health_timeout_is_late_and_loses(fake: Fake) -> None:
    """The server never answers and the transport cannot say that it has the probe:
    lost at the health timeout, the session dropped (not awaited any longer)."""
    server = fake.server
    lock, rec = await fake.leader()
    first = server.holder(1, 2)
    assert first is not None
    server.hang("start_probe")
    await rec.wait_event("lost")
    assert not lock.is_leader
    assert first.closed
    assert server.holder(1, 2) is not first
    assert server.calls["acknowledged"] >= 1  # asked whether the probe reached the server
    server.release_hangs()
    await rec.wait_event("acquired", count=2)
    assert server.holder(1, 2) not in (None, first)


async def test_a_late_probe_the_server_acknowledged_keeps_the_lock_until_it_answers(
    fake: Fake,
) -> None:
    """A slow server, not a silent network: not LEADER while the answer is late, the
    session and its lock kept; LEADER again on the same session once it answers."""
    server = fake.server
    lock, rec = await fake.leader(reconnect_grace_s=5.0)
    session = server.holder(1, 2)
    assert session is not None
    server.acknowledged = True
    server.hang("start_probe")
    await rec.wait_state(S.RECONNECTING)
    assert not lock.is_leader
    assert server.holder(1, 2) is session
    assert not session.closed
    server.release_hangs()
    await rec.wait_state(S.LEADER)
    assert server.holder(1, 2) is session
    assert server.calls["connect"] == 1
    assert rec.names() == ["acquired"]  # flap damping: no loss reported


async def test_the_watch_reports_a_terminated_idle_leader_before_the_next_probe(fake: Fake) -> None:
    make, recorder, server = fake.make, fake.recorder, fake.server
    lock = make(health_interval_s=60)  # the periodic probe would come far too late
    rec = recorder(lock)
    await _leading(lock)
    first = server.holder(1, 2)
    probes = server.calls["probe"]
    server.terminate()
    await rec.wait_event("lost", timeout=5)
    assert server.calls["probe"] == probes + 1  # one probe, the alarm's, which failed
    await rec.wait_event("acquired", count=2)
    assert server.holder(1, 2) not in (None, first)


async def test_step_down_while_idle_releases_to_a_follower(fake: Fake) -> None:
    make, recorder, server = fake.make, fake.recorder, fake.server
    a = make(retry_strategy=FixedInterval(30))  # after stepping down, a stays back
    b = make()
    rec_a, rec_b = recorder(a), recorder(b)
    await _leading(a)
    first = server.holder(1, 2)
    await b.start()
    await rec_b.wait_event("acquire_failed")
    before = server.calls["start_probe"]
    await eventually(lambda: server.calls["start_probe"] >= before + 3, what="a idle, probing")
    await a.step_down(5)
    assert a.state is S.FOLLOWER
    assert rec_a.names() == ["acquired", "released"]
    await rec_b.wait_event("acquired")
    assert b.is_leader
    assert not a.is_leader
    assert server.holder(1, 2) not in (None, first)


async def test_slow_on_acquired_callbacks_keep_the_session_alive_past_its_lease(fake: Fake) -> None:
    """The server ends a session granted a lock once it idles for ``lease_s``; while an
    ``on_acquired`` callback runs for many leases, keep-alives show it the client lives."""
    make, recorder, server = fake.make, fake.recorder, fake.server
    lock = make(lease_s=0.3)
    rec = recorder(lock)
    done = asyncio.Event()

    async def warm_up() -> None:
        # ten keep-alives, one per health interval: longer than the lease
        await eventually(lambda: server.calls["keep_alive"] >= 10, what="keep-alives")
        done.set()

    lock.on_acquired(warm_up)
    await lock.start()
    await asyncio.wait_for(done.wait(), 10)
    session = server.holder(1, 2)
    assert session is not None
    assert session.options is not None
    assert session.options.lease_s == pytest.approx(0.3)  # the server enforces this lease
    assert await lock.wait_for_leadership(5)
    assert not session.lease_expired
    assert server.holder(1, 2) is session
    assert server.calls["connect"] == 1
    assert "lost" not in rec.names()


# ---------------------------------------------------------------- fencing


async def test_fencing_terms_increase_across_leaderships_and_locks(fake: Fake) -> None:
    make, recorder, server = fake.make, fake.recorder, fake.server
    a = make(fencing=True, retry_strategy=FixedInterval(30))
    b = make(fencing=True)
    rec_b = recorder(b)
    await _leading(a)
    first = a.term
    assert first is not None
    assert first == server.term(1, 2) == 1 << 32 | 1  # timeline 1, first term
    await b.start()
    await rec_b.wait_event("acquire_failed")
    await a.step_down(5)
    await rec_b.wait_event("acquired")
    second = b.term
    assert second is not None
    assert second > first
    assert server.term(1, 2) == second
    server.terminate()  # b's session ends; b leads again (a waits 30 s to retry)
    await rec_b.wait_event("acquired", count=2)
    third = b.term
    assert third is not None
    assert third > second
    assert server.term(1, 2) == third


async def test_a_bump_blocked_by_an_old_fenced_transaction_ends_it_then_leads(fake: Fake) -> None:
    """The old leader left a fenced transaction open on the term's row: the new term
    waits ``fencing_grace_s``, then the transaction's session is ended and the lock
    leads with a higher term."""
    make, recorder, server = fake.make, fake.recorder, fake.server
    a = make(fencing=True, retry_strategy=FixedInterval(30))
    await _leading(a)
    old_term = a.term
    assert old_term is not None
    frozen = await server.connect()  # the frozen old leader's connection for its work
    stuck = server.fenced_transaction(1, 2, session=frozen)
    assert stuck.term == old_term
    b = make(fencing=True, fencing_grace_s=0.05)
    rec_b = recorder(b)
    await b.start()
    await rec_b.wait_event("acquire_failed")
    await a.step_down(5)
    await rec_b.wait_event("acquired")
    assert stuck.ended
    assert frozen.killed
    assert b.term is not None
    assert b.term > old_term
    assert server.fenced == []
    await frozen.close()


async def test_a_bump_blocked_by_a_fenced_transaction_it_may_not_end_waits_for_it(
    fake: Fake,
) -> None:
    """A fenced transaction of another role stays: the lock is granted but does not
    lead (no term) until the transaction ends by itself."""
    make, recorder, server = fake.make, fake.recorder, fake.server
    lock = make(fencing=True, fencing_grace_s=0.05)
    rec = recorder(lock)
    stuck = server.fenced_transaction(1, 2, role="other_app", endable=False)
    await lock.start()
    await eventually(lambda: server.calls["end_fenced"] >= 3, what="three rounds")
    assert server.holder(1, 2) is not None  # the advisory lock is granted...
    assert not lock.is_leader  # ...but the lock does not lead without its term
    assert lock.term is None
    assert server.term(1, 2) is None
    assert "acquired" not in rec.names()
    stuck.end()
    await rec.wait_event("acquired")
    assert lock.term == server.term(1, 2) == 1 << 32 | 1


async def test_a_refused_fencing_table_stops_the_lock_with_its_error(fake: Fake) -> None:
    make, recorder, server = fake.make, fake.recorder, fake.server
    refusal = MissingPrivilegeError(
        'GRANT SELECT, INSERT, UPDATE ON "public"."pgleaderlock_terms" TO "app"'
    )
    server.table_errors["public.pgleaderlock_terms"] = refusal
    lock = make(fencing=True)
    rec = recorder(lock)
    await lock.start()
    await rec.wait_state(S.STOPPED)
    assert refusal in rec.errors()
    assert "acquired" not in rec.names()
    assert server.holder(1, 2) is None
    assert server.term(1, 2) is None


# ---------------------------------------------------------------- calls on the session


async def test_calls_on_a_leaders_session_run_there_and_a_failed_one_loses(fake: Fake) -> None:
    """``run_on_session``: calls the machine schedules between the leader's probes run
    on its own session, several queued at once in order; the first that fails costs the
    leadership, as a failed probe does, and the calls queued behind it fail with it."""
    lock, rec = await fake.leader()
    session = fake.server.holder(1, 2)
    ran: list[int] = []

    async def on_it(slot: SessionSlot, i: int) -> bool:
        ran.append(i)
        assert slot.session is session
        return await session.holds(1, 2)  # type: ignore[union-attr]

    answers = await asyncio.gather(
        *(run_on_session(lock, functools.partial(on_it, i=i), 5) for i in range(5))
    )
    assert answers == [True] * 5
    assert ran == [0, 1, 2, 3, 4]
    assert lock.is_leader

    async def fails(slot: SessionSlot) -> None:
        raise ConnectionError("the statement failed")

    with pytest.raises(ConnectionError, match="the statement failed"):
        await run_on_session(lock, fails, 5)
    await rec.wait_event("lost")
    assert session is not None
    assert session.closed
