"""`Semaphore`: at most N holders of one name, each on one of N advisory locks (slots).

A semaphore *is* a [`LeaderLock`][pgleaderlock.LeaderLock] (same machine, runner, session,
callbacks, probes, lease, drain, fencing and integrations) whose acquisition takes one of
N locks instead of one: its [`SlotKeyring`][pgleaderlock.core.semaphore.SlotKeyring] tries
the slots' keys ([`slot_keys`][pgleaderlock.slot_keys]) in turn, from a random slot, and
the session then holds that slot's lock until it releases or loses it. PostgreSQL
guarantees at most one session per slot, so at most N sessions hold one.

A backend waits for one lock, not "any of N", and a wait cut short by a
``lock_timeout`` writes an ERROR into the server's log. So followers wait in one piece,
each for one lock: those that watch no slot queue for the semaphore's *gate* lock
([`gate_keys`][pgleaderlock.core.semaphore.gate_keys]); the gate's one holder takes
the *watch lock* ([`watch_keys`][pgleaderlock.core.semaphore.watch_keys]) of a slot that
nobody watches and, when two followers or more are queued behind it, hands the gate on
and waits for that slot on the server (its *watcher*): a follower stays queued behind
every gate holder while a slot has a watcher, so none leaves slots uncovered. Only the
gate's holder runs statements while it waits: it tries slots without a watcher every
``rescan_s``, counts its queue every ``PASS_ON_S``, and tries the watch locks every
``GATE_POLL_S``. See [`SlotKeyring`][pgleaderlock.core.semaphore.SlotKeyring] and the
[Semaphores guide](../guides/semaphores.md).
"""

from __future__ import annotations

import asyncio
import enum
import hashlib
import math
import random
import time
from collections.abc import Sequence
from typing import Any, Self, Unpack, cast

from .config import positive
from .errors import ConfigurationError
from .keyring import Keyring
from .keys import SLOT_SEPARATOR, key_to_oid, lock_keys, oid_to_key, slot_keys
from .lock import LeaderLock
from .options import LockArguments, without_deprecated
from .session import LockSession, QuerySession, WaitingSession
from .slot import can

__all__ = [
    "DEFAULT_RESCAN_S",
    "GATE_POLL_S",
    "HANDOVER_RESCANS",
    "PASS_ON_S",
    "RECALL_S",
    "Role",
    "Semaphore",
    "SlotKeyring",
    "gate_keys",
    "watch_keys",
]

DEFAULT_RESCAN_S = 0.01
"""How often the gate's holder tries the slots that no follower waits for on the server
(see ``rescan_s``)."""

GATE_POLL_S = 0.25
"""How often the gate's holder tries the watch locks while every slot has a watcher: it
looks for a slot whose watcher was just granted it (and left it unwatched)."""

PASS_ON_S = 0.1
"""How often the gate's holder counts the followers queued behind it (one read of
``pg_locks``): with two or more it hands the gate on and watches a slot it covers; with
none, while another follower watches a slot, it recalls that watcher."""

RECALL_S = 5.0
"""The gate's holder recalls at most one watcher per this many seconds: the recalled
follower reconnects and queues behind it meanwhile (after its retry delay: at most
2 s with the default retry strategy), so one recall is enough unless it does not come
back (it was stopping too)."""

HANDOVER_RESCANS = 2
"""When its hold ends (``step_down()``, or a lost session), a semaphore leaves the slot it
held to the waiting followers for this many ``rescan_s`` before it asks for it again."""

WATCH_MARK = "w"
"""After ``SLOT_SEPARATOR``, before a slot's index: where a watch lock's keys come from."""

GATE_MARK = "g"
"""After ``SLOT_SEPARATOR``: where the gate lock's keys come from."""


_OF_THIS_ROLE = (
    " FROM pg_catalog.pg_locks AS l JOIN pg_catalog.pg_stat_activity AS a ON a.pid = l.pid"
    " WHERE l.locktype = 'advisory' AND l.objsubid = 2"
    " AND l.database = (SELECT d.oid FROM pg_catalog.pg_database AS d"
    " WHERE d.datname = pg_catalog.current_database())"
    " AND l.classid = ({0})::int8::oid AND l.objid = ({1})::int8::oid"
    " AND l.pid <> pg_catalog.pg_backend_pid() AND a.usename = current_user"
)

RECALL = (
    "SELECT pg_catalog.pg_cancel_backend(l.pid)"
    + _OF_THIS_ROLE
    + " AND l.granted AND a.wait_event_type = 'Lock'"
)
"""Cancel the wait of the session of this role that holds a watch lock (values: its
keys as oids) and waits for a lock (its slot): see ``SlotKeyring._recall``."""

QUEUED = "SELECT pg_catalog.count(*)" + _OF_THIS_ROLE + " AND NOT l.granted"
"""How many other sessions of this role wait for the gate lock (values: its keys as
oids): see ``SlotKeyring._check``. Sessions of other roles are not trusted (as
``RECALL`` cancels none of them)."""


def _derived(text: str) -> tuple[int, int]:
    digest = hashlib.md5(text.encode(), usedforsecurity=False).hexdigest()
    return oid_to_key(int(digest[0:8], 16)), oid_to_key(int(digest[8:16], 16))


def watch_keys(name: str, slots: int) -> list[tuple[int, int]]:
    """The keys of each slot's watch lock: slot ``i``'s are derived as
    [`lock_keys`][pgleaderlock.lock_keys] derives them, from ``name + "\\x1fw" + str(i)``
    (``md5(name || chr(31) || 'w' || i)`` in SQL). The one session that holds it (a
    follower, the slot's *watcher*) waits on the server for slot ``i``. No slot's or
    other name's keys are the same (the separator is a control character).

    Raises:
        ConfigurationError: a bad name or ``slots`` (as [`slot_keys`][pgleaderlock.slot_keys]).
    """
    slot_keys(name, slots)  # checks the name and the count
    return [_derived(f"{name}{SLOT_SEPARATOR}{WATCH_MARK}{index}") for index in range(slots)]


def gate_keys(name: str) -> tuple[int, int]:
    """The keys of a semaphore's gate lock, derived from ``name + "\\x1fg"``
    (``md5(name || chr(31) || 'g')`` in SQL): the followers that watch no slot queue for
    it on the server; its one holder finds the slots that have no watcher.

    Raises:
        ConfigurationError: a bad name (as [`lock_keys`][pgleaderlock.lock_keys]).
    """
    lock_keys(name)  # checks the name
    return _derived(f"{name}{SLOT_SEPARATOR}{GATE_MARK}")


class Role(enum.Enum):
    """Where a follower's session stands (see `SlotKeyring`)."""

    NONE = "none"
    QUEUED = "queued"
    GATE = "gate"
    WATCHER = "watcher"


class SlotKeyring:
    """Takes one of several locks (a semaphore's slots), and waits for them on the server.

    A backend waits for one lock, not "any of N", and a wait that ends before it is
    granted (a ``lock_timeout``, a cancel) writes an ERROR into the server's log. So a
    follower's session is in one of three places, two of them a wait in one piece:

    - *queued*: it waits on the server for the gate lock
      ([`gate_keys`][pgleaderlock.core.semaphore.gate_keys]), as a lock's follower waits
      for its lock (``WaitingSession.wait_lock``: no ``lock_timeout``; the wait goes on
      across calls). Followers queue there in order.
    - the *gate's holder* (one per name): it takes the watch lock
      ([`watch_keys`][pgleaderlock.core.semaphore.watch_keys]) of each slot that has no
      watcher, and tries those slots every ``rescan_s``. Every ``PASS_ON_S`` it counts
      the followers queued behind it (`_check`). Two or more: it lets the gate go (the
      server grants it to the first follower queued), keeps one of those watch locks,
      lets the others go to the next gate holder, and becomes that slot's watcher; one
      follower stays queued behind the new holder. None, while another follower
      watches a slot: it recalls that watcher (`_recall`). So while a slot has a
      watcher a follower is queued behind the gate's holder, ready to cover the slots
      it covered when it leaves (a crash, a lease, a shutdown, a slot taken). While
      every slot has a watcher it tries the watch locks every ``GATE_POLL_S`` (a
      watcher granted its slot lets its watch lock go).
    - a slot's *watcher*: it holds the slot's watch lock and waits for the slot on the
      server in one piece; once granted, it lets the watch lock go.

    The server grants a freed slot to its watcher at once; a slot without a watcher
    (while fewer than ``slots + 2`` followers wait, or for up to ``GATE_POLL_S`` after
    its watcher was granted it) is taken by the gate's holder within ``rescan_s``. The
    gate frees with its holder's session (a crash; the lease of a frozen process).

    Sessions that cannot wait (``follower_mode="poll"``) try every slot once per
    attempt (`try_lock`).

    Args:
        keys: each slot's ``(key1, key2)``.
        rescan_s: how often the gate's holder tries the slots that have no watcher.
        watch: each slot's watch lock's keys (default: none; every follower polls).
        gate: the gate lock's keys (default: none; every follower polls).
    """

    def __init__(
        self,
        keys: Sequence[tuple[int, int]],
        rescan_s: float,
        watch: Sequence[tuple[int, int]] = (),
        gate: tuple[int, int] | None = None,
    ) -> None:
        self.keys = tuple(keys)
        self.watch = tuple(watch)
        self.gate = gate
        self.index: int | None = None
        """The slot the session holds (or last held)."""
        self.rescan_s = rescan_s
        self._rng = random.Random()
        self._holding = False  # granted, and no attempt since (the hold may go on)
        self._released: tuple[int, float] | None = None  # which slot, when (monotonic)
        self._session: object | None = None  # whose gate and watch locks these are
        self.role = Role.NONE
        self.watching: list[int] = []
        """The slots whose watch locks the session holds."""
        self._checked_at = -math.inf  # when the gate's holder last counted its queue
        self._recalled_at = -math.inf  # when it last recalled a watcher
        self._alone = False  # nobody was queued behind the gate's holder at its last count

    @property
    def held(self) -> tuple[int, int]:
        return self.keys[self.index or 0]

    @property
    def at_gate(self) -> bool:
        """Does the session hold the gate (it tries locks, it waits for none)?"""
        return self.role is Role.GATE

    @property
    def waits_on_server(self) -> bool:
        """One slot waits on the server; a follower queued for the gate or watching a
        slot too. The gate's holder runs statements (tries), under which the session is
        dropped before a cut."""
        return len(self.keys) == 1 or self.role is not Role.GATE

    def _handed_over(self) -> int | None:
        """The slot this session held until recently, left to the waiting followers for
        ``HANDOVER_RESCANS`` rescans from the first attempt after the hold ended
        (released, or lost): a semaphore that loses its session (terminated backend)
        reconnects in milliseconds, and would take its slot straight back before the
        gate's holder tries it; a watcher is granted it by the server first anyway."""
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
        """A new session holds no gate or watch lock (the last one's died with it)."""
        if session is not self._session:
            self._session, self.watching, self.role = session, [], Role.NONE

    async def _granted(self, session: LockSession, index: int) -> bool:
        """Slot ``index`` is the session's: let every watch lock and the gate go. The
        gate's holder that leaves while others watch slots and nobody is queued behind
        it recalls a watcher first (`_recall`)."""
        watched = [i for i in range(len(self.watch)) if i not in self.watching]
        await self._unwatch(session)
        if self.role is Role.GATE:
            assert self.gate is not None
            await session.unlock(*self.gate)
            if watched and await session.try_lock(*self.gate):  # nobody queued behind
                await self._recall(session, watched)
                await session.unlock(*self.gate)
        self.role = Role.NONE
        self.index, self._holding = index, True
        return True

    async def try_lock(self, session: LockSession) -> bool:
        """One attempt that never waits. A follower queued for the gate or watching a
        slot looks at its wait in flight (no statement: another would drop it); the
        gate's holder takes a round (`_round`); any other session tries every slot
        once, from a random one (so that many candidates spread over the slots)."""
        self._adopt(session)
        if self.role is Role.QUEUED or self.role is Role.WATCHER:
            return await self._step(cast(WaitingSession, session), 0.0)
        if self.role is Role.GATE:
            return await self._round(session)
        count = len(self.keys)
        first = self._rng.randrange(count)
        skip = self._handed_over()
        for step in range(count):
            index = (first + step) % count
            if index != skip and await session.try_lock(*self.keys[index]):
                return await self._granted(session, index)
        return False

    async def wait_lock(self, session: WaitingSession, wait_s: float) -> bool:
        """One slot: wait on the server. Several: queued for the gate, as the gate's
        holder or as a slot's watcher (see the class), until a slot is granted or
        ``wait_s`` has passed (a wait in one piece goes on across calls)."""
        if len(self.keys) == 1:
            granted = bool(await session.wait_lock(*self.keys[0], wait_s))
            if granted:
                self.index, self._holding = 0, True
            return granted
        locking = cast(LockSession, session)  # a waiting session is both
        if self.gate is None or not self.watch:
            return await self._poll(locking, time.monotonic() + wait_s)
        self._adopt(session)
        deadline = time.monotonic() + wait_s
        while True:
            if not self.at_gate:
                remaining = max(0.0, deadline - time.monotonic())
                if await self._step(session, remaining):
                    return True
                if not self.at_gate:
                    return False  # its wait goes on: the next call waits on
            elif await self._round(locking):
                return True
            if not self.at_gate:
                continue  # it watches a slot now
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return False  # it keeps the gate: the next call goes on
            pause = self.rescan_s if self.watching else GATE_POLL_S
            await asyncio.sleep(min(pause, remaining))

    async def _step(self, session: WaitingSession, wait_s: float) -> bool:
        """Not the gate's holder: queue for the gate, or wait for the watched slot, for
        ``wait_s`` (0: only look at the wait in flight). True: a slot is the session's.
        Granted the gate, it takes its first round at once."""
        locking = cast(LockSession, session)
        if self.role is Role.WATCHER:
            index = self.watching[0]
            if not await session.wait_lock(*self.keys[index], wait_s):
                return False
            return await self._granted(locking, index)
        assert self.gate is not None
        self.role = Role.QUEUED
        if not await session.wait_lock(*self.gate, wait_s):
            return False
        self.role, self._checked_at, self._alone = Role.GATE, -math.inf, False
        return await self._round(locking)

    async def _round(self, session: LockSession) -> bool:
        """The gate's holder: try the slots it covers, take the watch lock of each slot
        nobody watches (and try that slot), and offer the gate (every ``PASS_ON_S``)
        while it covers a slot. True: a slot is the session's."""
        skip = self._handed_over()
        for index in self.watching:
            if index != skip and await session.try_lock(*self.keys[index]):
                return await self._granted(session, index)
        count = len(self.watch)
        first = self._rng.randrange(count)
        for step in range(count):
            index = (first + step) % count
            if index in self.watching or not await session.try_lock(*self.watch[index]):
                continue
            self.watching.append(index)
            if index != skip and await session.try_lock(*self.keys[index]):
                return await self._granted(session, index)
        if time.monotonic() - self._checked_at >= PASS_ON_S:
            await self._check(session)
        return False

    async def _check(self, session: LockSession) -> None:
        """The gate's holder counts the followers queued behind it (`QUEUED`). Two or
        more: it hands the gate on (`_pass_on`) and watches a slot it covers, and one
        is still queued behind the new holder. None at two counts in a row, while
        another follower watches a slot: it recalls that watcher (`_recall`), which
        comes back behind it (two counts: a follower whose waits end in a
        ``lock_timeout``, behind a pooler or on an older server, is out of the queue
        for an instant each retry delay). So
        whenever a slot has a watcher, a follower is queued behind the gate's holder,
        and the gate's holder can leave (a crash, a lease that ends, a shutdown, a
        slot taken) without leaving the slots it covered to nobody: a watcher waits
        for its own slot only. A session that cannot count (no ``QuerySession``: the
        test fake) hands the gate on to any follower queued behind it."""
        now = self._checked_at = time.monotonic()
        watched = [i for i in range(len(self.watch)) if i not in self.watching]
        queued = await self._queued(session)
        if (queued is None or queued >= 2) and self.watching:
            await self._pass_on(session)
        alone, self._alone = self._alone, queued == 0
        recall = alone and queued == 0 and bool(watched) and now - self._recalled_at >= RECALL_S
        if recall and await self._recall(session, watched):
            self._recalled_at = now

    async def _queued(self, session: LockSession) -> int | None:
        """How many followers wait for the gate (``None``: the session cannot say)."""
        if self.gate is None or not can(session, QuerySession):
            return None
        key1, key2 = self.gate
        rows = await cast(QuerySession, session).query(QUEUED, (key_to_oid(key1), key_to_oid(key2)))
        return int(rows[0][0]) if rows else 0

    async def _pass_on(self, session: LockSession) -> None:
        """Let the gate go and try it again: a follower queued for it is granted it as
        it is let go (and the try fails). This session then watches the first slot it
        covers (it waits for it on the server) and lets the other watch locks go to the
        new gate holder. Nobody queued: it keeps the gate, and goes on trying."""
        assert self.gate is not None
        await session.unlock(*self.gate)
        if await session.try_lock(*self.gate):
            return
        self.role = Role.WATCHER
        kept, dropped = self.watching[:1], self.watching[1:]
        self.watching = kept
        for index in dropped:
            await session.unlock(*self.watch[index])

    async def _recall(self, session: LockSession, watched: list[int]) -> bool:
        """The gate's holder has nobody queued behind it, or is about to hold a slot with
        nobody queued behind it, while other followers watch slots: if it left, the slots
        it covered would have no follower, and a watcher waits for its own slot only (its
        wait ends silently only when granted). So one watcher's wait is cancelled
        (``pg_cancel_backend``, of this role's sessions only: one ERROR line in the
        server's log); that follower comes back (it tries every slot, then holds the
        gate) and covers them. A session that cannot run the library's statements
        (no ``QuerySession``) recalls nobody. Only on a change in the fleet (a follower
        left, or took a slot), never in a steady state. True: a wait was cancelled."""
        if not can(session, QuerySession):
            return False
        querying = cast(QuerySession, session)
        for index in watched:
            key1, key2 = self.watch[index]
            rows = await querying.query(RECALL, (key_to_oid(key1), key_to_oid(key2)))
            if any(row[0] for row in rows):
                return True
        return False

    async def _unwatch(self, session: LockSession) -> None:
        """Let go of every watch lock held."""
        dropped, self.watching = self.watching, []
        for index in dropped:
            await session.unlock(*self.watch[index])

    async def _poll(self, session: LockSession, deadline: float) -> bool:
        """Try every slot every ``rescan_s`` until one is granted or ``deadline`` (a
        keyring made without a gate)."""
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

    Followers wait on the server: a slot can have one follower (its watcher) that waits
    for it as a lock's follower waits, the others queue on the server for the
    semaphore's gate, and the gate's one holder covers slots without a watcher (a
    slot gets one while a follower stays queued behind the gate's holder; see
    [`SlotKeyring`][pgleaderlock.core.semaphore.SlotKeyring] and the guide). So waiting
    costs about what a lock's waiting costs, however many followers there are, and no
    wait ends in a ``lock_timeout`` (an ERROR in the server's log). A holder whose hold
    ends (``step_down()``, a lost session) leaves its slot to the gate's holder for
    ``HANDOVER_RESCANS`` rescans before it asks for it again (a watcher is granted it by
    the server first anyway).

    Every semaphore of a name must give the same ``slots``: one that counts fewer slots
    never takes the others, one that counts more lets more holders in.

    Args:
        dsn: as for `LeaderLock`.
        name: the semaphore's name; the same name (and ``slots``) in every process.
        slots: how many holders at most (N), from 1 to 1,024
            (``pgleaderlock.core.keys.MAX_SLOTS``: each holder is a session
            of its own).
        rescan_s: how often the gate's holder tries the slots that no follower waits
            for on the server (one slot or more has no watcher while fewer than
            ``slots + 2`` followers wait). Unused with ``slots=1`` and with
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
        self._ring = SlotKeyring(
            slot_keys(name, slots), rescan_s, watch_keys(name, slots), gate_keys(name)
        )
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
        """How often the gate's holder tries the slots that have no watcher."""
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
