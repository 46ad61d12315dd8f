"""Shared sessions: every name a member leads is held by one session, whatever their
number. Three sessions per member in all:

- **hold** holds the member's own lock (its place in the group) and the lock of every
  name it leads. It is the member lock's session (`membership.py`'s: a
  [`LeaderLock`][pgleaderlock.LeaderLock] whose machine connects, retries, probes it
  every ``health_interval_s`` and at once when the server ends it while idle, handles
  late probes and grace as for any lock, and reconnects it); the member's statements
  (take and give names in batches, the group's snapshot, notifications) are calls that
  machine schedules between its probes
  ([`run_on_session`][pgleaderlock.core.lock.run_on_session]), each bounded by
  ``health_timeout_s`` (a term bump by ``fencing_grace_s + health_timeout_s``). The
  first call or probe that fails ends the lock's leadership, and every worker is
  cancelled as it leaves LEADER, before anything else: as for a lock, a member cut off
  from the server stops its work before the server can free its names
  (``tcp_user_timeout_s`` exceeds that bound);
- **listen** receives the group's notifications;
- **watch** waits on the server for the lock of the next member in the ring of members
  (`watch.py`'s, as in dedicated mode): when that member dies, this member tells the
  group, so that the dead member's names are led again within milliseconds.

Losing the hold session loses every name at once (its workers are cancelled), which is
the trade-off of this mode; the hold lock then reconnects with the retry strategy and
the member takes its share again.
"""

from __future__ import annotations

import contextlib
import functools
import time
from collections.abc import Awaitable, Callable
from typing import Any, cast

from ..lowlevel import (
    LockState,
    SessionSlot,
    TermTable,
    get_logger,
    is_permanent,
    timeline_change,
)
from . import balance
from .events import GroupEvent, MemberGone
from .member import Engine
from .protocol import Key, Message
from .session import GroupSession
from .workers import gc_deferred

__all__ = ["SharedEngine"]

log = get_logger("pgleaderlock.coordination")


FREE_GRACE_S = 1.0
"""How long a name stays free before a member that is not its rendezvous owner takes it."""
FIRST_CHUNK = 128
"""A take of many names locks them in chunks, one statement each, on one call of the
hold session: this many first, then twice as many each time (up to `MAX_CHUNK`); the
workers of a chunk start as soon as it is granted, while the next one runs on the
server, so that the first names are led after a small statement, not after all."""
MAX_CHUNK = 1024
"""The largest chunk of a take (see `FIRST_CHUNK`)."""
MAX_CALL = 2048
"""The most names of a take locked on one call of the hold session (in chunks): the
workers of a call's chunks start, and take their first step, within the call's bound
(``health_timeout_s``), so that bound holds for the statements only, even for a take of
tens of thousands of names on a loaded machine."""


class SharedEngine(Engine):
    """A member whose names share one session (``sessions="shared"``)."""

    MEMBER_ROLE = "hold"
    # The other survivors are taking their shares meanwhile: a look reads the whole lock
    # table, and its rows cost a client thousands of objects; not while they take.
    GONE_LOOK_DELAY_S = 0.1

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._owned: dict[Key, int | None] = {}  # key -> fencing term (None without)
        # Names whose workers stopped when the hold lock left LEADER while its session
        # may still hold them (a late probe): unlocked when it leads again.
        self._stale: set[Key] = set()
        self._losses = 0  # times the hold lock left LEADER
        self._free_since: dict[Key, float] = {}  # free names, since when (monotonic)
        self._seen_terms: dict[Key, int] = {}  # fencing: the last term of each name here
        self._weights = balance.Weights()
        # From the last view: each other member's names this member takes when it dies.
        self._heirs: tuple[balance.View, dict[str, list[Key]]] | None = None

    # ------------------------------------------------------------------ sessions

    async def _open(self) -> None:
        await self._join()
        await self.start_listening()
        self.start_watching()

    async def _member_lost(self, state: LockState) -> None:
        """Every worker stops at once: the server may free the names any moment."""
        self._losses += 1
        if not self._owned:
            return
        self._stale |= set(self._owned)
        names = {self.names[k] for k in self._owned if k in self.names}
        self._owned.clear()
        lock = self.membership.lock
        error = lock.statistics().last_error if lock is not None else None
        log.warning("names_lost", error=repr(error), state=state.value, count=len(names),
                    **self._fields)  # fmt: skip
        await self.workers.stop(names)

    async def _rejoined(self) -> None:
        """Names the hold session may still hold from before are released (their
        workers stopped when it left LEADER)."""
        stale, self._stale = list(self._stale), set()
        if stale:
            with contextlib.suppress(Exception):  # a failure ends the leadership
                await self.membership.call(lambda s: s.unlock_many(stale))

    async def _close(self) -> None:
        await self.workers.stop()
        held = list(self._owned)
        self._owned.clear()
        await self._leave(lambda s: s.unlock_many(held))

    async def _on_event(self, event: GroupEvent) -> None:
        if isinstance(event, MemberGone) and event.member:
            await self._take_from(event.member)

    # ------------------------------------------------------------------ names

    def held(self) -> set[Key]:
        return set(self._owned)

    def to_take(self, view: balance.View) -> list[Key]:
        now = time.monotonic()
        free = view.free()
        self._free_since = {k: self._free_since.get(k, now) for k in free}
        take = view.mine_to_take()
        if not take and not balance.requests(view):
            # What stays free has no other taker (its rendezvous owner did not register
            # it, or is gone): take it, after a grace that lets the owner go first.
            take = [k for k in free if now - self._free_since[k] >= FREE_GRACE_S]
        return take

    async def standby(self, view: balance.View) -> bool:
        """Work out, from each view the tick reads, which names this member takes at once
        when another member dies (`_take_from`): the rendezvous weights are kept, so
        that a death costs this member no hashing. Nothing to wait for: False."""
        self._weights.keep_only(view.members)
        self._heirs = (view, balance.heirs(view, self._weights))
        return False

    async def take(self, keys: list[Key], *, handoff: bool) -> list[Key]:
        keys = [k for k in keys if k in self.names and k not in self._owned]
        if not keys:
            return []
        if self.settings.terms is None:
            granted = await self._take_in_chunks(keys)
            if granted:
                log.info("names_taken", count=len(granted), handoff=handoff, **self._fields)
            return granted
        try:
            losses = self._losses
            granted = await self.membership.call_slot(functools.partial(_try_lock_many, keys))
            terms: dict[Key, int] | None = {}
            if granted and self.settings.terms is not None:
                terms = await self._bump_terms(self.settings.terms, granted)
        except Exception as exc:  # the hold lock left LEADER (Membership.call): it reconnects
            if is_permanent(exc, self.settings.config):  # ... unless that cannot help
                raise
            return []
        if terms is None:  # fenced transactions of older terms hold on: try again later
            with contextlib.suppress(Exception):  # else the session is given up (Membership.call)
                await self.membership.call(lambda s: s.unlock_many(granted))
            return []
        if self._losses != losses:
            self._stale.update(granted)  # the hold lock left LEADER meanwhile
            return []
        self._note_timelines(terms)
        for key in granted:
            self._owned[key] = terms.get(key)
            self.start_worker(self.names[key], terms.get(key))
        if granted:
            log.info("names_taken", count=len(granted), handoff=handoff, **self._fields)
        return granted

    async def _take_in_chunks(self, keys: list[Key]) -> list[Key]:
        """Lock ``keys`` in chunks (see `FIRST_CHUNK`) on one call of the hold session,
        and start the workers of each chunk as it is granted; without fencing (with it,
        `take` locks them in one statement and bumps their terms before any worker
        starts). Returns the keys led here now."""
        losses = self._losses
        taken: list[Key] = []

        def granted_now(granted: list[Key]) -> None:
            # In the hold lock's call, between two statements: the lock leads.
            if self._losses != losses:
                self._stale.update(granted)  # the hold lock left LEADER since the take began
                return
            for key in granted:
                self._owned[key] = None
                self.start_worker(self.names[key], None)
            taken.extend(granted)

        try:
            with gc_deferred():
                for parts in calls(chunks(keys)):
                    await self.membership.call_slot(
                        functools.partial(_try_lock_chunks, parts, granted_now)
                    )
        except Exception as exc:  # the hold lock left LEADER (Membership.call): it reconnects
            if is_permanent(exc, self.settings.config):  # ... unless that cannot help
                raise
        return [k for k in taken if k in self._owned]

    def _note_timelines(self, terms: dict[Key, int]) -> None:
        """After a failover: one ``timeline_changed`` warning for the names whose new
        terms are on a later server timeline than the last term known of them."""
        changed: dict[str, dict[str, object]] = {}
        for key, term in terms.items():
            prior = getattr(term, "prior", None)  # a BumpedTerm says
            change = timeline_change(
                term, prior, getattr(term, "prior_at", None), self._seen_terms.get(key)
            )
            if change is not None and key in self.names:
                changed[self.names[key]] = change
            self._seen_terms[key] = max(int(term), self._seen_terms.get(key, 0))
        if not changed:
            return
        found = list(changed.values())
        report: dict[str, Any] = {
            "names": ", ".join(sorted(changed)),
            "from_timeline": min(cast(int, f["from_timeline"]) for f in found),
            "to_timeline": max(cast(int, f["to_timeline"]) for f in found),
            "since": min((str(f["since"]) for f in found if "since" in f), default=None),
            "may_be_lost": found[0]["may_be_lost"],
            "docs": found[0]["docs"],
        }
        log.warning("timeline_changed", **report, **self._fields)

    async def _bump_terms(self, table: TermTable, keys: list[Key]) -> dict[Key, int] | None:
        """Bump the terms of ``keys``, just taken. The bump waits ``fencing_grace_s`` for
        the fenced transactions of the names' last leaders; those still there then are
        ended (a frozen or cut-off old leader's), and the bump tried once more. ``None``:
        some are still there (this role may not end them), nothing was bumped."""
        config = self.settings.config
        grace = config.fencing_grace_s
        timeout = grace + config.health_timeout_s
        bump = functools.partial(_bump_terms, table, keys, grace)
        terms = await self.membership.call_slot(bump, timeout)
        if terms is not None:
            return terms
        log.warning("term_bump_blocked", grace_s=grace, count=len(keys), **self._fields)
        ended = await self.membership.call(lambda s: s.end_fenced(table, keys))
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
        return await self.membership.call_slot(bump, timeout)

    async def _release(self, keys: list[Key]) -> list[Key]:
        """Stop the workers of ``keys``, then unlock them."""
        keys = [k for k in keys if k in self._owned]
        await self.workers.stop({self.names[k] for k in keys if k in self.names})
        for key in keys:
            self._owned.pop(key, None)
        with contextlib.suppress(Exception):  # else the session is given up (Membership.call)
            await self.membership.call(lambda s: s.unlock_many(keys))
        return keys

    async def give(self, keys: list[Key], to: str) -> int:
        # Announced before the release, so that no third member takes them meanwhile.
        await self.mailbox.notify(Message("handoff", self.member, to, tuple(keys)))
        given = await self._release(keys)
        await self.mailbox.notify(Message("grant", self.member, to, tuple(given)))
        return len(given)

    async def _drain(self) -> None:
        await self.workers.drain(None, self.settings.config.drain_s)

    async def _remove(self, name: str) -> None:
        key = self.keys.get(name)
        if key is not None and key in self._owned:
            await self.workers.drain({name}, self.settings.config.drain_s)
            await self._release([key])
            await self.mailbox.notify(Message("released", self.member, keys=(key,)))

    async def _give_away(self, name: str) -> None:
        key = self.keys.get(name)
        if key is None or key not in self._owned:
            return
        self.balancer.excluded[key] = (time.monotonic() + self.settings.give_away_cooldown_s, "")
        await self._release([key])
        log.warning("name_given_away", name=name, **self._fields)
        await self.mailbox.notify(Message("released", self.member, keys=(key,)))

    async def _take_from(self, dead: str) -> None:
        """Take, at once, the names of a dead member that the rendezvous gives this one
        among the survivors, from the last view (a fresh one costs a read of the whole
        lock table); the tick that follows reads the group again and takes the rest."""
        view = self.membership.last_view
        if view is None:
            return
        heirs = self._heirs[1] if self._heirs is not None and self._heirs[0] is view else {}
        if dead not in heirs:  # not worked out from this view: now
            heirs = balance.heirs(view, self._weights, [dead])
        excluded = self.balancer.excluded
        await self.take([k for k in heirs[dead] if k not in excluded], handoff=False)


def chunks(keys: list[Key]) -> list[list[Key]]:
    """``keys`` in the chunks of a take: `FIRST_CHUNK`, then twice as many each time, up
    to `MAX_CHUNK`."""
    found: list[list[Key]] = []
    size, start = FIRST_CHUNK, 0
    while start < len(keys):
        found.append(keys[start : start + size])
        start += size
        size = min(2 * size, MAX_CHUNK)
    return found


def calls(parts: list[list[Key]]) -> list[list[list[Key]]]:
    """The chunks of a take, grouped into calls of at most `MAX_CALL` names (a chunk
    larger than that alone)."""
    found: list[list[list[Key]]] = []
    count = 0
    for part in parts:
        if not found or count + len(part) > MAX_CALL:
            found.append([])
            count = 0
        found[-1].append(part)
        count += len(part)
    return found


async def _try_lock_chunks(
    parts: list[list[Key]], granted_now: Callable[[list[Key]], None], slot: SessionSlot
) -> None:
    """``try_lock_many`` of each of ``parts`` in turn; ``granted_now`` is told what each
    granted before the next is sent."""
    session = cast(GroupSession, slot.session)
    for part in parts:
        granted = await session.try_lock_many(part)
        if granted:
            slot.granted()  # the next probe asks pg_locks
            granted_now(granted)


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
