"""Shared sessions: every name a member leads is held by one session, whatever their
number. Three sessions per member in all:

- **hold** holds the member's own lock (its place in the group) and the lock of every
  name it leads; it takes and gives names in batches, reads the group's snapshot, sends
  the notifications, and is probed like a lock's session (every ``health_interval_s``,
  and at once when the server ends it while idle). The member's loop and the probe use
  it one call at a time, each bounded by ``health_timeout_s`` (a term bump by at most
  ``health_interval_s + health_timeout_s``), and the first call that fails cancels every
  worker at once: as for a lock, a member cut off from the server stops its work before
  the server can free its names (``tcp_user_timeout_s`` exceeds that bound);
- **listen** receives the group's notifications;
- **watch** waits on the server for the lock of the next member in the ring of members
  (the engine's, as in dedicated mode): when that member dies, this member tells the
  group, so that the dead member's names are led again within milliseconds.

Losing the hold session loses every name at once (its workers are cancelled), which is
the trade-off of this mode; the member then reconnects with the retry strategy and
takes its share again.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import time
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

from ..core import TermTable, get_logger, is_permanent
from . import balance
from .engine import Engine
from .events import Broken, GroupEvent, Look, MemberGone
from .protocol import Key, Message, member_key
from .session import GroupSession

__all__ = ["SharedEngine"]

log = get_logger("pgleaderlock.coordination")

T = TypeVar("T")

MEMBER_LOCK_WAIT_S = 1.0
"""How long a reconnecting member tries for its own lock, which a watch may hold."""
FREE_GRACE_S = 1.0
"""How long a name stays free before a member that is not its rendezvous owner takes it."""


class SharedEngine(Engine):
    """A member whose names share one session (``sessions="shared"``)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._hold_slot = self.slot("hold")
        self._hold: GroupSession | None = None
        self._owned: dict[Key, int | None] = {}  # key -> fencing term (None without)
        self._key = member_key(self.group, self.member)
        self._hold_lock = asyncio.Lock()  # one call at a time on the hold session
        self._broken = False  # the hold session failed; the loop reconnects
        self._wake = asyncio.Event()
        self._free_since: dict[Key, float] = {}  # free names, since when (monotonic)

    # ------------------------------------------------------------------ sessions

    async def _open(self) -> None:
        await self._connect()
        await self.start_listening()
        self.spawn(self.watch_forever(), f"pgleaderlock-watch:{self.group}")
        self.spawn(self._probe_forever(), f"pgleaderlock-probe:{self.group}")

    async def _connect(self) -> None:
        """Open the hold session and take the member's place, retried with the retry
        strategy's delays until it works."""

        async def attempt() -> GroupSession:
            try:
                session = await self.open_session(self._hold_slot)
                await self._take_member_lock(session)
                if self.settings.terms is not None:  # a table refused stops the member now
                    ready = self._prepare_tables(self.settings.terms)
                    await self.bounded(self._hold_slot, ready)
                return session
            except BaseException:
                await self._hold_slot.close()
                raise

        self._hold = await self.retrying("hold_session_failed", attempt)
        self._broken = False
        self._arm(self._hold)
        await self.announce(Message("join", self.member))

    async def _take_member_lock(self, session: GroupSession) -> None:
        """Take this member's own lock. After a lost hold session, another member's
        watch may hold it for a moment (it was granted it, and is about to unlock it):
        try again for a while before giving up on this attempt."""
        deadline = time.monotonic() + MEMBER_LOCK_WAIT_S
        while not await self.bounded(self._hold_slot, session.try_lock_many([self._key])):
            if time.monotonic() >= deadline:
                raise ConnectionError(f"member lock of {self.member} is taken")
            await asyncio.sleep(0.02)

    async def _prepare_tables(self, terms: TermTable) -> None:
        await self._hold_slot.prepare(terms)
        await self._hold_slot.prepare(self.settings.checkpoints)

    async def _close(self) -> None:
        await self.workers.stop()
        held = list(self._owned)
        self._owned.clear()
        if self._hold is not None and not self._broken:
            try:  # the member lock too: the others no longer count this member
                await self._call(lambda s: s.unlock_many([*held, self._key]))
            except Exception as exc:  # closing the session frees the locks anyway
                log.warning("release_failed", error=repr(exc), **self._fields)
            else:
                await self.announce(Message("leave", self.member))
        self._hold = None
        await self._hold_slot.close()

    async def _call(
        self, call: Callable[[GroupSession], Awaitable[T]], timeout_s: float | None = None
    ) -> T:
        """``call(hold session)``, alone on the session, within ``timeout_s`` (default
        ``health_timeout_s``). If it fails, the session is given up and every worker is
        cancelled before this raises (see the module docstring)."""
        session = self._hold
        if session is None or self._broken:
            raise ConnectionError("the hold session is being reopened")
        async with self._hold_lock:
            if session is not self._hold or self._broken:
                raise ConnectionError("the hold session is being reopened")
            try:
                timeout = timeout_s or self.settings.config.health_timeout_s
                result = await self.bounded(self._hold_slot, call(session), timeout)
            except Exception as exc:
                await self._demote(session, exc)
                raise
            self._arm(session)
            return result

    async def _demote(self, session: GroupSession, error: BaseException) -> None:
        """The hold session failed: the server may grant its names to others at any
        moment, so every worker stops now; the loop reconnects (``lost``)."""
        if session is not self._hold or self._broken:
            return
        self._broken = True
        session_names = {self.names[k] for k in self._owned if k in self.names}
        log.warning("names_lost", error=repr(error), count=len(session_names), **self._fields)
        self._owned.clear()
        await self.workers.stop(session_names)
        self.events.put_nowait(Broken(error, fatal=False))

    async def _reconnect(self) -> None:
        """After ``_demote``: a new hold session, and the member's place again."""
        if not self._broken:
            return
        self._hold = None
        await self._hold_slot.close()
        await self._connect()
        self.events.put_nowait(Look())

    async def _group_rows(self) -> list[Any]:
        return await self._call(self._read_group)

    async def notify(self, message: Message) -> None:
        for payload in message.payloads():
            await self._call(functools.partial(_notify, channel=self.channel, payload=payload))

    # ------------------------------------------------------------------ names

    def _held(self) -> set[Key]:
        return set(self._owned)

    def _to_take(self, view: balance.View) -> list[Key]:
        now = time.monotonic()
        free = view.free()
        self._free_since = {k: self._free_since.get(k, now) for k in free}
        take = view.mine_to_take()
        if not take and not balance.requests(view):
            # What stays free has no other taker (its rendezvous owner did not register
            # it, or is gone): take it, after a grace that lets the owner go first.
            take = [k for k in free if now - self._free_since[k] >= FREE_GRACE_S]
        return take

    async def _take(self, keys: list[Key], *, handoff: bool) -> list[Key]:
        keys = [k for k in keys if k in self.names and k not in self._owned]
        if not keys:
            return []
        try:
            granted = await self._call(lambda s: s.try_lock_many(keys))
            if granted:
                self._hold_slot.granted()  # the next probe asks pg_locks
            terms: dict[Key, int] | None = {}
            if granted and self.settings.terms is not None:
                terms = await self._bump_terms(self.settings.terms, granted)
        except Exception as exc:  # the session is given up (_call): the loop reconnects
            if is_permanent(exc, self.settings.config):  # ... unless that cannot help
                raise
            return []
        if terms is None:  # fenced transactions of older terms hold on: try again later
            with contextlib.suppress(Exception):  # else the session is given up (_call)
                await self._call(lambda s: s.unlock_many(granted))
            return []
        if self._broken:  # the probe gave the session up meanwhile
            return []
        for key in granted:
            self._owned[key] = terms.get(key)
            self.start_worker(self.names[key], terms.get(key))
        if granted:
            log.info("names_taken", count=len(granted), handoff=handoff, **self._fields)
        return granted

    async def _bump_terms(self, table: TermTable, keys: list[Key]) -> dict[Key, int] | None:
        """Bump the terms of ``keys``, just taken. The bump waits ``fencing_grace_s`` for
        the fenced transactions of the names' last leaders; those still there then are
        ended (a frozen or cut-off old leader's), and the bump tried once more. ``None``:
        some are still there (this role may not end them), nothing was bumped."""
        config = self.settings.config
        grace = config.fencing_grace_s
        timeout = grace + config.health_timeout_s
        terms = await self._call(lambda s: self._bump(s, table, keys), timeout)
        if terms is not None:
            return terms
        log.warning("term_bump_blocked", grace_s=grace, count=len(keys), **self._fields)
        ended = await self._call(lambda s: s.end_fenced(table, keys))
        if ended.ended:
            log.warning("fenced_sessions_ended", pids=list(ended.ended), **self._fields)
        if ended.refused:
            log.error(
                "fenced_sessions_not_ended",
                sessions=[f"{pid} ({role})" for pid, role in ended.refused],
                reason="this role may not end them: that takes their role, or "
                "pg_signal_backend; the names are given back and taken again later",
                **self._fields,
            )
        return await self._call(lambda s: self._bump(s, table, keys), timeout)

    def _bump(
        self, session: GroupSession, table: TermTable, keys: list[Key]
    ) -> Awaitable[dict[Key, int] | None]:
        grace = self.settings.config.fencing_grace_s
        bump = functools.partial(session.bump_terms, table, keys, grace)
        return self._hold_slot.with_table(table, bump)

    async def _release(self, keys: list[Key]) -> list[Key]:
        """Stop the workers of ``keys``, then unlock them."""
        keys = [k for k in keys if k in self._owned]
        await self.workers.stop({self.names[k] for k in keys if k in self.names})
        for key in keys:
            self._owned.pop(key, None)
        with contextlib.suppress(Exception):  # else the session is given up (_call)
            await self._call(lambda s: s.unlock_many(keys))
        return keys

    async def _give(self, keys: list[Key], to: str) -> int:
        # Announced before the release, so that no third member takes them meanwhile.
        await self.notify(Message("handoff", self.member, to, tuple(keys)))
        given = await self._release(keys)
        await self.notify(Message("grant", self.member, to, tuple(given)))
        return len(given)

    async def _drain(self) -> None:
        await self.workers.drain(None, self.settings.config.drain_s)

    async def _remove(self, name: str) -> None:
        key = self.keys.get(name)
        if key is not None and key in self._owned:
            await self.workers.drain({name}, self.settings.config.drain_s)
            await self._release([key])
            await self.notify(Message("released", self.member, keys=(key,)))

    async def _give_away(self, name: str) -> None:
        key = self.keys.get(name)
        if key is None or key not in self._owned:
            return
        self.excluded[key] = (time.monotonic() + self.settings.give_away_cooldown_s, "")
        await self._release([key])
        log.warning("name_given_away", name=name, **self._fields)
        await self.notify(Message("released", self.member, keys=(key,)))

    async def _on_event(self, event: GroupEvent) -> None:
        if isinstance(event, Broken):
            await self._reconnect()
        elif isinstance(event, MemberGone) and event.member:
            await self._take_from(event.member)

    async def _take_from(self, dead: str) -> None:
        """Take, at once, the names of a dead member that the rendezvous gives this one
        among the survivors, from the last view (a fresh one costs a read of the whole
        lock table); the tick that follows reads the group again and takes the rest."""
        view = self.last_view
        if view is None:
            return
        survivors = view.members - {dead}
        mine = [
            key
            for key, holder in view.holders.items()
            if holder == dead
            and key not in self.excluded
            and balance.hrw_owner(key, survivors) == self.member
        ]
        await self._take(mine, handoff=False)

    # ------------------------------------------------------------------ helpers

    async def _probe_forever(self) -> None:
        """Probe the hold session every ``health_interval_s``, or at once when the
        server ends it while idle (its socket turns readable): in a task of its own, so
        that a busy loop never delays it."""
        while True:
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(self.settings.config.health_interval_s):
                    await self._wake.wait()
            self._wake.clear()
            session = self._hold
            if session is None or self._broken:
                continue
            try:
                held = await self._call(lambda s: self._probe())
            except Exception:  # given up (_call)
                continue
            if not held:
                error = ConnectionError("the hold session no longer holds its member lock")
                async with self._hold_lock:
                    await self._demote(session, error)

    async def _probe(self) -> bool:
        """Does the hold session still hold the member lock? As a lock's probe: the
        core's choice of ``pg_locks`` or the cheap probe (``SessionSlot``)."""
        probe = self._hold_slot.start_probe()
        if probe is None:
            return await self._hold_slot.holds(*self._key)
        await probe
        return True

    def _arm(self, session: GroupSession) -> None:
        """Watch the idle hold session: a server that ends it (a terminated backend, a
        shutdown) wakes the probe at once. Any call on the session disarms it."""
        self._hold_slot.watch(self._wake.set)


async def _notify(session: GroupSession, *, channel: str, payload: str) -> None:
    await session.notify(channel, payload)
