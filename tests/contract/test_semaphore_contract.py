"""``Semaphore``: at most N holders, each on its own slot, on every backend.

Each test runs once per backend flavour (see ``conftest.py``); the fake flavour too,
except where marked ``postgres_only``.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any, Literal

import psycopg
import pytest

from pgleaderlock import (
    ConfigurationError,
    LeaderTasks,
    LockState,
    Semaphore,
    lock_keys,
    slot_keys,
)
from pgleaderlock.core.lock import run_on_session
from support.fixture_types import LockPids, Terminate
from support.poll import eventually
from support.server import Admin
from support.timings import lock_args

if TYPE_CHECKING:
    from conftest import Recorder
    from contract.conftest import Target

pytestmark = [pytest.mark.integration, pytest.mark.timeout(60)]


def _name() -> str:
    return f"sema-{uuid.uuid4().hex[:12]}"


def semaphore(target: Target, name: str, slots: int, **kwargs: Any) -> Semaphore:
    """A Semaphore of the flavour under test (shut down after the test)."""
    if target.fake is not None:
        settings = lock_args(target.fast, {"rescan_s": 0.01}, kwargs)
        sem = Semaphore(None, name, slots=slots, connect_fn=target.fake.connect, **settings)
    else:
        backend = {"backend": target.flavour.backend, "rescan_s": 0.01}
        sem = Semaphore(target.dsn(), name, slots=slots, **lock_args(target.fast, backend, kwargs))
    target.locks.append(sem)
    return sem


def _leading(sems: list[Semaphore]) -> list[Semaphore]:
    return [s for s in sems if s.is_leader]


@pytest.mark.parametrize("follower_mode", ["wait", "poll"])
async def test_n_of_n_plus_one_hold_and_a_released_slot_goes_to_the_waiter(
    target: Target,
    recorder: Callable[[Semaphore], Recorder],
    holders: LockPids,
    follower_mode: Literal["wait", "poll"],
) -> None:
    name = _name()
    sems = [semaphore(target, name, 2, follower_mode=follower_mode) for _ in range(3)]
    recs = {id(s): recorder(s) for s in sems}
    for sem in sems:
        await sem.start()
    await eventually(lambda: len(_leading(sems)) == 2, 10, "two holders")
    (waiter,) = [s for s in sems if not s.is_leader]
    # The waiter keeps trying (a failed attempt per retry delay) and never gets in.
    await eventually(lambda: recs[id(waiter)].names().count("acquire_failed") >= 5, 10)
    leading = _leading(sems)
    assert len(leading) == 2
    assert sorted(s.slot for s in leading) == [0, 1]  # type: ignore[type-var]
    for sem in leading:
        assert sem.held_keys == slot_keys(name, 2)[sem.slot]  # type: ignore[index]
        assert await holders(*sem.held_keys) == [sem.backend_pid]
    assert waiter.slot is None
    assert waiter.held_keys is None
    assert waiter.state is not LockState.LEADER

    leaving = leading[0]
    freed = leaving.slot
    assert freed is not None
    await leaving.step_down()
    await eventually(lambda: waiter.is_leader, 10, "the waiter takes the freed slot")
    assert waiter.slot == freed
    assert await holders(*slot_keys(name, 2)[freed]) == [waiter.backend_pid]
    assert recs[id(waiter)].names().count("acquired") == 1
    assert len(_leading(sems)) <= 2
    # The other slot next: the one that stepped down (now the waiter) finds it.
    (other,) = [s for s in leading if s is not leaving]
    other_slot = other.slot
    await other.step_down()
    await eventually(lambda: leaving.is_leader, 10, "the former holder takes the other slot")
    assert leaving.slot == other_slot
    assert sorted(s.slot for s in _leading(sems)) == [0, 1]
    for sem in sems:
        await sem.shutdown()
    for keys in slot_keys(name, 2):
        assert await holders(*keys) == []
    assert all(rec.errors() == [] for rec in recs.values())


async def test_a_holder_whose_backend_is_terminated_loses_and_its_slot_is_taken(
    target: Target,
    recorder: Callable[[Semaphore], Recorder],
    holders: LockPids,
    terminate: Terminate,
) -> None:
    name = _name()
    sems = [semaphore(target, name, 2) for _ in range(3)]
    recs = {id(s): recorder(s) for s in sems}
    for sem in sems:
        await sem.start()
    await eventually(lambda: len(_leading(sems)) == 2, 10, "two holders")
    (waiter,) = [s for s in sems if not s.is_leader]
    victim = _leading(sems)[0]
    freed = victim.slot
    assert freed is not None
    await terminate(victim.backend_pid)
    await eventually(lambda: waiter.is_leader, 10, "the waiter takes the freed slot")
    await eventually(lambda: "lost" in recs[id(victim)].names(), 10, "the victim's on_lost")
    assert waiter.slot == freed
    # The victim comes back as a follower: the two slots are taken.
    await eventually(lambda: recs[id(victim)].names().count("acquire_failed") >= 2, 10)
    assert not victim.is_leader
    assert len(_leading(sems)) == 2
    held = [await holders(*keys) for keys in slot_keys(name, 2)]
    assert sorted(held) == sorted([s.backend_pid] for s in _leading(sems))


async def test_one_slot_is_a_lock_that_waits_on_the_server(
    target: Target, holders: LockPids, waiters: LockPids
) -> None:
    name = _name()
    first, second = semaphore(target, name, 1), semaphore(target, name, 1)
    await first.start()
    assert await first.wait_for_leadership(10)
    await second.start()
    (keys,) = slot_keys(name, 1)
    await eventually(lambda: _waits(waiters, keys, second), 10, "a wait on the server")
    await first.shutdown()
    assert await second.wait_for_leadership(10)
    assert second.slot == 0
    assert await holders(*keys) == [second.backend_pid]


async def _waits(waiters: LockPids, keys: tuple[int, int], sem: Semaphore) -> bool:
    return sem.backend_pid is not None and sem.backend_pid in await waiters(*keys)


@pytest.mark.postgres_only("fence() runs in a transaction on a connection of the test server")
async def test_each_slot_has_its_own_term(target: Target, pg_dsn: str) -> None:
    name = _name()
    sems = [semaphore(target, name, 2, fencing=True) for _ in range(3)]
    for sem in sems:
        await sem.start()
    await eventually(lambda: len(_leading(sems)) == 2, 10, "two holders")
    (waiter,) = [s for s in sems if not s.is_leader]
    leaving, staying = _leading(sems)
    terms = {s.slot: s.term for s in (leaving, staying)}
    assert None not in terms.values()
    assert waiter.term is None

    async with await psycopg.AsyncConnection.connect(pg_dsn) as conn:
        async with conn.transaction():
            assert await leaving.fence(conn) == terms[leaving.slot]
        freed = leaving.slot
        await leaving.step_down()
        await eventually(lambda: waiter.is_leader, 10, "the waiter takes the freed slot")
        assert waiter.slot == freed
        assert waiter.term is not None
        assert waiter.term > terms[freed]
        assert staying.term == terms[staying.slot]  # the other slot's term did not move
        async with conn.transaction():
            assert await waiter.fence(conn) == waiter.term
        async with conn.transaction():
            assert await staying.fence(conn) == staying.term


async def test_leader_tasks_and_run_on_session_run_on_the_holders(target: Target) -> None:
    name = _name()
    sems = [semaphore(target, name, 2) for _ in range(3)]
    running: set[int] = set()

    def work(sem: Semaphore) -> Callable[[], Awaitable[None]]:
        async def task() -> None:
            running.add(id(sem))
            try:
                await asyncio.Event().wait()
            finally:
                running.discard(id(sem))

        return task

    tasks = [LeaderTasks(sem) for sem in sems]
    for sem, leader_tasks in zip(sems, tasks, strict=True):
        leader_tasks.add(work(sem))
        await sem.start()
    try:
        await eventually(lambda: len(running) == 2, 10, "leader work on two holders")
        assert running == {id(s) for s in _leading(sems)}
        holder = _leading(sems)[0]
        pid = await run_on_session(holder, _session_pid, 5.0)
        assert pid == holder.backend_pid
        await holder.step_down()
        await eventually(
            lambda: running == {id(s) for s in _leading(sems)} and len(running) == 2, 10
        )
        assert id(holder) not in running
    finally:
        for sem in sems:
            await sem.shutdown()
        for leader_tasks in tasks:
            await leader_tasks.stop()
    assert running == set()


async def _session_pid(slot: Any) -> int | None:
    return slot.session.backend_pid  # type: ignore[no-any-return]


async def test_slot_keys_are_what_sql_derives_and_no_name_gives_them(admin: Admin) -> None:
    name = "sema-billing-workers"
    cur = await admin.execute(
        "SELECT ('x' || substr(md5(%(n)s || chr(31) || i), 1, 8))::bit(32)::int,"
        " ('x' || substr(md5(%(n)s || chr(31) || i), 9, 8))::bit(32)::int"
        " FROM generate_series(0, 3) AS i ORDER BY i",
        {"n": name},
    )
    assert [tuple(row) for row in await cur.fetchall()] == slot_keys(name, 4)
    assert lock_keys(name) not in slot_keys(name, 4)
    for index in range(4):
        with pytest.raises(ConfigurationError):
            lock_keys(f"{name}\x1f{index}")  # the string a slot's keys come from
    for bad in (0, -1, True, 1.5):
        with pytest.raises(ConfigurationError):
            slot_keys(name, bad)  # type: ignore[arg-type]
    with pytest.raises(ConfigurationError):
        Semaphore("postgresql://localhost/x", name, slots=2, rescan_s=0)
