"""A ``Semaphore``'s followers wait on the server (issue 33), on every backend.

With more followers than slots, each slot gets a follower that waits for it on the
server, as a lock's follower waits, so a freed slot goes to it without anyone polling;
the other followers queue on the server for the semaphore's gate, and the gate's one
holder tries the slots' watch locks now and then. Before issue 33 every follower tried
every slot each ``rescan_s`` and no follower ever waited on the server: these tests fail
on that code (no waiter is ever seen, and the fake counts hundreds of tries a second).
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import pytest

from pgleaderlock import FixedInterval, Semaphore, slot_keys
from pgleaderlock.core.semaphore import GATE_POLL_S, gate_keys
from support.fixture_types import LockPids, Terminate
from support.poll import eventually
from support.timings import lock_args

if TYPE_CHECKING:
    from conftest import Recorder
    from contract.conftest import Target

pytestmark = [pytest.mark.integration, pytest.mark.timeout(60)]

LONG_WAIT_S = 30.0
"""Each follower's retry delay: one wait per call lasts this long, far beyond the tests,
so that anything a follower does meanwhile is what it does while it waits."""

LOCK_CALLS = ("try_lock", "wait_lock", "unlock")


def _semaphore(target: Target, name: str, **kwargs: Any) -> Semaphore:
    arguments: dict[str, Any] = {"retry_strategy": FixedInterval(LONG_WAIT_S), **kwargs}
    if target.fake is not None:
        settings = lock_args(target.fast, arguments)
        sem = Semaphore(None, name, slots=2, connect_fn=target.fake.connect, **settings)
    else:
        backend = {"backend": target.flavour.backend, **arguments}
        sem = Semaphore(target.dsn(), name, slots=2, **lock_args(target.fast, backend))
    target.locks.append(sem)
    return sem


async def _start(target: Target, count: int) -> tuple[str, list[Semaphore], list[Semaphore]]:
    """``count`` semaphores of a new name with two slots: the name, the two holders and
    the followers."""
    name = f"semw-{uuid.uuid4().hex[:12]}"
    sems = [_semaphore(target, name) for _ in range(count)]
    for sem in sems:
        await sem.start()
    await eventually(lambda: sum(s.is_leader for s in sems) == 2, 10, "two holders")
    return name, [s for s in sems if s.is_leader], [s for s in sems if not s.is_leader]


async def _watched(waiters: LockPids, name: str, followers: list[Semaphore]) -> bool:
    """Does a follower wait on the server for each slot?"""
    pids = {s.backend_pid for s in followers}
    for keys in slot_keys(name, 2):
        if not pids & set(await waiters(*keys)):
            return False
    return True


async def test_each_slot_has_a_follower_waiting_on_the_server_and_a_freed_slot_goes_to_it(
    target: Target,
    recorder: Callable[[Semaphore], Recorder],
    waiters: LockPids,
    holders: LockPids,
    terminate: Terminate,
) -> None:
    # Four followers: one watches each slot, one holds the gate, one is queued behind it
    # (a slot gets a watcher only while someone stays queued behind the gate's holder).
    name, leading, followers = await _start(target, 6)
    recs = {id(s): recorder(s) for s in followers}
    await eventually(lambda: _watched(waiters, name, followers), 10, "a waiter on each slot")
    victim = leading[0]
    freed = victim.slot
    assert freed is not None
    keys = slot_keys(name, 2)[freed]
    (watcher,) = [s for s in followers if s.backend_pid in await waiters(*keys)]
    await terminate(victim.backend_pid)
    # Granted by the server: the follower's wait lasts 30 s and nobody polls meanwhile.
    await eventually(lambda: watcher.is_leader, 10, "the slot's waiter takes it")
    assert watcher.slot == freed
    assert await holders(*keys) == [watcher.backend_pid]
    assert recs[id(watcher)].errors() == []
    await eventually(lambda: not victim.is_leader, 10, "the victim knows it lost")
    assert sum(s.is_leader for s in (*leading, *followers)) == 2


@pytest.mark.fake_only("the fake counts every call; PostgreSQL's view is the test above")
async def test_waiting_followers_run_no_statement_in_the_steady_state(
    target: Target, waiters: LockPids
) -> None:
    name, _, followers = await _start(target, 12)

    async def settled() -> bool:
        queued = [await waiters(*keys) for keys in (*slot_keys(name, 2), gate_keys(name))]
        return await _watched(waiters, name, followers) and sum(map(len, queued)) == 9

    await eventually(settled, 10, "every follower but the gate's holder waiting on the server")
    assert target.fake is not None
    before = {call: target.fake.calls[call] for call in LOCK_CALLS}
    await asyncio.sleep(1.0)
    after = {call: target.fake.calls[call] for call in LOCK_CALLS}
    # Ten followers of two slots: two wait for a slot, seven queue for the gate, and the
    # gate's holder tries the two watch locks every GATE_POLL_S: one poller's calls,
    # whatever the number of followers. Before issue 33 they tried both slots every
    # 10 ms: about 2,000 tries here.
    assert after["wait_lock"] == before["wait_lock"]
    assert after["unlock"] == before["unlock"]
    assert after["try_lock"] - before["try_lock"] <= 2 * (1.0 / GATE_POLL_S + 2)


@pytest.mark.postgres_only("a watcher is recalled with pg_cancel_backend: the fake has no backends")
async def test_the_gate_holder_left_alone_recalls_a_watcher(
    target: Target, holders: LockPids, waiters: LockPids
) -> None:
    """Two holders, three followers: one watches a slot, one holds the gate and tries the
    slot nobody watches, one is queued behind it. The queued one leaves: nobody would
    take over from the gate's holder if it left, and the watcher waits for its own slot
    only. So the gate's holder recalls the watcher (its wait cancelled), which comes
    back behind it: when the gate's holder leaves in turn, the recalled follower covers
    both slots and takes the one that frees first. Before, a follower that watched a
    slot stayed there with nobody left at the gate (the last follower waited for its
    slot for good); and three followers never lined up so (this test failed so)."""
    name = f"semr-{uuid.uuid4().hex[:12]}"
    fast = {"retry_strategy": FixedInterval(0.2)}
    sems = [_semaphore(target, name, **fast) for _ in range(5)]
    for sem in sems:
        await sem.start()
    await eventually(lambda: sum(s.is_leader for s in sems) == 2, 10, "two holders")
    leading = [s for s in sems if s.is_leader]
    followers = [s for s in sems if not s.is_leader]
    gate, keys = gate_keys(name), slot_keys(name, 2)

    seen: list[int] = []  # the gate's holder and the one queued, as one look saw them

    async def lined_up() -> bool:
        watching = {pid for k in keys for pid in await waiters(*k)}
        at, behind = await holders(*gate), await waiters(*gate)
        seen[:] = [*at, *behind]
        return len(at) == 1 and len(behind) == 1 and len(watching) == 1

    await eventually(lined_up, 10, "a watcher, a gate holder and one queued behind it")
    (at_gate,) = [s for s in followers if s.backend_pid == seen[0]]
    (queued,) = [s for s in followers if s.backend_pid == seen[1]]
    (watcher,) = [s for s in followers if s not in (at_gate, queued)]
    await queued.shutdown()

    async def recalled() -> bool:
        return watcher.backend_pid in await waiters(*gate)

    await eventually(recalled, 10, "the watcher comes back, queued behind the gate's holder")
    assert not any([await waiters(*k) for k in keys])  # nobody watches a slot now
    await at_gate.shutdown()

    async def at_the_gate() -> bool:
        return watcher.backend_pid in await holders(*gate)

    await eventually(at_the_gate, 10, "the recalled follower holds the gate")
    leaving = leading[0]
    freed = leaving.slot
    await leaving.shutdown()
    await eventually(lambda: watcher.is_leader, 10, "the recalled follower takes the slot")
    assert watcher.slot == freed
