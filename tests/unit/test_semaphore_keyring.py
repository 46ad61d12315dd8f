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

from pgleaderlock import slot_keys
from pgleaderlock.core.semaphore import Role, SlotKeyring, gate_keys, watch_keys
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
