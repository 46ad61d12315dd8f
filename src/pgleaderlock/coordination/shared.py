"""Shared sessions: every name a member leads is held by one session, whatever their
number. Three sessions per member in all:

- **hold** holds the member's own lock (its place in the group) and the lock of every
  name it leads. It is a [`LeaderLock`][pgleaderlock.LeaderLock] on the member's lock:
  its machine connects, retries, probes it (every ``health_interval_s``, at once when
  the server ends it while idle, late probes and grace as for any lock) and reconnects
  it; the member's statements (take and give names in batches, the group's snapshot,
  notifications) are calls that machine schedules between its probes
  ([`run_on_session`][pgleaderlock.core.lock.run_on_session]), each bounded by
  ``health_timeout_s`` (a term bump by ``fencing_grace_s + health_timeout_s``). The
  first call or probe that fails ends the lock's leadership, and every worker is
  cancelled as it leaves LEADER, before anything else: as for a lock, a member cut off
  from the server stops its work before the server can free its names
  (``tcp_user_timeout_s`` exceeds that bound);
- **listen** receives the group's notifications;
- **watch** waits on the server for the lock of the next member in the ring of members
  (the engine's, as in dedicated mode): when that member dies, this member tells the
  group, so that the dead member's names are led again within milliseconds.

Losing the hold session loses every name at once (its workers are cancelled), which is
the trade-off of this mode; the hold lock then reconnects with the retry strategy and
the member takes its share again.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import time
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar, cast

from ..core import (
    ConfigurationError,
    LeaderLock,
    LockState,
    SessionSlot,
    TermTable,
    can,
    follow_state,
    get_logger,
    is_permanent,
    run_on_session,
)
from . import balance
from .engine import Engine
from .events import Broken, GroupEvent, Look, MemberGone
from .protocol import Key, Message, app_name, member_key
from .session import GroupSession

__all__ = ["SharedEngine"]

log = get_logger("pgleaderlock.coordination")

T = TypeVar("T")

FREE_GRACE_S = 1.0
"""How long a name stays free before a member that is not its rendezvous owner takes it."""


class SharedEngine(Engine):
    """A member whose names share one session (``sessions="shared"``)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._hold: LeaderLock | None = None  # the member lock, whose session holds all
        self._owned: dict[Key, int | None] = {}  # key -> fencing term (None without)
        # Names whose workers stopped when the hold lock left LEADER while its session
        # may still hold them (a late probe): unlocked when it leads again.
        self._stale: set[Key] = set()
        self._key = member_key(self.group, self.member)
        self._free_since: dict[Key, float] = {}  # free names, since when (monotonic)

    # ------------------------------------------------------------------ sessions

    def _hold_lock(self) -> LeaderLock:
        lock = LeaderLock(
            self.settings.user_dsn,
            *self._key,
            name=f"{self.group}:{self.member}",
            application_name=app_name(self.group, self.member, "hold"),
            **{
                **self.settings.lock_kwargs,
                "fencing": False,  # the names have terms; the member lock needs none
                "drain_s": 0.0,  # the workers drain before the member leaves (_drain)
                "acquire_delay_s": 0.0,
            },
        )
        follow_state(lock, self._on_hold_state)
        return lock

    async def _open(self) -> None:
        """Start the hold lock and wait until it leads (``start()`` returns after the
        connection budget, as a lock's does after its first attempt, while it goes on
        trying); then the tables, the listener and the ring watch."""
        hold = self._hold = self._hold or self._hold_lock()
        await hold.start()
        leading = asyncio.ensure_future(hold.wait_for_leadership())
        self._connecting = True  # a shutdown meanwhile cuts the wait short
        try:
            try:
                async with asyncio.timeout(self.settings.config.connect_budget_s or 30.0):
                    await asyncio.shield(leading)
            except TimeoutError:
                self._set_started()
            if not await leading:
                raise hold.stop_error or ConnectionError("the member's hold lock stopped")
        finally:
            self._connecting = False
            leading.cancel()
        await self._call_slot(self._prepare)  # a table refused stops the member now
        await self.start_listening()
        self.spawn(self.watch_forever(), f"pgleaderlock-watch:{self.group}")

    async def _prepare(self, slot: SessionSlot) -> None:
        """The hold session can serve a group, and the tables are usable."""
        if not can(slot.session, GroupSession):
            raise ConfigurationError(
                f"{type(slot.session).__name__} sessions cannot serve a Coordinator "
                "(no GroupSession capability)"
            )
        if self.settings.terms is not None:
            await slot.prepare(self.settings.terms)
            await slot.prepare(self.settings.checkpoints)

    async def _on_hold_state(self, old: LockState, new: LockState) -> None:
        """On the hold lock's task, before anything else happens to it: leaving LEADER
        stops every worker at once (the server may free the names any moment); leading
        (again) tells the loop, which joins the group."""
        if old is LockState.LEADER and self._owned:
            self._stale |= set(self._owned)
            names = {self.names[k] for k in self._owned if k in self.names}
            self._owned.clear()
            error = self._hold.statistics().last_error if self._hold is not None else None
            log.warning("names_lost", error=repr(error), state=new.value, count=len(names),
                        **self._fields)  # fmt: skip
            await self.workers.stop(names)
        if new is LockState.LEADER:
            self.events.put_nowait(Look("joined"))
        elif new is LockState.STOPPED and self._hold is not None:
            error = self._hold.stop_error
            if error is not None:  # one retrying cannot mend: the member stops with it
                self.events.put_nowait(Broken(error, fatal=True))

    async def _close(self) -> None:
        await self.workers.stop()
        held = list(self._owned)
        self._owned.clear()
        hold = self._hold
        if hold is None:
            return
        if hold.is_leader:
            try:
                await self._call(lambda s: s.unlock_many(held))
            except Exception as exc:  # closing the session frees the locks anyway
                log.warning("release_failed", error=repr(exc), **self._fields)
            else:
                await self.announce(Message("leave", self.member))
        await hold.shutdown()  # the member lock: the others no longer count this member

    async def _call(
        self, call: Callable[[GroupSession], Awaitable[T]], timeout_s: float | None = None
    ) -> T:
        """``call(hold session)``, as a call the hold lock's machine schedules, within
        ``timeout_s`` (default ``health_timeout_s``). If it fails, the hold lock leaves
        LEADER (every worker is cancelled) and reconnects."""
        hold = self._hold
        if hold is None:
            raise ConnectionError("the member has no hold session")

        def on_hold(slot: SessionSlot) -> Awaitable[T]:
            return call(cast(GroupSession, slot.session))

        timeout = timeout_s or self.settings.config.health_timeout_s
        return await run_on_session(hold, on_hold, timeout)

    async def _group_rows(self) -> list[Any]:
        return await self._call(self._read_group)

    async def notify(self, message: Message) -> None:
        for payload in message.payloads():
            await self._call(functools.partial(_notify, channel=self.channel, payload=payload))

    async def _on_event(self, event: GroupEvent) -> None:
        if isinstance(event, Broken):
            raise event.error
        if isinstance(event, Look) and event.why == "joined":
            await self._rejoin()
        elif isinstance(event, MemberGone) and event.member:
            await self._take_from(event.member)

    async def _rejoin(self) -> None:
        """The hold lock leads (again): names its session may still hold from before
        are released (their workers stopped), and the group is told."""
        stale, self._stale = list(self._stale), set()
        if stale:
            with contextlib.suppress(Exception):  # a failure ends the leadership
                await self._call(lambda s: s.unlock_many(stale))
        await self.announce(Message("join", self.member))

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
            lost_before = len(self._stale)
            granted = await self._call_slot(functools.partial(_try_lock_many, keys))
            terms: dict[Key, int] | None = {}
            if granted and self.settings.terms is not None:
                terms = await self._bump_terms(self.settings.terms, granted)
        except Exception as exc:  # the hold lock left LEADER (_call): it reconnects
            if is_permanent(exc, self.settings.config):  # ... unless that cannot help
                raise
            return []
        if terms is None:  # fenced transactions of older terms hold on: try again later
            with contextlib.suppress(Exception):  # else the session is given up (_call)
                await self._call(lambda s: s.unlock_many(granted))
            return []
        if self._hold is None or not self._hold.is_leader or len(self._stale) != lost_before:
            self._stale.update(granted)  # the hold lock left LEADER meanwhile
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
        bump = functools.partial(_bump_terms, table, keys, grace)
        terms = await self._call_slot(bump, timeout)
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
        return await self._call_slot(bump, timeout)

    async def _call_slot(
        self, call: Callable[[SessionSlot], Awaitable[T]], timeout_s: float | None = None
    ) -> T:
        """``call(hold lock's slot)``: for the calls that need what the core knows of the
        session (its checked tables, its probe)."""
        hold = self._hold
        if hold is None:
            raise ConnectionError("the member has no hold session")
        return await run_on_session(hold, call, timeout_s or self.settings.config.health_timeout_s)

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


async def _notify(session: GroupSession, *, channel: str, payload: str) -> None:
    await session.notify(channel, payload)


async def _try_lock_many(keys: list[Key], slot: SessionSlot) -> list[Key]:
    granted = await cast(GroupSession, slot.session).try_lock_many(keys)
    if granted:
        slot.granted()  # the next probe asks pg_locks
    return granted


def _bump_terms(
    table: TermTable, keys: list[Key], grace_s: float, slot: SessionSlot
) -> Awaitable[dict[Key, int] | None]:
    session = cast(GroupSession, slot.session)
    return slot.with_table(table, functools.partial(session.bump_terms, table, keys, grace_s))
