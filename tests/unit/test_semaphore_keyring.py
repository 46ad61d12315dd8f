"""A semaphore's keyring (issue 33) on the fake server: a watcher of one slot still finds
a slot that nobody watches.

A follower that became the watcher of slot 0 (it queued for its watch lock) while slot
1 has no watcher (fewer followers than slots) must not wait for slot 0 alone: a wait on
the server for one slot never sees the other freed. The first version waited for slot 0
in one piece, for good, and slot 1 stayed free: this test failed there.
"""

from __future__ import annotations

import asyncio

from pgleaderlock import slot_keys
from pgleaderlock.core.semaphore import SlotKeyring, watch_keys
from pgleaderlock.testing.fake import FakeServer

NAME = "keyring-test"


async def test_a_watcher_of_one_slot_takes_another_slot_nobody_watches() -> None:
    server = FakeServer()
    slots, watch = slot_keys(NAME, 2), watch_keys(NAME, 2)
    holders = [await server.connect(), await server.connect()]
    for session, keys in zip(holders, slots, strict=True):
        assert await session.try_lock(*keys)
    follower = await server.connect()
    ring = SlotKeyring(slots, 0.01, watch)
    # The follower queued for slot 0's watch lock and was granted it: it watches slot 0.
    assert await follower.try_lock(*watch[0])
    ring._adopt(follower)
    ring.watching = [0]
    wait = asyncio.ensure_future(ring.wait_lock(follower, 5.0))
    await asyncio.sleep(0.05)
    server.terminate(holders[1])  # slot 1's holder dies; nobody waits for slot 1
    assert await asyncio.wait_for(wait, 10)
    assert ring.index == 1
    assert server.holder(*slots[1]) is follower
    assert ring.watching == []  # a holder watches nothing
    assert server.holder(*watch[0]) is None
    assert server.holder(*watch[1]) is None
