"""Dedicated sessions: one [`LeaderLock`][pgleaderlock.LeaderLock] per name (the seeds'
pattern), with all its guarantees: a standby waits on the server and takes over the
instant a holder dies, flap damping, late probes, fencing. Three more sessions per
member: **util** holds the member's own lock (its place in the group), reads the group's
snapshot and sends notifications, and is probed every ``health_interval_s`` (so that its
lease, like a name's, ends a frozen member's place within ``lease_s``); **listen**
receives them; **watch** waits for the next member's lock (the ring watch: a dead member
is known at once).

One standby per name, not every member: the member that rendezvous hashing ranks first
among those that do not lead it (the first two while nobody leads it) waits for it; the
others do not hold a session for it, unless they see none of the chosen waiting (a
member that has not registered the name, or has not started yet), so that a name is
never without a standby for long. Sessions per group: about two per name, whatever the
number of replicas, plus three per replica.

A name is handed to a member that leads fewer names without letting anyone else in:
the giver announces the hand-off, the other members stop waiting for the name, and
only when the receiver is the one waiter left does the giver release it, so that the
server grants it to the receiver at once.
"""

from __future__ import annotations

import asyncio
import functools
import time
from collections.abc import Awaitable, Callable
from typing import Any

from ..lowlevel import LeaderLock, LockState, follow_state, get_logger, lock_arguments, oid_to_key
from . import balance
from .events import Broken, GroupEvent, Look, NameEvent
from .member import Engine
from .protocol import Key, Message, app_name, parse_app_name

__all__ = ["DedicatedEngine"]

log = get_logger("pgleaderlock.coordination")

HANDOFF_WAIT_S = 1.0
"""How long a giver waits for the other members to stop waiting for a name."""
PAUSE_S = 2.0
"""How long a member stops competing for a name handed to another member, at most: it
competes again as soon as the giver says the hand-off is over."""
STANDBY_DELAY_S = 0.5
"""How long after its locks last gained a name a member waits before it opens sessions
for new standbys: a failover in progress (a dead member's names granted to their
standbys) is not slowed by new connections meanwhile. Not for a name nobody leads: its
new session is the failover."""
STAND_IN_LOOK_S = 3.0
"""A member that waits for a name in place of the chosen standby (none of the chosen
waits yet: a hand-off is just over, or the chosen one is starting) looks again at the
balance interval for this long, so that it stops waiting soon after the chosen one
does; a stand-in that stays one (the chosen member does not run the name) is left to
the idle tick."""
MOVED_DELAY_S = 0.05
"""A member whose locks gained or lost names tells the group this long after the first
change (one message for a burst: a dead member's names are granted all at once)."""


class DedicatedEngine(Engine):
    """A member with a session per name (``sessions="dedicated"``)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._locks: dict[Key, LeaderLock] = {}
        self._leading: set[Key] = set()
        self._paused: dict[Key, float] = {}  # key -> resume at (monotonic)
        self._closing = False
        self._changing: dict[Key, asyncio.Task[None]] = {}  # key -> its lock's last start/stop
        self._moved: asyncio.Task[None] | None = None  # a "moved" message on its way
        self._gained_at = 0.0  # when one of its locks last became LEADER (monotonic)
        self._standing_in: dict[Key, float] = {}  # key -> since when it stands in (monotonic)

    # ------------------------------------------------------------------ sessions

    async def _open(self) -> None:
        self._closing = False
        # The member lock first: its session checks the tables that workers use.
        await self._join()
        await self.start_listening()
        self.start_watching()
        try:
            view: balance.View | None = await self.membership.snapshot()
        except Exception as exc:  # every name, then: the first tick trims the standbys
            log.warning("group_snapshot_failed", error=repr(exc), **self._fields)
            view = None
        # Every lock at once, each connecting (and retrying) by itself: a member that
        # joins a group whose names are free (its other members died, or are starting)
        # leads them all after one connection's time, not after one per name.
        keys = [key for key in list(self.names) if view is None or self._stands_by(key, view)]
        await asyncio.gather(*(self._compete(key) for key in keys))

    async def _close(self) -> None:
        self._closing = True  # no lock starts from here on (the listener still runs)
        if self._moved is not None:
            self._moved.cancel()
            await asyncio.gather(self._moved, return_exceptions=True)
            self._moved = None
        await asyncio.gather(*self._changing.values(), return_exceptions=True)
        locks = list(self._locks.values())
        self._locks.clear()
        await asyncio.gather(*(lock.shutdown() for lock in locks), return_exceptions=True)
        await self.workers.stop()
        await self._leave(None)

    # ------------------------------------------------------------------ names

    def _lock_for(self, key: Key) -> LeaderLock:
        name = self.names[key]
        lock = LeaderLock(
            self.settings.user_dsn,
            *key,  # the name's keys in this group (name_keys)
            name=name,
            **lock_arguments(
                {
                    **self.settings.lock_kwargs,
                    "application_name": app_name(self.group, self.member, "lock"),
                }
            ),
        )
        follow_state(lock, lambda old, new: self._on_state(key, lock, old, new))
        lock.on_draining(lambda: self.workers.drain({name}))  # the lock bounds it (drain_s)
        return lock

    def _change(self, key: Key, change: Callable[[], Awaitable[None]]) -> asyncio.Task[None]:
        """Run ``change()`` (a start or stop of ``key``'s lock) after the previous change
        of that lock: the loop and the listener both start and stop locks."""
        previous = self._changing.get(key)

        async def after_previous() -> None:
            if previous is not None:
                await asyncio.gather(previous, return_exceptions=True)
            await change()

        task = asyncio.get_running_loop().create_task(after_previous())
        self._changing[key] = task
        task.add_done_callback(lambda done: self._changed(key, done))
        return task

    def _changed(self, key: Key, task: asyncio.Task[None]) -> None:
        if self._changing.get(key) is task:
            del self._changing[key]
        error = None if task.cancelled() else task.exception()
        if error is not None:
            name = self.names.get(key)
            log.warning("lock_change_failed", name=name, error=repr(error), **self._fields)

    async def _start_lock(self, key: Key) -> None:
        if self._closing or key not in self.names:
            return
        lock = self._locks.get(key)
        if lock is None:
            lock = self._locks[key] = self._lock_for(key)
        await lock.start()

    async def _compete(self, key: Key) -> None:
        """Start ``key``'s lock: this member leads the name or waits for it."""
        await self._change(key, lambda: self._start_lock(key))

    async def _stop(self, key: Key) -> None:
        """Shut ``key``'s lock down (releasing it at once if it leads)."""
        lock = self._locks.get(key)
        if lock is not None:
            await self._change(key, lock.shutdown)

    async def _on_state(self, key: Key, lock: LeaderLock, old: LockState, new: LockState) -> None:
        name = self.names.get(key)
        if name is None:
            return
        if new is LockState.LEADER:
            self._gained_at = time.monotonic()
            self._leading.add(key)
            self.start_worker(name, lock.term)
            self.events.put_nowait(Look("changed"))
            self._tell_moved()
        elif old is LockState.LEADER:
            self._leading.discard(key)
            await self.workers.stop({name})  # before an unlock, and before anyone else leads
            self.events.put_nowait(Look("changed"))
            self._tell_moved()
        if new is LockState.STOPPED and lock.stop_error is not None:
            self.events.put_nowait(Broken(lock.stop_error))  # a missing grant, ...

    def _tell_moved(self) -> None:
        """Tell the group, soon, that this member leads other names: the server hands a
        dead member's names to whichever members queued first, and a member left with
        fewer learns of it now rather than at its next idle tick."""
        if self._closing or (self._moved is not None and not self._moved.done()):
            return

        async def tell() -> None:
            await asyncio.sleep(MOVED_DELAY_S)
            await self.mailbox.announce(Message("moved", self.member))

        self._moved = asyncio.get_running_loop().create_task(tell())

    def held(self) -> set[Key]:
        return set(self._leading)

    def _chosen(self, key: Key, view: balance.View) -> list[str]:
        """The members chosen to stand by for ``key`` (see the module docstring)."""
        leader = view.holders.get(key)
        ranked = balance.hrw_ranked(key, view.members - {leader or ""})
        return ranked[: 1 if leader is not None else 2]

    def _stands_by(self, key: Key, view: balance.View) -> bool:
        """Should this member's lock for ``key`` wait for it (see the module docstring)?"""
        chosen = self._chosen(key, view)
        if self.member in chosen:
            return True
        waiting = self.membership.waiting.get(key, frozenset())
        return not any(member in waiting for member in chosen)

    async def standby(self, view: balance.View) -> bool:
        """Start the locks of the names this member stands by for, and stop the others
        that only wait (never one that leads, is being changed, or is paused for a
        hand-off). True while some name has a standby too many or too few."""
        unsettled = False
        now = time.monotonic()
        starting = now - self._gained_at >= STANDBY_DELAY_S
        standing_in: dict[Key, float] = {}
        for key in list(self.names):
            if key in self._changing:  # a start or stop under way: look again after it
                unsettled = True
                continue
            if key in self._leading or key in self._paused:
                continue
            lock = self._locks.get(key)
            waits = lock is not None and lock.state is not LockState.STOPPED
            wanted = self._stands_by(key, view)
            if wanted and not waits:
                # A name nobody leads (its leader died with its standby, or its standby
                # was frozen) is a failover in progress itself: start it now.
                if starting or key not in view.holders:
                    self._change(key, functools.partial(self._start_lock, key))
                unsettled = True
            elif waits and not wanted and lock is not None and not lock.is_leader:
                self._change(key, lock.shutdown)
                unsettled = True
            elif waits and self.member not in self._chosen(key, view):
                since = standing_in[key] = self._standing_in.get(key, now)
                unsettled = unsettled or now - since < STAND_IN_LOOK_S
        self._standing_in = standing_in
        return unsettled

    def to_take(self, view: balance.View) -> list[Key]:
        now = time.monotonic()
        due = [k for k, at in self._paused.items() if at <= now]
        return [k for k in due if k in self.names]

    async def take(self, keys: list[Key], *, handoff: bool) -> list[Key]:
        for key in keys:  # their locks compete: who leads is known at the next look
            self._paused.pop(key, None)
            if key in self.names:
                await self._compete(key)
        return []

    async def give(self, keys: list[Key], to: str) -> int:
        await self.mailbox.notify(Message("handoff", self.member, to, tuple(keys)))
        given = 0
        pending = {k for k in keys if (lock := self._locks.get(k)) is not None and lock.is_leader}
        deadline = time.monotonic() + HANDOFF_WAIT_S
        while pending:
            ready = [k for k in await self._only_waiter(pending, to) if k in self._locks]
            # Releases: the receiver, the one waiter left, is granted each at once; then
            # this member waits again, behind it.
            await asyncio.gather(*(self._stop(k) for k in ready))
            await asyncio.gather(*(self._compete(k) for k in ready))
            given += len(ready)
            pending -= set(ready)
            if not pending or time.monotonic() >= deadline:
                break
            await asyncio.sleep(0.02)
        if pending:
            log.info("handoff_skipped", count=len(pending), to=to, **self._fields)
        await self.mailbox.notify(Message("done", self.member, to, tuple(keys)))
        return given

    async def _only_waiter(self, keys: set[Key], to: str) -> set[Key]:
        """Those of ``keys`` for which the receiver's session is the one waiter."""
        waiters: dict[Key, set[str]] = {key: set() for key in keys}
        for application, _pid, c, o, granted, trusted in await self.membership.group_rows():
            if c is None or granted:
                continue
            key = (oid_to_key(int(c)), oid_to_key(int(o)))
            if key in waiters:
                parsed = parse_app_name(str(application or ""), self.group) if trusted else None
                waiters[key].add(parsed[0] if parsed else "")
        return {key for key, who in waiters.items() if who == {to}}

    def note(self, message: Message) -> None:
        """Hand-offs are acted on as they arrive, not when the loop gets to them: a
        giver waits for the others to stop waiting, and the others may be givers busy
        with a hand-off of their own."""
        super().note(message)
        if message.sender == self.member:
            return
        if message.kind == "handoff" and message.to == self.member:
            for key in message.keys:  # wait for it now, standby or not, paused or not
                self.balancer.excluded.pop(key, None)
                self._paused.pop(key, None)
                if key in self.names:
                    self._change(key, functools.partial(self._start_lock, key))
        elif message.kind == "handoff":
            resume_at = time.monotonic() + PAUSE_S
            for key in message.keys:
                lock = self._locks.get(key)
                if lock is not None and not lock.is_leader:
                    self._paused[key] = resume_at
                    self._change(key, lock.shutdown)
        elif message.kind == "done":  # over (done or skipped): wait for the names again
            for key in message.keys:
                if self._paused.pop(key, None) is not None:
                    self._change(key, functools.partial(self._start_lock, key))

    def pending(self) -> bool:
        return bool(self._paused)

    async def _remove(self, name: str) -> None:
        key = self.keys.get(name)
        if key is not None:
            await self._stop(key)  # releases at once if it leads
            self._locks.pop(key, None)
            self._leading.discard(key)
            self._paused.pop(key, None)
            await self.mailbox.notify(Message("released", self.member, keys=(key,)))

    async def _give_away(self, name: str) -> None:
        key = self.keys.get(name)
        lock = self._locks.get(key) if key is not None else None
        if key is None or lock is None:
            return
        self._paused[key] = time.monotonic() + self.settings.give_away_cooldown_s
        await self._stop(key)
        log.warning("name_given_away", name=name, **self._fields)
        await self.mailbox.notify(Message("released", self.member, keys=(key,)))

    async def _on_event(self, event: GroupEvent) -> None:
        if isinstance(event, NameEvent) and event.what == "added":
            key = self.keys.get(event.name)
            if key is not None:
                await self._compete(key)
