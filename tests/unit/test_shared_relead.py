"""How a shared-sessions member takes many names at once (a member gone: issue 33, its
names re-led near the floor), without a database: the member's steps (``SharedEngine``)
with the hold session's calls replaced.

The names are locked in chunks on one call, the workers of each chunk starting while the
next statement runs; the member decides which of a dead member's names are its own from
weights worked out before the death; the ring watch tells the group from its own
session.
"""

from __future__ import annotations

import asyncio
import dataclasses
import gc
import random
import time
from collections.abc import Awaitable, Callable
from typing import Any

import pytest

from pgleaderlock import Coordinator, lock_keys
from pgleaderlock.coordination import balance, shared
from pgleaderlock.coordination import watch as watch_module
from pgleaderlock.coordination.events import MemberGone
from pgleaderlock.coordination.protocol import Key, Message
from pgleaderlock.coordination.shared import SharedEngine
from pgleaderlock.coordination.workers import WorkerContext, gc_deferred

DSN = "postgresql://u@h/db"


class Slot:
    """The hold lock's session slot, as a call sees it."""

    def __init__(self, session: object) -> None:
        self.session = session
        self.grants = 0
        self.calls = 0

    def granted(self) -> None:
        self.grants += 1

    async def close(self) -> None:
        return None

    def abort(self) -> None:
        return None


class Session:
    """``try_lock_many`` grants what it is asked; ``on_call(i, keys)`` runs first (``i``
    from 1), and may raise."""

    def __init__(self, on_call: Callable[[int, list[Key]], Awaitable[None]]) -> None:
        self.calls: list[list[Key]] = []
        self._on_call = on_call

    async def try_lock_many(self, keys: list[Key]) -> list[Key]:
        self.calls.append(list(keys))
        await self._on_call(len(self.calls), keys)
        await asyncio.sleep(0)  # the statement runs on the server meanwhile
        return list(keys)


def engine(n: int) -> tuple[SharedEngine, list[str]]:
    """A shared-sessions member with ``n`` names; the list records each worker's run."""
    ran: list[str] = []

    async def work(ctx: WorkerContext) -> None:
        ran.append(ctx.name)
        await asyncio.Event().wait()

    coord = Coordinator(DSN, group="g", sessions="shared")
    for i in range(n):
        coord.add(f"n{i}", work)
    found = coord._engine
    assert isinstance(found, SharedEngine)
    return found, ran


def serve(eng: SharedEngine, session: Session) -> Slot:
    """The hold lock's calls run on ``session``."""
    slot = Slot(session)

    async def call_slot(fn: Callable[[Any], Awaitable[Any]], timeout_s: float | None = None) -> Any:
        slot.calls += 1
        return await fn(slot)

    eng.membership.call_slot = call_slot  # type: ignore[method-assign,assignment]
    return slot


def test_chunks_start_small_and_double_up_to_the_largest() -> None:
    keys = [lock_keys(f"k{i}") for i in range(6000)]
    parts = shared.chunks(keys)
    assert [len(p) for p in parts] == [128, 256, 512, 1024, 1024, 1024, 1024, 1008]
    assert [k for p in parts for k in p] == keys
    assert shared.chunks(keys[:5]) == [keys[:5]]
    assert shared.chunks([]) == []
    # At most MAX_CALL (2048) names a call of the hold session.
    grouped = shared.calls(parts)
    assert [[len(p) for p in c] for c in grouped] == [
        [128, 256, 512, 1024],
        [1024, 1024],
        [1024, 1008],
    ]
    assert shared.calls([]) == []


async def test_the_first_chunks_workers_run_while_the_next_chunk_is_locked() -> None:
    """A take of 600 names sends three statements (128, 256, 216 names); the workers of
    a chunk are started before the next statement is sent and run while it is on the
    server. (The old code locked all 600 in one statement, then started 600 workers.)"""
    eng, ran = engine(600)
    seen: list[tuple[int, int]] = []  # per statement: names led, workers run (as sent)

    async def on_call(i: int, keys: list[Key]) -> None:
        seen.append((len(eng._owned), len(ran)))

    session = Session(on_call)
    slot = serve(eng, session)
    keys = sorted(eng.names)
    try:
        taken = await eng.take(keys, handoff=False)
        assert [len(c) for c in session.calls] == [128, 256, 216]
        assert seen == [(0, 0), (128, 0), (384, 128)]  # the first 128 ran meanwhile
        assert sorted(taken) == keys
        assert slot.grants == 3
        assert slot.calls == 1
        await asyncio.sleep(0)
        assert sorted(ran) == sorted(eng.names[k] for k in keys)
    finally:
        await eng.workers.stop()


async def test_a_large_take_spreads_over_calls_of_bounded_size() -> None:
    """The workers of a call's chunks start within the call's bound (meant for the
    statements): a take of 5,000 names makes three calls of at most 2,048 names."""
    eng, ran = engine(5000)
    sizes: list[int] = []

    async def on_call(i: int, keys: list[Key]) -> None:
        return None

    session = Session(on_call)
    slot = serve(eng, session)
    original = eng.membership.call_slot

    async def call_slot(fn: Callable[[Any], Awaitable[Any]], timeout_s: float | None = None) -> Any:
        before = len(session.calls)
        result = await original(fn, timeout_s)
        sizes.append(sum(len(c) for c in session.calls[before:]))
        return result

    eng.membership.call_slot = call_slot  # type: ignore[method-assign,assignment]
    try:
        taken = await eng.take(sorted(eng.names), handoff=False)
        assert sizes == [1920, 2048, 1032]
        assert slot.calls == 3
        assert sorted(taken) == sorted(eng.names)
        await asyncio.sleep(0)
        assert len(ran) == 5000
    finally:
        await eng.workers.stop()


async def test_a_loss_between_chunks_starts_no_worker_of_the_later_chunks() -> None:
    """The hold lock left LEADER while a take was under way: what later chunks were
    granted is kept for release when it leads again, and none of their workers runs."""
    eng, ran = engine(600)

    async def on_call(i: int, keys: list[Key]) -> None:
        if i == 2:
            eng._losses += 1

    session = Session(on_call)
    serve(eng, session)
    try:
        taken = await eng.take(sorted(eng.names), handoff=False)
        first, later = session.calls[0], session.calls[1] + session.calls[2]
        assert taken == first
        assert set(eng._owned) == set(first)
        assert eng._stale == set(later)
        await asyncio.sleep(0)
        assert sorted(ran) == sorted(eng.names[k] for k in first)
    finally:
        await eng.workers.stop()


async def test_a_failed_chunk_keeps_the_names_taken_before_it() -> None:
    """A statement that fails ends the take (the hold lock leaves LEADER, and its
    workers stop then); the names granted before it are led until that happens."""
    eng, ran = engine(600)

    async def on_call(i: int, keys: list[Key]) -> None:
        if i == 2:
            raise ConnectionError("the server went away")

    session = Session(on_call)
    serve(eng, session)
    try:
        taken = await eng.take(sorted(eng.names), handoff=False)
        assert len(session.calls) == 2
        assert taken == session.calls[0]
        assert set(eng._owned) == set(session.calls[0])
        await asyncio.sleep(0)
        assert len(ran) == 128
    finally:
        await eng.workers.stop()


async def test_a_take_defers_the_garbage_collector() -> None:
    """Thousands of workers starting at once would set off full collections in the
    middle of the take: the collector waits until the take is over."""
    eng, _ran = engine(300)
    enabled: list[bool] = []

    async def on_call(i: int, keys: list[Key]) -> None:
        enabled.append(gc.isenabled())

    serve(eng, Session(on_call))
    assert gc.isenabled()
    try:
        await eng.take(sorted(eng.names), handoff=False)
    finally:
        await eng.workers.stop()
    assert enabled == [False, False]
    assert gc.isenabled()


def test_gc_deferred_leaves_a_disabled_collector_disabled() -> None:
    assert gc.isenabled()
    with gc_deferred():
        assert not gc.isenabled()
    assert gc.isenabled()
    gc.disable()
    try:
        with gc_deferred():
            assert not gc.isenabled()
        assert not gc.isenabled()
    finally:
        gc.enable()


def test_weights_and_heirs_agree_with_rendezvous_hashing() -> None:
    """Each member's heirs are the names it holds whose owner among the others is this
    member, as `hrw_owner` decides (the weights kept or not)."""
    rng = random.Random(33)
    weights = balance.Weights()
    for _ in range(20):
        members = frozenset(f"m{i}" for i in rng.sample(range(8), rng.randint(2, 5)))
        me = sorted(members)[0]
        keys = [lock_keys(f"name-{rng.randint(0, 400)}") for _ in range(150)]
        holders = {k: rng.choice([*members, "", "stranger"]) for k in keys}
        view = balance.View(me, members, holders, frozenset(keys))
        weights.keep_only(members)
        found = balance.heirs(view, weights)
        assert set(found) == members - {me}
        for member, mine in found.items():
            expected = [
                k
                for k, holder in holders.items()
                if holder == member and balance.hrw_owner(k, members - {member}) == me
            ]
            assert mine == expected
        assert balance.heirs(view, balance.Weights(), ["gone"]) == {"gone": []}
        for key in keys[:20]:
            assert weights.owner(key, members) == balance.hrw_owner(key, members)


async def test_a_death_costs_no_hashing(monkeypatch: pytest.MonkeyPatch) -> None:
    """The names a member takes when another dies were worked out at its last look:
    none is hashed when the death is known. (The old code hashed each of the dead
    member's names against each survivor then: ~40 ms at 10,000 names.)"""
    eng, _ran = engine(300)
    keys = sorted(eng.names)
    members = frozenset({eng.member, "dead", "third"})
    holders = {k: ("dead", "third", eng.member)[i % 3] for i, k in enumerate(keys)}
    view = balance.View(eng.member, members, holders, frozenset(keys))
    eng.membership.remember(view, {})
    expected = [
        k
        for k, holder in holders.items()
        if holder == "dead" and balance.hrw_owner(k, members - {"dead"}) == eng.member
    ]
    excluded = expected[0]
    eng.balancer.excluded[excluded] = (float("inf"), "third")
    assert not await eng.standby(view)
    taken: list[list[Key]] = []

    async def take(keys: list[Key], *, handoff: bool) -> list[Key]:
        taken.append(keys)
        return keys

    def no_hashing(key: Key, member: str) -> int:
        raise AssertionError("a name hashed after the death")

    monkeypatch.setattr(balance, "_weight", no_hashing)
    eng.take = take  # type: ignore[method-assign]
    await eng._on_event(MemberGone("dead"))
    assert taken == [[k for k in expected if k != excluded]]


async def test_a_watch_that_told_the_group_is_not_repeated_by_the_loop() -> None:
    """The ring watch tells the group of a death from its own session: the member's
    loop takes its share at once, without telling the group again."""
    eng, _ran = engine(3)
    sent: list[Message] = []
    gone: list[str] = []

    async def notify(message: Message) -> None:
        sent.append(message)

    async def on_event(event: Any) -> None:
        gone.append(event.member)

    eng.mailbox.notify = notify  # type: ignore[method-assign]
    eng._on_event = on_event  # type: ignore[method-assign]
    await eng._handle(MemberGone("dead", seen_here=True, told=True))
    assert sent == []
    assert gone == ["dead"]
    await eng._handle(MemberGone("dead", seen_here=True))
    assert [m.kind for m in sent] == ["left"]
    assert gone == ["dead", "dead"]


async def test_the_watch_tells_the_group_as_the_loop_takes_the_names(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """When the watched member's lock is granted, the loop is told (``told``: it takes
    its share without telling the group), and the watch session sends "left" to the
    group meanwhile, then gives the lock back; if that send fails, the loop is told
    again, to tell the group itself."""
    eng, _ran = engine(1)
    order: list[str] = []

    class WatchSession:
        async def wait_lock(self, key1: int, key2: int, timeout_s: float) -> bool:
            return True

        async def notify(self, channel: str, payload: str) -> None:
            message = Message.parse(payload)
            assert message is not None
            order.append(f"notify {message.kind} {message.to}")

        async def unlock(self, key1: int, key2: int) -> bool:
            order.append("unlock")
            return True

    posted: list[Any] = []

    def post(event: Any) -> None:
        posted.append(event)
        order.append("posted")

    watch = eng.watch
    watch._post = post
    eng.membership.members = frozenset({eng.member, "zz-next"})
    monkeypatch.setattr(watch_module, "can", lambda session, capability: True)
    monkeypatch.setattr(watch_module, "AFTER_DEATH_S", 0.0)
    await watch._watch_once(Slot(WatchSession()))  # type: ignore[arg-type]
    assert order == ["posted", "notify left zz-next", "unlock"]
    assert posted == [MemberGone("zz-next", seen_here=True, told=True)]
    failing = WatchSession()
    failing.notify = None  # type: ignore[assignment,method-assign]  # calling it fails
    posted.clear()
    eng.membership.members = frozenset({eng.member, "zz-next"})  # it comes back, and dies
    await watch._watch_once(Slot(failing))  # type: ignore[arg-type]
    assert posted == [
        MemberGone("zz-next", seen_here=True, told=True),
        MemberGone("zz-next", seen_here=True),  # the loop tells the group then
    ]


async def test_after_a_death_the_look_waits_for_the_takes() -> None:
    """A shared member looks at the group ``GONE_LOOK_DELAY_S`` after a member is gone,
    not at once: a look reads the whole lock table while the other survivors are
    still taking their shares. (The old code looked at once.)"""
    eng, _ran = engine(3)
    eng.settings = dataclasses.replace(eng.settings, idle_tick_s=30.0)
    ticks: list[float] = []

    async def nothing() -> None:
        return None

    async def tick() -> None:
        ticks.append(time.monotonic())
        eng.balancer.unsettled = False

    eng._open = nothing  # type: ignore[method-assign]
    eng._close = nothing  # type: ignore[method-assign]
    eng.balancer.tick = tick  # type: ignore[method-assign]
    await eng.start()
    try:
        while not ticks:  # the first look
            await asyncio.sleep(0.01)
        gone_at = time.monotonic()
        eng.events.put_nowait(MemberGone("gone"))
        async with asyncio.timeout(5.0):
            while len(ticks) < 2:
                await asyncio.sleep(0.01)
    finally:
        await eng.stop()
    assert eng.error is None
    assert ticks[1] - gone_at >= SharedEngine.GONE_LOOK_DELAY_S > 0
