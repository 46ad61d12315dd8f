"""A semaphore's keyring (issue 33) on the fake server: no freed slot is left unwatched.

Followers queue for the semaphore's gate; the gate's holder takes the watch lock of each
slot nobody watches and tries those slots; with a follower queued behind it, it hands
the gate on and waits for one slot on the server (its watcher). A wait in one piece
never sees another slot freed, so a design where every follower ends up waiting for a
slot in one piece leaves a slot unwatched for good once its watcher is granted it and
nobody else waits (issue 33's first in-one-piece version: the benchmark caught it).
These tests free such a slot again and ask who takes it. (The fake cannot count the
followers queued for the gate in ``pg_locks``: its gate holder hands the gate on to any
follower queued behind it; the real backends' count is tested in the contract and fault
suites.)
"""

from __future__ import annotations

import asyncio
from typing import Any, cast

from pgleaderlock import slot_keys
from pgleaderlock.core.keys import oid_to_key
from pgleaderlock.core.semaphore import (
    PASS_ON_S,
    QUEUED,
    RECALL,
    Role,
    SlotKeyring,
    gate_keys,
    watch_keys,
)
from pgleaderlock.testing.fake import FakeServer
from pgleaderlock.testing.fake_session import FakeSession
from support.poll import eventually

NAME = "keyring-test"
SLOTS, WATCH, GATE = slot_keys(NAME, 2), watch_keys(NAME, 2), gate_keys(NAME)


def _ring() -> SlotKeyring:
    return SlotKeyring(SLOTS, 0.01, WATCH, GATE)


async def _holders(server: FakeServer) -> list[FakeSession]:
    holders = [await server.connect(), await server.connect()]
    for session, keys in zip(holders, SLOTS, strict=True):
        assert await session.try_lock(*keys)
    return holders


async def test_the_gate_holder_takes_a_slot_nobody_waits_for() -> None:
    server = FakeServer()
    holders = await _holders(server)
    follower, ring = await server.connect(), _ring()
    wait = asyncio.ensure_future(ring.wait_lock(follower, 5.0))
    await eventually(lambda: sorted(ring.watching) == [0, 1], 5, "it covers both slots")
    assert ring.role is Role.GATE  # nobody queued behind it: it keeps the gate
    server.terminate(holders[1])  # slot 1's holder dies
    assert await asyncio.wait_for(wait, 10)
    assert ring.index == 1
    assert server.holder(*SLOTS[1]) is follower
    assert ring.watching == []  # a holder watches nothing, and lets the gate go
    assert [server.holder(*keys) for keys in (*WATCH, GATE)] == [None, None, None]


async def test_a_slot_whose_watcher_was_granted_it_is_watched_again() -> None:
    server = FakeServer()
    holders = await _holders(server)
    sessions = [await server.connect(), await server.connect()]
    rings = [_ring(), _ring()]
    waits = [asyncio.ensure_future(rings[0].wait_lock(sessions[0], 30.0))]
    await eventually(lambda: rings[0].role is Role.GATE, 5, "the first holds the gate")
    waits.append(asyncio.ensure_future(rings[1].wait_lock(sessions[1], 30.0)))
    await eventually(
        lambda: rings[0].role is Role.WATCHER and rings[1].role is Role.GATE,
        5,
        "the first watches a slot, the second holds the gate",
    )
    watched = rings[0].watching[0]
    assert rings[1].watching == [1 - watched]
    server.terminate(holders[watched])  # granted to its watcher by the server
    assert await asyncio.wait_for(waits[0], 10)
    assert rings[0].index == watched
    # The slot has no watcher now: the gate's holder takes its watch lock...
    await eventually(lambda: sorted(rings[1].watching) == [0, 1], 5, "both slots covered")
    server.terminate(sessions[0])  # ...so that when its new holder dies, it is taken
    assert await asyncio.wait_for(waits[1], 10)
    assert rings[1].index == watched
    assert server.holder(*SLOTS[watched]) is sessions[1]
    assert [server.holder(*keys) for keys in (*WATCH, GATE)] == [None, None, None]


class CountingSession(FakeSession):
    """A fake session that answers the keyring's two reads of the server's locks, as
    PostgreSQL answers them from ``pg_locks``: how many others wait for the gate
    (`QUEUED`), and the cancel of a watcher's wait (`RECALL`: here its session ends,
    as the real drivers' sessions end on a cancelled wait)."""

    async def query(self, template: str, values: tuple[object, ...]) -> list[tuple[Any, ...]]:
        oids = cast(tuple[int, int], values)
        key, server = (oid_to_key(oids[0]), oid_to_key(oids[1])), self._server
        waits = [(s, f) for queue in server._waiters.values() for s, f in queue if not f.done()]
        if template == QUEUED:
            queue = server._waiters.get(key, [])
            return [(sum(1 for s, f in queue if s is not self and not f.done()),)]
        assert template == RECALL
        holder = server.holder(*key)
        if holder is None or holder is self or all(s is not holder for s, _ in waits):
            return []
        server.terminate(holder)
        return [(True,)]


async def _counting(server: FakeServer) -> CountingSession:
    session = CountingSession(server, next(server._pids))
    server.sessions.append(session)
    return session


async def test_a_watcher_only_while_a_follower_stays_queued_behind_the_gate() -> None:
    """The gate's holder hands the gate on only with two followers queued behind it,
    and recalls the watcher once nobody is queued behind it any more: then it can leave
    without leaving a slot to nobody. Before, it handed the gate on to the only follower
    queued (this test failed so: the first follower watched a slot at once)."""
    server = FakeServer()
    holders = await _holders(server)
    sessions = [await _counting(server) for _ in range(3)]
    rings = [_ring() for _ in range(3)]
    waits = [asyncio.ensure_future(rings[0].wait_lock(sessions[0], 30.0))]
    await eventually(lambda: sorted(rings[0].watching) == [0, 1], 5, "the first covers both")
    waits.append(asyncio.ensure_future(rings[1].wait_lock(sessions[1], 30.0)))
    await eventually(lambda: rings[1].role is Role.QUEUED, 5, "the second queues")
    await asyncio.sleep(3 * PASS_ON_S)  # three counts: one follower queued behind it
    assert rings[0].role is Role.GATE
    assert sorted(rings[0].watching) == [0, 1]
    waits.append(asyncio.ensure_future(rings[2].wait_lock(sessions[2], 30.0)))
    await eventually(
        lambda: rings[0].role is Role.WATCHER and rings[1].role is Role.GATE,
        5,
        "two queued: the first watches a slot, the second holds the gate",
    )
    watched = rings[0].watching[0]
    assert rings[1].watching == [1 - watched]
    assert rings[2].role is Role.QUEUED
    server.terminate(sessions[2])  # the follower queued behind the gate's holder leaves
    await eventually(lambda: sessions[0].killed, 5, "the gate's holder recalls the watcher")
    await eventually(lambda: sorted(rings[1].watching) == [0, 1], 5, "it covers both slots")
    server.terminate(holders[watched])
    assert await asyncio.wait_for(waits[1], 10)
    assert rings[1].index == watched
    ended = await asyncio.gather(waits[0], waits[2], return_exceptions=True)
    assert all(isinstance(e, ConnectionError) for e in ended), ended  # their sessions ended
