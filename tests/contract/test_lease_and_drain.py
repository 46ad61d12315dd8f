"""The lease and the drain, the same on every backend.

The lease: a session granted a lock carries ``idle_session_timeout`` (``lease_s``), so
that the server frees the lock of a leader whose probes stop (a blocked event loop, a
frozen process); slow callbacks keep it alive. The drain: with ``drain_s`` a graceful
stop lets leader work finish its unit first, while the lock stays LEADER.

The process-level faults (a frozen process, a blocked loop, a frozen fenced transaction,
watched by a follower in another process) are in ``tests/faults/test_frozen_leader.py``.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from typing import TYPE_CHECKING, cast

import psycopg
import pytest

from pgleaderlock import ConnectionError, FixedInterval, LeaderTasks, LockState
from pgleaderlock.core import QuerySession, SessionSlot, run_on_session
from pgleaderlock.core.keys import key_to_oid
from support.fixture_types import LockPids, MakeRecorder
from support.poll import eventually
from support.sessions import equals

if TYPE_CHECKING:
    from contract.conftest import Target

S = LockState
pytestmark = [pytest.mark.integration, pytest.mark.timeout(60)]

HOLDER = (
    "SELECT pid FROM pg_locks WHERE locktype = 'advisory' AND granted AND objsubid = 2"
    " AND classid = %s::int8::oid AND objid = %s::int8::oid"
)


class HolderWatch:
    """Polls who holds the lock every 20 ms, in a thread of its own (the test blocks its
    event loop): ``seen`` is the holders' pids in order, without repeats, ``None`` for
    nobody."""

    def __init__(self, dsn: str, keys: tuple[int, int]) -> None:
        self.seen: list[int | None] = []
        self._dsn, self._oids = dsn, tuple(key_to_oid(k) for k in keys)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._poll, name="holder-watch")

    def __enter__(self) -> HolderWatch:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(10)

    def _poll(self) -> None:
        with psycopg.connect(self._dsn, autocommit=True, connect_timeout=5) as conn:
            while not self._stop.is_set():
                row = conn.execute(HOLDER, self._oids).fetchone()
                holder = None if row is None else int(row[0])
                if not self.seen or self.seen[-1] != holder:
                    self.seen.append(holder)
                self._stop.wait(0.02)


@pytest.mark.postgres_only("the fake has no lease: it cannot end a silent session")
async def test_a_leader_whose_event_loop_stops_loses_the_lock_to_its_lease(
    target: Target, keys: tuple[int, int], recorder: MakeRecorder
) -> None:
    """The event loop blocks (a synchronous call) for longer than the lease: the server
    ends the session and frees the lock while the loop is blocked, with no help from
    the client. Once the loop runs again the lock learns of the loss at once
    (``on_lost``) and competes again."""
    lock = target.lock(keys)
    assert lock.lease_s == pytest.approx(2.1)  # the contract timings' default
    rec = recorder(lock)
    await lock.start()
    assert await lock.wait_for_leadership(10)
    pid = lock.backend_pid
    await asyncio.sleep(0.5)  # a few probes
    with HolderWatch(target.pg_dsn, keys) as watch:
        time.sleep(lock.lease_s + 1.5)  # the blocked event loop under test
        freed_while_blocked = list(watch.seen)
    assert freed_while_blocked[0] == pid
    assert None in freed_while_blocked, "the server did not free the lock within the lease"
    await rec.wait_event("lost", timeout=5)
    assert rec.names()[:2] == ["acquired", "lost"]
    assert await lock.wait_for_leadership(10)  # no one else wanted it
    assert lock.backend_pid != pid


@pytest.mark.postgres_only("the fake has no lease: nothing to keep alive")
async def test_slow_callbacks_do_not_cost_the_lock(
    target: Target,
    keys: tuple[int, int],
    recorder: MakeRecorder,
    holders: LockPids,
) -> None:
    """Callbacks that run longer than the lease (an ``on_acquired`` that warms a cache)
    keep the lock: while the lifecycle task awaits them, keep-alives renew the lease.
    Only a loop that stops loses it."""
    lock = target.lock(keys)
    rec = recorder(lock)
    slow_s = lock.lease_s + 1.5
    done = asyncio.Event()

    async def warm_up() -> None:
        await asyncio.sleep(slow_s)
        done.set()

    lock.on_acquired(warm_up)
    await lock.start()
    await asyncio.wait_for(done.wait(), slow_s + 10)
    pid = lock.backend_pid
    await asyncio.sleep(0.5)  # probes after the callback: the session is the same
    assert lock.is_leader
    assert lock.backend_pid == pid
    assert await holders(*keys) == [pid]
    assert "lost" not in rec.names()
    assert lock.statistics().losses == 0


async def test_a_drain_lets_leader_work_finish_its_unit_before_the_release(
    target: Target,
    keys: tuple[int, int],
    recorder: MakeRecorder,
    holders: LockPids,
) -> None:
    """With ``drain_s``, ``step_down()`` first lets a leader task finish the unit of
    work it is in: the lock stays LEADER (and keeps probing) while ``draining``, the
    task returns by itself, and only then is the lock released. A follower leads after
    that, never during the drain."""
    lock = target.lock(keys, drain_s=10.0, retry_strategy=FixedInterval(0.5))
    other = target.lock(keys)
    tasks = LeaderTasks(lock)
    rec = recorder(lock)
    units: list[tuple[str, bool]] = []  # (event, lock.is_leader then)
    in_unit = asyncio.Event()

    @tasks.task
    async def work() -> None:
        while not tasks.draining:
            units.append(("begin", lock.is_leader))
            in_unit.set()
            await asyncio.sleep(0.6)  # one unit of work
            units.append(("end", lock.is_leader))

    await lock.start()
    assert await lock.wait_for_leadership(10)
    await other.start()
    in_unit.clear()
    await asyncio.wait_for(in_unit.wait(), 5)
    probes = lock.statistics().probes
    await lock.step_down()
    assert units[-1] == ("end", True)  # the unit in flight finished, still leading
    assert all(leading for _, leading in units)
    assert tasks.running == []
    assert rec.names()[:2] == ["acquired", "released"]
    assert lock.statistics().probes > probes or target.flavour.fake  # it kept probing
    assert await other.wait_for_leadership(10)
    if not target.flavour.fake:
        assert await holders(*keys) == [other.backend_pid]
    await tasks.close()


async def test_a_drain_ends_after_drain_s(
    target: Target, keys: tuple[int, int], recorder: MakeRecorder
) -> None:
    """A task that does not look at ``draining`` keeps the lock only for ``drain_s``:
    then it is cancelled, and the lock is released (``shutdown()`` here)."""
    lock = target.lock(keys, drain_s=0.5)
    tasks = LeaderTasks(lock)
    rec = recorder(lock)
    cancelled = asyncio.Event()
    draining_seen: list[bool] = []

    @tasks.task
    async def stubborn() -> None:
        try:
            while True:
                draining_seen.append(lock.draining)
                await asyncio.sleep(0.05)
        except asyncio.CancelledError:
            cancelled.set()
            raise

    await lock.start()
    assert await lock.wait_for_leadership(10)
    await eventually(lambda: draining_seen, 5, "the task running")
    await lock.shutdown(timeout_s=10)
    assert cancelled.is_set()
    assert True in draining_seen
    # It was cancelled when the drain ended: about drain_s (0.5 s) of 50 ms turns after
    # it first saw the drain, not a loop that went on. (Its very last turn may already
    # see the drain over: the flag falls as the drain ends, the cancel lands next.)
    assert len(draining_seen) - draining_seen.index(True) <= 40
    assert rec.names()[-2:] == ["released", "stopped"]
    await tasks.close()


async def test_no_drain_by_default(
    target: Target, keys: tuple[int, int], recorder: MakeRecorder
) -> None:
    """Without ``drain_s``, a step-down cancels leader tasks at once, as it always did."""
    lock = target.lock(keys)
    tasks = LeaderTasks(lock)
    seen: list[bool] = []

    @tasks.task
    async def work() -> None:
        while True:
            seen.append(lock.draining)
            await asyncio.sleep(0.05)

    await lock.start()
    assert await lock.wait_for_leadership(10)
    await eventually(lambda: seen, 5, "the task running")
    await lock.step_down()
    assert seen
    assert not any(seen)
    assert tasks.running == []
    assert lock.state in (S.FOLLOWER, S.ACQUIRING, S.LEADER)
    await tasks.close()


@pytest.mark.postgres_only("the fake's sessions run no statement that lasts")
async def test_a_stop_that_cuts_work_short_releases_without_an_error(
    target: Target,
    keys: tuple[int, int],
    recorder: MakeRecorder,
    holders: LockPids,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Without a drain, a stop cuts short a statement running on the leader's session
    (a scheduler's ledger statement): the session is dropped, and that frees the lock.
    The release says so (``on_released``); it does not send an unlock down the dropped
    session and report the closed connection as an error."""
    lock = target.lock(keys)
    rec = recorder(lock)
    await lock.start()
    assert await lock.wait_for_leadership(10)
    pid = lock.backend_pid

    async def statement(slot: SessionSlot) -> object:
        session = cast(QuerySession, slot.session)
        return await session.query("SELECT pg_sleep({0}::float8)", (30.0,))

    work = asyncio.ensure_future(run_on_session(lock, statement, 60))
    async with await psycopg.AsyncConnection.connect(target.pg_dsn, autocommit=True) as admin:

        async def sleeping() -> bool:
            cur = await admin.execute(
                "SELECT count(*) FROM pg_stat_activity WHERE pid = %s AND state = 'active'"
                " AND query LIKE '%%pg_sleep%%'",
                (pid,),
            )
            row = await cur.fetchone()
            return row is not None and row[0] == 1

        await eventually(sleeping, 10, "the statement to run on the leader's session")
    with caplog.at_level("INFO", logger="pgleaderlock"):
        await lock.shutdown()
    with pytest.raises(ConnectionError, match="stopping"):
        await work
    assert rec.names() == ["acquired", "released", "stopped"]
    assert [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR] == []
    await eventually(lambda: equals(holders(*keys), []), 5, "the server to free the lock")
