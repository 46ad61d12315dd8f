"""A member's place in its group, and what it knows of the group.

Each member holds its own lock on a session of its own (shared mode: the "hold"
session, which also holds the names; dedicated: the "util" session): a LeaderLock,
whose machine connects, retries, probes, watches and reconnects it. The member's
statements (the group's snapshot, notifications, and in shared mode the names' locks)
are calls that machine schedules between its probes (`run_on_session`).

A member is alive while that lock is held: the group's view (who is a member, who
leads which name, who waits for it) is read from ``pg_locks`` and
``pg_stat_activity`` on it.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import Any, TypeVar, cast

from ..lowlevel import (
    LeaderLock,
    LockState,
    RetryContext,
    SessionSlot,
    delay_or_give_up,
    follow_state,
    get_logger,
    is_permanent,
    lock_arguments,
    oid_to_key,
    run_on_session,
)
from . import balance
from .events import Broken, GroupEvent, Look
from .protocol import Key, Role, app_name, member_key, parse_app_name, prefix
from .session import GroupSession, group_session
from .settings import Settings

__all__ = ["GroupView", "Membership"]

log = get_logger("pgleaderlock.coordination")

T = TypeVar("T")


@dataclass(frozen=True)
class GroupView:
    """Who leads what in a group, as one member saw it.

    Attributes:
        members: the live members and how many of this member's names each leads.
        leaders: for each name registered here: the member that leads it, ``""`` for a
            session outside the group (a plain lock), or ``None`` if nobody does.
        others: locks held by the group's members that are not names registered here,
            by keys, with their holder.
    """

    members: dict[str, int]
    leaders: dict[str, str | None]
    others: dict[Key, str]


class Membership:
    """The member lock (join, calls on its session) and the group's view read on it.

    Args:
        settings: the coordinator's.
        role: the member lock's session's role (``"hold"`` or ``"util"``).
        names: the names registered here, by key (read, never changed here).
        post: puts an event on the member's loop.
        on_lost: awaited on the member lock's task when it leaves LEADER (with the new
            state), before anything else happens to it.
        fields: added to every log record.
    """

    def __init__(
        self,
        settings: Settings,
        role: Role,
        names: Mapping[Key, str],
        post: Callable[[GroupEvent], None],
        on_lost: Callable[[LockState], Awaitable[None]],
        fields: dict[str, Any],
    ) -> None:
        self.settings = settings
        self.group, self.member = settings.group, settings.member
        self._role = role
        self._names = names
        self._post = post
        self._on_lost = on_lost
        self._fields = fields
        self.lock: LeaderLock | None = None  # this member's own lock (see start)
        self.view: GroupView = GroupView({}, {}, {})
        self.members: frozenset[str] = frozenset()
        self.last_view: balance.View | None = None
        # key -> the members whose locks wait for it (dedicated sessions), last look
        self.waiting: dict[Key, frozenset[str]] = {}
        # pid -> member: the group's sessions of trusted roles, whose messages count
        self.senders: dict[int, str] = {}

    # ------------------------------------------------------------------ the member lock

    def _lock_for(self) -> LeaderLock:
        lock = LeaderLock(
            self.settings.user_dsn,
            *member_key(self.group, self.member),
            name=f"{self.group}:{self.member}",
            **lock_arguments(
                {
                    **self.settings.lock_kwargs,
                    "application_name": app_name(self.group, self.member, self._role),
                    "fencing": False,  # the names have terms; the member lock needs none
                    "drain_s": 0.0,  # the workers drain before the member leaves (_drain)
                    "acquire_delay_s": 0.0,
                }
            ),
        )
        follow_state(lock, self._on_state)
        return lock

    async def start(self) -> None:
        """Start the member lock (made at the first start, kept for the next)."""
        lock = self.lock = self.lock or self._lock_for()
        await lock.start()

    async def join(self) -> None:
        """Wait until the member lock leads, then check the session and the tables on
        it.

        A check that fails for a reason retrying may mend (another session's lock holds
        it past its bound, a terminated backend, a slow server) has cost the member lock
        its leadership: wait for it to lead again, after the retry strategy's delay, and
        check again. An error that retrying cannot mend (an untrusted table, a missing
        privilege, a session that cannot serve a group), a strategy that gives up, or
        the member lock stopping for good, ends the member with that error."""
        lock = self.lock
        assert lock is not None
        attempt, since = 0, time.monotonic()
        while True:
            if not await lock.wait_for_leadership():
                raise lock.stop_error or ConnectionError("the member lock stopped")
            try:
                await self.call_slot(self._prepare)
                return
            except Exception as exc:
                if is_permanent(exc, self.settings.config):
                    raise
                attempt += 1
                ctx = RetryContext(attempt, time.monotonic() - since, exc)
                delay = delay_or_give_up(self.settings.retry, ctx, self._fields["lock"])
                log.warning("join_failed", error=repr(exc), attempt=attempt,
                            retry_in_s=None if delay is None else round(delay, 3),
                            **self._fields)  # fmt: skip
                if delay is None:
                    raise
                await asyncio.sleep(delay)

    async def _prepare(self, slot: SessionSlot) -> None:
        """The member's session can serve a group, and the tables are usable."""
        group_session(slot.session)
        if self.settings.terms is not None:
            await slot.prepare(self.settings.terms)
            await slot.prepare(self.settings.checkpoints)

    async def _on_state(self, old: LockState, new: LockState) -> None:
        """On the member lock's task, before anything else happens to it."""
        if old is LockState.LEADER:
            await self._on_lost(new)
        if new is LockState.LEADER:
            self._post(Look("joined"))
        elif new is LockState.STOPPED and self.lock is not None:
            error = self.lock.stop_error
            if error is not None:  # one retrying cannot mend: the member stops with it
                self._post(Broken(error))

    async def call(
        self, call: Callable[[GroupSession], Awaitable[T]], timeout_s: float | None = None
    ) -> T:
        """``call(session)`` on the member lock's session, as a call its machine
        schedules, within ``timeout_s`` (default ``health_timeout_s``). If it fails,
        the member lock leaves LEADER and reconnects."""

        def on_session(slot: SessionSlot) -> Awaitable[T]:
            return call(cast(GroupSession, slot.session))

        return await self.call_slot(on_session, timeout_s)

    async def call_slot(
        self, call: Callable[[SessionSlot], Awaitable[T]], timeout_s: float | None = None
    ) -> T:
        """``call(slot)``: for the calls that need what the core knows of the session
        (its checked tables, its probe)."""
        lock = self.lock
        if lock is None:
            raise ConnectionError("the member has no session of its own")
        return await run_on_session(lock, call, timeout_s or self.settings.config.health_timeout_s)

    # ------------------------------------------------------------------ the group's view

    async def group_rows(self) -> list[Any]:
        """The group's sessions and their locks (``GroupSession.group_snapshot``)."""
        return await self.call(self.read_group)

    def read_group(self, session: GroupSession) -> Awaitable[list[Any]]:
        """``session.group_snapshot`` for this group."""
        return session.group_snapshot(prefix(self.group), self.settings.config.trusted_roles)

    async def snapshot(self) -> balance.View:
        """Read who holds what (the group's sessions, and every advisory lock, so that
        a name held outside the group counts as taken) and remember it.

        A member is alive while its hold (shared) or util (dedicated) session holds
        its member lock: a dying member's other sessions may linger for a moment, but
        the server has then released that lock along with its names."""
        rows = await self.group_rows()
        self.senders = self.members_by_pid(rows)
        names = self._names
        holders: dict[Key, str] = {}
        members: set[str] = {self.member}
        others: dict[Key, str] = {}
        waiting: dict[Key, set[str]] = {}
        for application, _pid, c, o, granted, trusted in rows:
            if c is None:
                continue
            # A session of a role not trusted is never a member, whatever its name says.
            parsed = parse_app_name(str(application or ""), self.group) if trusted else None
            member = parsed[0] if parsed is not None else ""
            key = (oid_to_key(int(c)), oid_to_key(int(o)))
            if not granted:
                if key in names and member:
                    waiting.setdefault(key, set()).add(member)
                continue
            if key in names:
                holders[key] = member
            elif parsed is None:
                continue
            elif parsed[1] in ("hold", "util") and key == member_key(self.group, member):
                members.add(member)
            elif parsed[1] in ("hold", "lock"):
                others[key] = member
        self.waiting = {key: frozenset(who) for key, who in waiting.items()}
        view = balance.View(self.member, frozenset(members), holders, frozenset(names))
        return self.remember(view, others)

    def members_by_pid(self, rows: list[Any]) -> dict[int, str]:
        """The group's sessions of trusted roles in ``rows`` (``group_snapshot``'s): by
        pid, the member each belongs to."""
        found: dict[int, str] = {}
        for application, pid, c, _o, _granted, trusted in rows:
            if c is None and trusted:
                parsed = parse_app_name(str(application or ""), self.group)
                if parsed is not None:
                    found[int(pid)] = parsed[0]
        return found

    def remember(self, view: balance.View, others: dict[Key, str]) -> balance.View:
        """Keep ``view`` as the last one, and what ``Coordinator.view()`` shows."""
        self.last_view = view
        self.members = view.members
        leaders = {self._names[k]: view.holders.get(k) for k in self._names}
        self.view = GroupView(view.counts(), leaders, others)
        return view

    def gone(self, member: str) -> None:
        """``member`` is known to be gone (before the next look confirms it)."""
        self.members = self.members - {member}
