"""`Semaphore`: at most N holders of one name, each on one of N advisory locks (slots).

A semaphore *is* a [`LeaderLock`][pgleaderlock.LeaderLock] (same machine, runner, session,
callbacks, probes, lease, drain, fencing and integrations) whose acquisition takes one of
N locks instead of one: its [`SlotKeyring`][pgleaderlock.core.semaphore.SlotKeyring] tries
the slots' keys ([`slot_keys`][pgleaderlock.slot_keys]) in turn, from a random slot, and
the session then holds that slot's lock until it releases or loses it. PostgreSQL
guarantees at most one session per slot, so at most N sessions hold one.

A backend waits for one lock, not "any of N". So each slot has a *watcher*: the follower
that holds the slot's watch lock ([`watch_keys`][pgleaderlock.core.semaphore.watch_keys])
waits on the server for that slot; the other followers queue on the server for a watch
lock, and the first in a slot's queue becomes its watcher the instant the last one is
granted the slot. Each wait lasts one retry delay
(``BoundedWaitSession.wait_lock_once``: one statement); between two, a follower takes
the watch lock of any slot nobody watches. A follower that watches several slots (fewer
followers than slots) tries them every ``rescan_s``. See the
[Semaphores guide](../guides/semaphores.md).
"""

from __future__ import annotations

import asyncio
import hashlib
import random
import time
from collections.abc import Sequence
from typing import Any, Self, Unpack, cast

from .config import positive
from .errors import ConfigurationError
from .keyring import Keyring
from .keys import SLOT_SEPARATOR, lock_keys, oid_to_key, slot_keys
from .lock import LeaderLock
from .options import LockArguments, without_deprecated
from .session import BoundedWaitSession, LockSession, WaitingSession
from .slot import can

__all__ = [
    "DEFAULT_RESCAN_S",
    "HANDOVER_RESCANS",
    "MIN_WAIT_S",
    "PASS_ON_ROUNDS",
    "Semaphore",
    "SlotKeyring",
    "watch_keys",
]

DEFAULT_RESCAN_S = 0.01
"""How often a follower that watches several slots tries them again (see ``rescan_s``)."""

HANDOVER_RESCANS = 2
"""When its hold ends (``step_down()``, or a lost session), a semaphore leaves the slot it
held to the waiting followers for this many ``rescan_s`` before it asks for it again."""

PASS_ON_ROUNDS = 10
"""A follower that watches several slots offers their watch locks to followers queued for
them every this many rescans."""

MIN_WAIT_S = 0.001
"""The shortest wait on the server a follower asks for (a zero ``lock_timeout`` would
mean "wait forever")."""

WATCH_MARK = "w"
"""After ``SLOT_SEPARATOR``, before a slot's index: where a watch lock's keys come from."""


def watch_keys(name: str, slots: int) -> list[tuple[int, int]]:
    """The keys of each slot's watch lock: slot ``i``'s are derived as
    [`lock_keys`][pgleaderlock.lock_keys] derives them, from ``name + "\\x1fw" + str(i)``
    (``md5(name || chr(31) || 'w' || i)`` in SQL). The one session that holds it (a
    follower) waits on the server for slot ``i``; the others queue for it. No slot's or
    other name's keys are the same (the separator is a control character).

    Raises:
        ConfigurationError: a bad name or ``slots`` (as [`slot_keys`][pgleaderlock.slot_keys]).
    """
    slot_keys(name, slots)  # checks the name and the count
    found = []
    for index in range(slots):
        text = f"{name}{SLOT_SEPARATOR}{WATCH_MARK}{index}"
        digest = hashlib.md5(text.encode(), usedforsecurity=False).hexdigest()
        found.append((oid_to_key(int(digest[0:8], 16)), oid_to_key(int(digest[8:16], 16))))
    return found


class SlotKeyring:
    """Takes one of several locks (a semaphore's slots), and waits for them on the server.

    A follower is, for one session, in one of three places:

    - a *watcher* of one slot: it holds that slot's watch lock and waits for the slot on
      the server, one retry delay at a time (one statement each); once granted it lets
      the watch lock go, and the first follower queued for it becomes the watcher at
      once;
    - *queued*: every watch lock is held; it waits for one (a random one) on the server,
      one retry delay at a time;
    - a watcher of *several* slots (fewer followers than slots): it cannot wait for more
      than one lock, so it tries them every ``rescan_s``, and offers their watch locks
      to followers that queued meanwhile every ``PASS_ON_ROUNDS`` rescans and at the end
      of each call (taking those still free again).

    Between two waits every follower takes the watch lock of each slot nobody watches
    (a watcher granted its slot with nobody queued behind it leaves one): such a slot
    is watched again within a retry delay.

    Sessions that cannot wait once (no ``BoundedWaitSession``) try every slot each
    ``rescan_s``, as every follower did before (issue 33).

    Args:
        keys: each slot's ``(key1, key2)``.
        rescan_s: how often a follower that watches several slots (or whose session
            cannot queue) tries them again.
        watch: each slot's watch lock's keys (default: none; every follower polls).
    """

    def __init__(
        self,
        keys: Sequence[tuple[int, int]],
        rescan_s: float,
        watch: Sequence[tuple[int, int]] = (),
    ) -> None:
        self.keys = tuple(keys)
        self.watch = tuple(watch)
        self.index: int | None = None
        """The slot the session holds (or last held)."""
        self.rescan_s = rescan_s
        self._rng = random.Random()
        self._holding = False  # granted, and no attempt since (the hold may go on)
        self._released: tuple[int, float] | None = None  # which slot, when (monotonic)
        self._session: object | None = None  # whose watch locks these are
        self.watching: list[int] = []
        """The slots whose watch locks the session holds."""
        self._queued: int | None = None  # the watch lock the last queued wait was for

    @property
    def held(self) -> tuple[int, int]:
        return self.keys[self.index or 0]

    @property
    def waits_on_server(self) -> bool:
        """One slot waits on the server; several also run other statements (tries,
        unlocks of watch locks), under which the session is dropped before a cut."""
        return len(self.keys) == 1

    def _handed_over(self) -> int | None:
        """The slot this session held until recently, left to the waiting followers for
        ``HANDOVER_RESCANS`` rescans from the first attempt after the hold ended
        (released, or lost): a semaphore that loses its session (terminated backend)
        reconnects in milliseconds, and would take its slot straight back before a
        polling follower's next rescan; a follower that waits on the server gets it first."""
        if self._holding:
            self._holding = False
            if self.index is not None:
                self._released = (self.index, time.monotonic())
        released = self._released
        if released is None or len(self.keys) == 1:
            return None
        if time.monotonic() - released[1] >= HANDOVER_RESCANS * self.rescan_s:
            self._released = None
            return None
        return released[0]

    def _adopt(self, session: object) -> None:
        """A new session holds no watch lock (the last one's died with it)."""
        if session is not self._session:
            self._session, self.watching, self._queued = session, [], None

    def _granted(self, index: int) -> bool:
        self.index, self._holding = index, True
        return True

    async def try_lock(self, session: LockSession) -> bool:
        """Try every slot once, from a random one (so that many candidates spread over
        the slots, instead of all asking the first); stop at the first granted (and let
        any watch lock go)."""
        self._adopt(session)
        count = len(self.keys)
        first = self._rng.randrange(count)
        skip = self._handed_over()
        for step in range(count):
            index = (first + step) % count
            if index == skip:
                continue
            if await session.try_lock(*self.keys[index]):
                await self._unwatch(session, keep=0)
                return self._granted(index)
        return False

    async def wait_lock(self, session: WaitingSession, wait_s: float) -> bool:
        """One slot: wait on the server. Several: as a watcher, queued, or trying the
        slots it watches (see the class), until one is granted or ``wait_s`` has
        passed."""
        if len(self.keys) == 1:
            granted = bool(await session.wait_lock(*self.keys[0], wait_s))
            return self._granted(0) if granted else False
        deadline = time.monotonic() + wait_s
        locking = cast(LockSession, session)  # a waiting session is both
        if not self.watch or not can(session, BoundedWaitSession):
            return await self._poll(locking, deadline)
        bounded = cast(BoundedWaitSession, session)
        self._adopt(session)
        if self.watching:
            # A watcher whose last wait timed out: its slot first (the wait may have
            # been granted as it timed out), then every slot nobody watches.
            for index in list(self.watching):
                if await locking.try_lock(*self.keys[index]):
                    await self._unwatch(locking, keep=0)
                    return self._granted(index)
        elif self._queued is None and await self.try_lock(locking):
            # (A follower that queued last time skips the tries: a free slot nobody
            # watches has a free watch lock, which it takes, and then the slot.)
            return True
        await self._claim(locking)
        rounds = 0
        while True:
            if not self.watching:
                if not await self._queue(bounded, deadline):
                    return False
                await self._claim(locking)  # and every other slot nobody watches
                continue
            if len(self.watching) == 1:
                index = self.watching[0]
                remaining = max(MIN_WAIT_S, deadline - time.monotonic())
                if not await bounded.wait_lock_once(*self.keys[index], remaining):
                    return False  # it looks again at the next call
                await self._unwatch(locking, keep=0)
                return self._granted(index)
            # Several slots to watch: try them every rescan_s.
            skip = self._handed_over()
            for index in list(self.watching):
                if index != skip and await locking.try_lock(*self.keys[index]):
                    await self._unwatch(locking, keep=0)
                    return self._granted(index)
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                # Let the others in (a follower that queued meanwhile gets a slot to
                # watch); those still free are taken again at the next call.
                await self._unwatch(locking, keep=0)
                return False
            await asyncio.sleep(min(self.rescan_s, remaining))
            rounds += 1
            if rounds % PASS_ON_ROUNDS == 0:
                await self._pass_on(locking)

    async def _pass_on(self, session: LockSession) -> None:
        """Let each watch lock go and take it again: a follower queued for it is granted
        it as it is let go (and the try fails), and watches that slot from then on."""
        watching, self.watching = self.watching, []
        for index in watching:
            await session.unlock(*self.watch[index])
            if await session.try_lock(*self.watch[index]):
                self.watching.append(index)

    async def _claim(self, session: LockSession) -> None:
        """Take every watch lock nobody holds (but those this session holds), starting
        with the one it last queued for (its wait may have been granted as it timed
        out)."""
        count = len(self.watch)
        first = self._queued if self._queued is not None else self._rng.randrange(count)
        for step in range(count):
            index = (first + step) % count
            if index not in self.watching and await session.try_lock(*self.watch[index]):
                self.watching.append(index)
        self._queued = None

    async def _queue(self, session: BoundedWaitSession, deadline: float) -> bool:
        """Every slot has a watcher: queue for a random one's watch lock on the server,
        until ``deadline``. True: this session is that slot's watcher now."""
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            return False
        index = self._queued = self._rng.randrange(len(self.watch))
        if not await session.wait_lock_once(*self.watch[index], max(MIN_WAIT_S, remaining)):
            return False
        self._queued, self.watching = None, [index]
        return True

    async def _unwatch(self, session: LockSession, keep: int) -> None:
        """Let go of the watch locks held but the first ``keep``."""
        kept, dropped = self.watching[:keep], self.watching[keep:]
        self.watching = kept
        for index in dropped:
            await session.unlock(*self.watch[index])

    async def _poll(self, session: LockSession, deadline: float) -> bool:
        """Try every slot every ``rescan_s`` until one is granted or ``deadline`` (a
        session that cannot queue on the server)."""
        while not await self.try_lock(session):
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return False
            await asyncio.sleep(min(self.rescan_s, remaining))
        return True


class Semaphore(LeaderLock):
    """At most ``slots`` holders at once: a [`LeaderLock`][pgleaderlock.LeaderLock] whose
    session holds one of ``slots`` advisory locks.

    Everything a `LeaderLock` has works the same way: `start()`, `wait_for_leadership()`,
    `step_down()`, `shutdown()`, the context manager, the callbacks (`on_acquired` when a
    slot is taken, `on_lost`, `on_released`, ...), probes, `lease_s`, `drain_s`,
    fencing, [`LeaderTasks`][pgleaderlock.LeaderTasks], the FastAPI lifespan. "Leader"
    means "holds a slot": `is_leader` is True for up to ``slots`` semaphores of one
    name at a time, [`slot`][pgleaderlock.Semaphore.slot] says which one.

    Each slot is its own advisory lock, with keys from
    [`slot_keys(name, slots)`][pgleaderlock.slot_keys] (never those of another name), so
    `pgleaderlock status --all` shows who holds which slot. With ``Fencing(enabled=True)`` each
    slot has its own term: [`term`][pgleaderlock.LeaderLock.term] is the held slot's, and
    [`fence`][pgleaderlock.LeaderLock.fence] fences against the holder of that slot only.

    Followers wait on the server: each slot has one follower (its watcher) that waits
    for it as a lock's follower waits, and the others queue for a watcher's place (see
    [`SlotKeyring`][pgleaderlock.core.semaphore.SlotKeyring] and the guide), so waiting
    costs what a lock's waiting costs, however many followers there are. A holder whose
    hold ends (``step_down()``, a lost session) leaves its slot to a polling follower
    for ``HANDOVER_RESCANS`` rescans before it asks for it again (a watcher is granted
    it by the server first anyway).

    Every semaphore of a name must give the same ``slots``: one that counts fewer slots
    never takes the others, one that counts more lets more holders in.

    Args:
        dsn: as for `LeaderLock`.
        name: the semaphore's name; the same name (and ``slots``) in every process.
        slots: how many holders at most (N), from 1 to 1,024
            (``pgleaderlock.core.keys.MAX_SLOTS``: each holder is a session
            of its own).
        rescan_s: only while fewer followers wait than there are slots (one follower
            then watches several slots, and cannot wait on the server for more than
            one), or with a session that cannot queue (no ``BoundedWaitSession``): how
            often such a follower tries its slots again. Unused in the steady state with
            as many followers as slots or more, with ``slots=1``, and with
            ``follower_mode="poll"`` (every slot once per retry delay); see the
            [guide](../guides/semaphores.md).
        **arguments: `LeaderLock`'s keyword arguments (``retry_strategy``,
            ``health_interval_s``, ``reconnect_grace_s``, ``auto_reacquire``,
            ``shutdown_event``, ``connect_fn``, ``options``, and the flat keywords of
            0.1, with a ``DeprecationWarning``), with its defaults. Its ``options``'
            [`Participation`][pgleaderlock.Participation] may not set ``metadata``,
            ``priority`` or ``eligible`` (they are about one lock's leader).

    Raises:
        ConfigurationError: a bad name, ``slots`` or ``rescan_s``, or as `LeaderLock`.
    """

    def __init__(
        self,
        dsn: str | Any | None,
        name: str,
        *,
        slots: int,
        rescan_s: float = DEFAULT_RESCAN_S,
        **arguments: Unpack[LockArguments],
    ) -> None:
        rescan_s = positive("rescan_s", rescan_s)
        for taken in ("key1", "key2", "name"):
            if taken in arguments:
                raise ConfigurationError(f"a Semaphore's {taken} comes from its name")
        arguments = without_deprecated(arguments, owner="Semaphore")
        self._ring = SlotKeyring(slot_keys(name, slots), rescan_s, watch_keys(name, slots))
        super().__init__(dsn, *lock_keys(name), name=name, **arguments)
        self._log_fields["slots"] = slots

    def _keyring(self) -> Keyring:
        return self._ring

    @classmethod
    def from_name(  # type: ignore[override]  # a semaphore needs its slots
        cls,
        name: str,
        dsn: str | Any | None = None,
        *,
        slots: int,
        rescan_s: float = DEFAULT_RESCAN_S,
        **arguments: Unpack[LockArguments],
    ) -> Self:
        """``Semaphore(dsn, name, slots=..., ...)``: the same arguments."""
        arguments = without_deprecated(arguments, owner="Semaphore.from_name")
        return cls(dsn, name, slots=slots, rescan_s=rescan_s, **arguments)

    @property
    def slots(self) -> int:
        """How many holders at most (N)."""
        return len(self._ring.keys)

    @property
    def slot(self) -> int | None:
        """The slot this semaphore holds (``0 .. slots - 1``) while LEADER, else
        ``None``."""
        return self._ring.index if self.is_leader else None

    @property
    def slot_keys(self) -> tuple[tuple[int, int], ...]:
        """Every slot's ``(key1, key2)``, by slot."""
        return self._ring.keys

    @property
    def held_keys(self) -> tuple[int, int] | None:
        """The keys of the held slot while LEADER, else ``None``. (The `keys` of a
        semaphore are those of its name, which no session locks.)"""
        return None if self.slot is None else self._ring.held

    @property
    def rescan_s(self) -> float:
        """How often a follower that watches several slots tries them again."""
        return self._ring.rescan_s

    def __repr__(self) -> str:
        slot = "" if self.slot is None else f" slot={self.slot}"
        return f"<Semaphore name={self.name!r} slots={self.slots}{slot} state={self.state.value}>"

    def _fence_keys(self) -> tuple[int, int] | None:
        """Fencing is per slot: a [`Leadership`][pgleaderlock.Leadership] of a semaphore
        (and so [`fence`][pgleaderlock.LeaderLock.fence]) fences against the held slot's
        term: the next holder of *this slot* waits for the transaction; holders of other
        slots do not (they have terms of their own). Not holding a slot:
        ``FencedError``."""
        return self.held_keys
