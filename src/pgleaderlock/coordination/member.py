"""The part of a Coordinator that both session modes share: the member's event loop,
its view of the group, the balance protocol, and the workers.

One task per member runs the loop: it waits for an event (a notification from the
group, a tick, a lock's change, a request of the API) and acts, one event at a time, so
that the member's decisions never race each other. What differs between the session
modes (how names are taken and given back) is a subclass's.
"""

from __future__ import annotations

import abc
import asyncio
import contextlib
import dataclasses
import functools
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar, cast

from ..core import (
    Backend,
    ConfigurationError,
    ConnectOptions,
    LeaderLock,
    LockConfig,
    LockState,
    RetryContext,
    RetryStrategy,
    SessionFactory,
    SessionSlot,
    TermTable,
    WaitingSession,
    bounded,
    can,
    delay_or_give_up,
    follow_state,
    get_logger,
    is_permanent,
    lock_arguments,
    oid_to_key,
    run_on_session,
    session_settings,
)
from . import balance
from .events import Broken, GroupEvent, Look, MemberGone, NameEvent, Received, Stop, looks
from .protocol import (
    Key,
    Message,
    Role,
    app_name,
    channel,
    member_key,
    name_keys,
    parse_app_name,
    prefix,
)
from .session import GroupSession
from .workers import CheckpointTable, WorkerContext, WorkerFunction, Workers

__all__ = ["Engine", "GroupView", "Settings"]

log = get_logger("pgleaderlock.coordination")

T = TypeVar("T")

RECENT_GRANT_S = 1.0
"""How long a name granted to another member is left for that member to take."""
ANSWER_WAIT_S = 2.0
"""How long a member waits for the answer to a request before it asks that member
again (an answer normally comes within milliseconds: a grant, or an empty ``done``)."""
OUTSIDE_TICK_S = 2.0
"""How often a member looks at the group while some of its names are held outside the
group (a plain lock): their release is announced to nobody."""
WATCH_WAIT_S = 0.5
"""How long one wait of the ring watch lasts before it looks at the ring again (a new
member is watched from then on)."""
STRANGER_S = 60.0
"""How long the listener refuses the messages of a session that is not a trusted
member's without looking at the group's sessions again."""


@dataclass(frozen=True)
class Settings:
    """A coordinator's validated settings (see [`Coordinator`][pgleaderlock.Coordinator])."""

    group: str
    member: str
    config: LockConfig
    retry: RetryStrategy
    backend: Backend | None
    dsn: Any = field(repr=False)  # it may hold a password
    """The DSN the backend's driver takes (``resolve``'s)."""
    user_dsn: Any = field(repr=False)
    """The DSN as given (a LeaderLock resolves it again)."""
    connect_fn: SessionFactory | None
    checkpoints: CheckpointTable
    give_away_after_crashes: int | None
    give_away_cooldown_s: float
    balance_interval_s: float
    idle_tick_s: float
    lock_kwargs: dict[str, Any] = field(default_factory=dict)

    @property
    def terms(self) -> TermTable | None:
        return self.config.term_table


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


class Engine(abc.ABC):
    """The member's loop; see the module docstring."""

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.group, self.member = settings.group, settings.member
        self.channel = channel(settings.group)
        self.functions: dict[str, WorkerFunction] = {}
        self.keys: dict[str, Key] = {}
        self.names: dict[Key, str] = {}
        self.events: asyncio.Queue[GroupEvent] = asyncio.Queue()
        self.workers = Workers(
            settings.retry,
            settings.give_away_after_crashes,
            lambda name: self.events.put_nowait(NameEvent("crashed", name)),
            label=f"group:{settings.group}",
        )
        # key -> (until (monotonic), for whom): not this member's to take meanwhile; ""
        # for anyone else (a name given away), else the member it was handed to
        self.excluded: dict[Key, tuple[float, str]] = {}
        self.view: GroupView = GroupView({}, {}, {})
        self.members: frozenset[str] = frozenset()
        self.last_view: balance.View | None = None
        self.moves = 0  # names handed to other members, for statistics
        self.listening = asyncio.Event()
        self._asked: dict[str, float] = {}  # member -> until: a request awaits its answer
        # pid -> member: the group's sessions of trusted roles, whose messages count
        self._senders: dict[int, str] = {}
        self._senders_read_at = 0.0
        self._strangers: dict[int, float] = {}  # pid -> when found not to be a member's
        self._task: asyncio.Task[None] | None = None
        self._started: asyncio.Future[None] | None = None
        self._helpers: list[asyncio.Task[None]] = []
        self._unsettled = True
        self._outside = False  # some names are held outside the group
        self._stop_event = asyncio.Event()
        self._connecting = False
        self._watched: Key | None = None  # the member lock the watch session waits for
        self._member: LeaderLock | None = None  # this member's own lock (see _join)
        # key -> the members whose locks wait for it (dedicated sessions), last look
        self.waiting: dict[Key, frozenset[str]] = {}
        self.error: BaseException | None = None
        self._fields: dict[str, Any] = {
            "lock": f"group:{settings.group}",
            "member": settings.member,
        }

    # ------------------------------------------------------------------ for the API

    @property
    def owned(self) -> frozenset[str]:
        """The names this member leads now."""
        return frozenset(self.names[k] for k in self._held() if k in self.names)

    def register(self, name: str, fn: WorkerFunction) -> None:
        key = name_keys(self.group, name)
        self.functions[name], self.keys[name], self.names[key] = fn, key, name
        if self.running:
            self.events.put_nowait(NameEvent("added", name))

    async def unregister(self, name: str) -> None:
        done: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        if self.running:
            assert self._task is not None
            self.events.put_nowait(NameEvent("removed", name, done))
            await asyncio.wait([done, self._task], return_when=asyncio.FIRST_COMPLETED)
        if not done.done():  # not running, or stopped meanwhile: nothing held any more
            self._forget(name)

    def _forget(self, name: str) -> None:
        key = self.keys.pop(name, None)
        self.functions.pop(name, None)
        if key is not None:
            self.names.pop(key, None)

    @property
    def running(self) -> bool:
        return self._task is not None and not self._task.done()

    async def start(self) -> None:
        if not self.running:
            loop = asyncio.get_running_loop()
            self._stop_event.clear()
            self._drop_stale_stops()
            self.listening.clear()
            self.error = None
            self._started = loop.create_future()
            self._task = loop.create_task(self._main(), name=f"pgleaderlock-group:{self.group}")
        assert self._started is not None
        assert self._task is not None
        await asyncio.shield(self._started)
        if self._task.done() and self.error is not None:
            raise self.error

    def _drop_stale_stops(self) -> None:
        """A stop that ended the last run before its "stop" event was read must not end
        the next run: the other queued events stay, in order."""
        kept = []
        while not self.events.empty():
            event = self.events.get_nowait()
            if not isinstance(event, Stop):
                kept.append(event)
        for event in kept:
            self.events.put_nowait(event)

    async def stop(self) -> None:
        task = self._task
        if task is None or task.done():
            return
        self._stop_event.set()
        self.events.put_nowait(Stop())
        if self._connecting:
            task.cancel()  # a connection attempt would otherwise run to its timeout
        await asyncio.wait([task])

    # ------------------------------------------------------------------ the member lock

    # Each member holds its own lock on a session of its own (shared mode: the "hold"
    # session, which also holds the names; dedicated: the "util" session): a LeaderLock,
    # whose machine connects, retries, probes, watches and reconnects it. The member's
    # statements (the group's snapshot, notifications, and in shared mode the names'
    # locks) are calls that machine schedules between its probes (`run_on_session`).

    MEMBER_ROLE: Role = "util"

    def _member_lock_for(self) -> LeaderLock:
        lock = LeaderLock(
            self.settings.user_dsn,
            *member_key(self.group, self.member),
            name=f"{self.group}:{self.member}",
            **lock_arguments(
                {
                    **self.settings.lock_kwargs,
                    "application_name": app_name(self.group, self.member, self.MEMBER_ROLE),
                    "fencing": False,  # the names have terms; the member lock needs none
                    "drain_s": 0.0,  # the workers drain before the member leaves (_drain)
                    "acquire_delay_s": 0.0,
                }
            ),
        )
        follow_state(lock, self._on_member_state)
        return lock

    async def _join(self) -> None:
        """Start the member lock and wait until it leads, then check the session and the
        tables on it (``start()`` returns after the connection budget, as a lock's does
        after its first attempt, while this goes on).

        A check that fails for a reason retrying may mend (another session's lock holds
        it past its bound, a terminated backend, a slow server) has cost the member lock
        its leadership: wait for it to lead again, after the retry strategy's delay, and
        check again. An error that retrying cannot mend (an untrusted table, a missing
        privilege, a session that cannot serve a group), a strategy that gives up, or
        the member lock stopping for good, ends the member with that error."""
        lock = self._member = self._member or self._member_lock_for()
        await lock.start()
        budget = self.settings.config.connect_budget_s or 30.0
        started = asyncio.get_running_loop().call_later(budget, self._set_started)
        self._connecting = True  # a shutdown meanwhile cuts the join short
        attempt, since = 0, time.monotonic()
        try:
            while True:
                if not await lock.wait_for_leadership():
                    raise lock.stop_error or ConnectionError("the member lock stopped")
                try:
                    await self._call_slot(self._prepare)
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
        finally:
            self._connecting = False
            started.cancel()

    async def _prepare(self, slot: SessionSlot) -> None:
        """The member's session can serve a group, and the tables are usable."""
        group_session(slot.session)
        if self.settings.terms is not None:
            await slot.prepare(self.settings.terms)
            await slot.prepare(self.settings.checkpoints)

    async def _on_member_state(self, old: LockState, new: LockState) -> None:
        """On the member lock's task, before anything else happens to it."""
        if old is LockState.LEADER:
            await self._member_lost(new)
        if new is LockState.LEADER:
            self.events.put_nowait(Look("joined"))
        elif new is LockState.STOPPED and self._member is not None:
            error = self._member.stop_error
            if error is not None:  # one retrying cannot mend: the member stops with it
                self.events.put_nowait(Broken(error))

    async def _member_lost(self, state: LockState) -> None:  # noqa: B027 - optional
        """The member lock left LEADER (for ``state``): its session may be gone (default:
        nothing to do; the names do not live on it)."""

    async def _leave(self, last: Callable[[GroupSession], Awaitable[object]] | None) -> None:
        """Leave the group: ``last(session)`` and a "leave" message while the member lock
        leads, then shut the member lock down (the others no longer count this member)."""
        lock = self._member
        if lock is None:
            return
        if lock.is_leader:
            try:
                if last is not None:
                    await self._call(last)
            except Exception as exc:  # closing the session frees the locks anyway
                log.warning("release_failed", error=repr(exc), **self._fields)
            else:
                await self.announce(Message("leave", self.member))
        await lock.shutdown()

    async def _call(
        self, call: Callable[[GroupSession], Awaitable[T]], timeout_s: float | None = None
    ) -> T:
        """``call(session)`` on the member lock's session, as a call its machine
        schedules, within ``timeout_s`` (default ``health_timeout_s``). If it fails,
        the member lock leaves LEADER and reconnects."""

        def on_session(slot: SessionSlot) -> Awaitable[T]:
            return call(cast(GroupSession, slot.session))

        return await self._call_slot(on_session, timeout_s)

    async def _call_slot(
        self, call: Callable[[SessionSlot], Awaitable[T]], timeout_s: float | None = None
    ) -> T:
        """``call(slot)``: for the calls that need what the core knows of the session
        (its checked tables, its probe)."""
        lock = self._member
        if lock is None:
            raise ConnectionError("the member has no session of its own")
        return await run_on_session(lock, call, timeout_s or self.settings.config.health_timeout_s)

    async def _group_rows(self) -> list[Any]:
        """The group's sessions and their locks (``GroupSession.group_snapshot``)."""
        return await self._call(self._read_group)

    async def notify(self, message: Message) -> None:
        """Send ``message`` to the group."""
        for payload in message.payloads():
            await self._call(functools.partial(_notify, channel=self.channel, payload=payload))

    # ------------------------------------------------------------------ the loop

    async def _main(self) -> None:
        assert self._started is not None
        try:
            await self._open()
            self._set_started()
            next_tick = 0.0
            while True:
                timeout = max(0.0, next_tick - time.monotonic())
                event: GroupEvent
                try:
                    async with asyncio.timeout(timeout):
                        event = await self.events.get()
                except TimeoutError:
                    event = Look()
                if isinstance(event, Stop):
                    await self._drain()  # the helpers (the probe) still run meanwhile
                    break
                try:
                    await self._handle(event)
                    if looks(event):
                        await self._tick()
                        wait = self.settings.idle_tick_s
                        if self._unsettled:
                            wait = self.settings.balance_interval_s
                        if self._outside:  # nothing tells the group when those are freed
                            wait = min(wait, OUTSIDE_TICK_S)
                        next_tick = time.monotonic() + wait
                except Exception as exc:
                    if is_permanent(exc, self.settings.config):
                        raise
                    log.warning("group_event_failed", kind=type(event).__name__,
                                error=repr(exc), **self._fields)  # fmt: skip
                    self._unsettled = True
                    next_tick = min(next_tick, time.monotonic() + self.settings.balance_interval_s)
        except asyncio.CancelledError:
            if not self._stop_event.is_set():
                raise
            task = asyncio.current_task()
            if task is not None and task.cancelling():
                task.uncancel()  # stop() cut a connection attempt short: close normally
        except Exception as exc:
            self.error = exc
            log.error("coordinator_failed", error=repr(exc), exc_info=True, **self._fields)
        finally:
            self._set_started()
            # The helpers (listener, watch, probe) first: closing needs none of them, and a
            # message the listener acted on while the member closed would start work that
            # nobody awaits.
            for helper in self._helpers:
                helper.cancel()
            await asyncio.gather(*self._helpers, return_exceptions=True)
            self._helpers.clear()
            with contextlib.suppress(Exception):
                await self._close()

    def _set_started(self) -> None:
        if self._started is not None and not self._started.done():
            self._started.set_result(None)

    async def _handle(self, event: GroupEvent) -> None:
        match event:
            case Received(message=message):
                await self._on_message(message)
            case NameEvent(what="crashed", name=name):
                await self._give_away(name)
            case NameEvent(what="removed", name=name, done=done):
                try:
                    await self._remove(name)
                finally:
                    self._forget(name)
                    if done is not None and not done.done():
                        done.set_result(None)
            case Look(why="joined"):  # the member lock leads (again)
                await self._rejoined()
                await self.announce(Message("join", self.member))
            case Broken(error=error):
                raise error
            case MemberGone(member=member, seen_here=True):  # this member's watch saw it
                await self.announce(Message("left", self.member, to=member))  # tell all
                await self._on_event(event)
            case _:
                await self._on_event(event)

    async def _on_message(self, message: Message) -> None:
        if message.sender == self.member:
            return
        match message.kind:
            case "request" if message.to == self.member:
                await self._on_request(message)
            case "grant" if message.to == self.member:
                self._asked.pop(message.sender, None)
                await self._take(list(message.keys), handoff=True)
            case "done" if message.to == self.member:
                self._asked.pop(message.sender, None)
            case "left":
                self.events.put_nowait(MemberGone(message.to))  # the dead member
            case "join" | "leave" | "released":
                self.events.put_nowait(Look(message.kind))
            case "moved":
                self.events.put_nowait(Look("changed"))

    async def _on_request(self, message: Message) -> None:
        """Give what keeps the two members within balance; always answer (an empty
        ``done``), so that the requester may ask again. A request from a member not in
        the last view (a joiner whose "join" is queued behind its request) is weighed
        against a fresh view: the fair share counts the joiner."""
        if message.sender not in self.members:
            try:
                await self._snapshot()
            except Exception as exc:  # the last view, then: the next request asks again
                log.warning("group_snapshot_failed", error=repr(exc), **self._fields)
        held = self._held()
        seen = self.view.members.get(message.sender, 0)
        mine, theirs = len(held), max(message.count, seen)
        floor = len(self.names) // max(1, len(self.members))
        give: list[Key] = []
        for key in message.keys:
            if key in held and balance.should_grant(mine, theirs, floor):
                give.append(key)
                mine, theirs = mine - 1, theirs + 1
        if give:
            log.info("names_given", to=message.sender, count=len(give), **self._fields)
            self.moves += await self._give(give, message.sender)
            self.events.put_nowait(Look("changed"))  # look again: the view moved
        else:
            await self.announce(Message("done", self.member, message.sender))

    async def _tick(self) -> None:
        try:
            view = await self._snapshot()
        except Exception as exc:
            log.warning("group_snapshot_failed", error=repr(exc), **self._fields)
            self._unsettled = True
            return
        now = time.monotonic()
        self.excluded = {  # over once the receiver took it, or is gone
            k: (until, to)
            for k, (until, to) in self.excluded.items()
            if until > now and (not to or (to in view.members and view.holders.get(k) != to))
        }
        take = [k for k in self._to_take(view) if k not in self.excluded]
        taken = await self._take(take, handoff=False) if take else []
        if taken:  # no second read of the lock table: the view, as it is now
            holders = {**view.holders, **dict.fromkeys(taken, self.member)}
            view = self._remember(dataclasses.replace(view, holders=holders), self.view.others)
        unsettled = await self._standby(view)
        # Ask only while listening: the answer (a grant) would be missed otherwise.
        asks = balance.requests(view) if self.listening.is_set() else {}
        count = view.counts().get(self.member, 0)
        self._asked = {m: until for m, until in self._asked.items() if until > now}
        for giver, keys in asks.items():
            if giver not in self._asked:  # one request at a time per giver
                self._asked[giver] = now + ANSWER_WAIT_S
                await self.notify(Message("request", self.member, giver, tuple(keys), count))
        self._unsettled = bool(
            take
            or asks
            or unsettled
            or view.free()
            or self._pending()
            or not self.listening.is_set()
        )
        self._outside = "" in view.holders.values()

    async def _snapshot(self) -> balance.View:
        """Read who holds what (the group's sessions, and every advisory lock, so that
        a name held outside the group counts as taken) and remember it.

        A member is alive while its hold (shared) or util (dedicated) session holds
        its member lock: a dying member's other sessions may linger for a moment, but
        the server has then released that lock along with its names."""
        rows = await self._group_rows()
        self._senders = self._members_by_pid(rows)
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
                if key in self.names and member:
                    waiting.setdefault(key, set()).add(member)
                continue
            if key in self.names:
                holders[key] = member
            elif parsed is None:
                continue
            elif parsed[1] in ("hold", "util") and key == member_key(self.group, member):
                members.add(member)
            elif parsed[1] in ("hold", "lock"):
                others[key] = member
        self.waiting = {key: frozenset(who) for key, who in waiting.items()}
        view = balance.View(self.member, frozenset(members), holders, frozenset(self.names))
        return self._remember(view, others)

    def _members_by_pid(self, rows: list[Any]) -> dict[int, str]:
        """The group's sessions of trusted roles in ``rows`` (``group_snapshot``'s): by
        pid, the member each belongs to."""
        found: dict[int, str] = {}
        for application, pid, c, _o, _granted, trusted in rows:
            if c is None and trusted:
                parsed = parse_app_name(str(application or ""), self.group)
                if parsed is not None:
                    found[int(pid)] = parsed[0]
        return found

    def _read_group(self, session: GroupSession) -> Awaitable[list[Any]]:
        """``session.group_snapshot`` for this group."""
        return session.group_snapshot(prefix(self.group), self.settings.config.trusted_roles)

    def _remember(self, view: balance.View, others: dict[Key, str]) -> balance.View:
        """Keep ``view`` as the last one, and what ``Coordinator.view()`` shows."""
        self.last_view = view
        self.members = view.members
        leaders = {self.names[k]: view.holders.get(k) for k in self.names}
        self.view = GroupView(view.counts(), leaders, others)
        return view

    # ------------------------------------------------------------------ workers

    def context(self, name: str, term: int | None) -> WorkerContext:
        settings = self.settings
        return WorkerContext(
            name, term, self.member, settings.terms, settings.checkpoints, self.group
        )

    def start_worker(self, name: str, term: int | None) -> None:
        fn = self.functions.get(name)
        if fn is not None:
            self.workers.start(name, fn, self.context(name, term))

    # ------------------------------------------------------------------ sessions

    def options(self, role: Role) -> ConnectOptions:
        return ConnectOptions(
            application_name=app_name(self.group, self.member, role),
            connect_timeout_s=self.settings.config.connect_timeout_s,
            server_settings=session_settings(self.settings.config),
            lease_s=self.settings.config.lease_s,
            claim_s=self.settings.config.claim_s,
        )

    def slot(self, role: Role) -> SessionSlot:
        return SessionSlot(
            backend=self.settings.backend,
            dsn=self.settings.dsn,
            options=self.options(role),
            connect_fn=self.settings.connect_fn,
            log=log,
            fields=self._fields,
        )

    async def open_session(self, slot: SessionSlot) -> GroupSession:
        """Open a checked session (bounded); it must be able to serve a group."""
        budget = self.settings.config.connect_budget_s or 30.0
        session = await self.bounded(slot, slot.open(), budget)
        try:
            return group_session(session)
        except ConfigurationError:
            await slot.close()
            raise

    def bounded(
        self, slot: SessionSlot, call: Awaitable[T], timeout_s: float | None = None
    ) -> Awaitable[T]:
        """``call`` on ``slot``'s session within ``timeout_s`` (default
        ``command_timeout_s``), as a lock's calls are: the core's
        [`bounded`][pgleaderlock.core.calls.bounded] (the session is dropped before the
        call is cancelled).

        Raises:
            TimeoutError: the call took longer.
        """
        return bounded(call, timeout_s or self.settings.config.command_timeout_s, slot.abort)

    def spawn(self, coro: Awaitable[None], name: str) -> None:
        self._helpers.append(asyncio.get_running_loop().create_task(coro, name=name))  # type: ignore[arg-type]

    async def listen_forever(self) -> None:
        """Feed the group's notifications into the loop, reconnecting as needed; a
        quiet session is pinged every ``health_interval_s``."""
        slot = self.slot("listen")
        config = self.settings.config
        attempt = 0
        while True:
            try:
                session = await self.open_session(slot)
                await self.bounded(slot, session.listen(self.channel))
                self.listening.set()
                self.events.put_nowait(Look())  # what was held back may go now
                attempt = 0
                while True:
                    wait = config.health_interval_s
                    received = await self.bounded(
                        slot, session.notifications(wait), wait + config.command_timeout_s
                    )
                    received_at = time.monotonic()
                    for pid, payload in received:
                        message = Message.parse(payload)
                        if message is not None and await self._sent_by_member(
                            slot, session, pid, message, received_at
                        ):
                            self.note(message)
                            self.events.put_nowait(Received(message))
                    if not received:
                        await self.bounded(slot, session.ping(), config.health_timeout_s)
            except asyncio.CancelledError:
                await slot.close()
                raise
            except Exception as exc:
                attempt += 1
                log.warning("listen_failed", error=repr(exc), attempt=attempt, **self._fields)
            self.listening.clear()
            await slot.close()
            self._asked.clear()  # their answers may have been missed: ask again
            self.events.put_nowait(Look())  # notifications may have been missed
            await asyncio.sleep(min(self.settings.balance_interval_s * (attempt - 1), 5.0))

    async def _sent_by_member(
        self,
        slot: SessionSlot,
        session: GroupSession,
        pid: int,
        message: Message,
        received_at: float,
    ) -> bool:
        """Whether ``message`` comes from its sender: from a session of the sender
        member (by its name) whose role is trusted. Any role may ``NOTIFY`` on the
        group's channel; a message from anyone else is refused, and its session's
        messages for ``STRANGER_S`` with it. A sender not seen yet (a member that just
        joined) is looked for in the group's sessions once more, on the listening
        session, unless they were read after the message came: a session's name is
        visible from its start."""
        if self._senders.get(pid) == message.sender:
            return True
        now = time.monotonic()
        stranger_since = self._strangers.get(pid)
        if stranger_since is not None and now - stranger_since < STRANGER_S:
            return False
        if self._senders_read_at < received_at:
            self._senders_read_at = now
            self._senders = self._members_by_pid(
                await self.bounded(slot, self._read_group(session))
            )
            if self._senders.get(pid) == message.sender:
                return True
        if len(self._strangers) >= 1024:
            self._strangers = {p: at for p, at in self._strangers.items() if now - at < STRANGER_S}
        self._strangers[pid] = now
        log.warning("message_refused", pid=pid, kind=message.kind, sender=message.sender,
                    **self._fields)  # fmt: skip
        return False

    def note(self, message: Message) -> None:
        """What must count before the loop gets to ``message``: names handed to another
        member are not this one's to take, even in a snapshot read meanwhile."""
        if message.kind in ("handoff", "grant") and message.to not in ("", self.member):
            until = time.monotonic() + RECENT_GRANT_S
            self.excluded.update(dict.fromkeys(message.keys, (until, message.to)))

    async def start_listening(self) -> None:
        """Start `listen_forever` and wait (within the connection budget) until it
        listens, so that no answer to this member's first requests is missed."""
        self.spawn(self.listen_forever(), f"pgleaderlock-listen:{self.group}")
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(self.settings.config.connect_budget_s or 30.0):
                await self.listening.wait()

    async def announce(self, message: Message) -> None:
        """``notify``, for news that nobody's safety depends on: a failure is logged."""
        try:
            await self.notify(message)
        except Exception as exc:
            log.warning("notify_failed", kind=message.kind, error=repr(exc), **self._fields)

    # ------------------------------------------------------------------ the ring watch

    async def watch_forever(self) -> None:
        """Wait on the server for the next member's lock, around the ring of members;
        when it is granted, that member is gone: tell the loop (which tells the group)."""
        slot = self.slot("watch")
        try:
            while True:
                await self._watch_once(slot)
        finally:
            await slot.close()

    async def _watch_once(self, slot: SessionSlot) -> None:
        ring = sorted(self.members | {self.member})
        successor = ring[(ring.index(self.member) + 1) % len(ring)]
        if successor == self.member:
            await slot.close()  # alone: nobody to watch
            await asyncio.sleep(WATCH_WAIT_S)
            return
        key = member_key(self.group, successor)
        if key != self._watched:
            # A wait on the server may outlive the call that started it (see
            # BaseSession.wait_lock): a new successor gets a new session.
            await slot.close()
            self._watched = key
        try:
            session = slot.session or await self.open_session(slot)
            if not can(session, WaitingSession):
                await asyncio.sleep(WATCH_WAIT_S)
                return
            wait = _wait(session, key)
            bound = WATCH_WAIT_S + self.settings.config.command_timeout_s
            if await self.bounded(slot, wait, bound):
                await self.bounded(slot, _unlock(session, key))
                log.info("member_died", dead=successor, **self._fields)
                self.members = self.members - {successor}
                self.events.put_nowait(MemberGone(successor, seen_here=True))
        except Exception as exc:
            log.warning("watch_failed", error=repr(exc), **self._fields)
            await slot.close()
            await asyncio.sleep(WATCH_WAIT_S)

    # ------------------------------------------------------------------ for the modes

    @abc.abstractmethod
    async def _open(self) -> None:
        """Open the sessions, take the member's place in the group."""

    @abc.abstractmethod
    async def _close(self) -> None:
        """Stop the workers, release every name, close the sessions."""

    @abc.abstractmethod
    def _held(self) -> set[Key]:
        """The keys this member leads now."""

    @abc.abstractmethod
    def _to_take(self, view: balance.View) -> list[Key]:
        """The free names this member should take now."""

    @abc.abstractmethod
    async def _take(self, keys: list[Key], *, handoff: bool) -> list[Key]:
        """Take ``keys`` (free, or granted to this member); return those now led here
        (with dedicated sessions: none known yet, the locks compete)."""

    @abc.abstractmethod
    async def _give(self, keys: list[Key], to: str) -> int:
        """Hand ``keys`` to member ``to``; return how many were handed over."""

    @abc.abstractmethod
    async def _remove(self, name: str) -> None:
        """Stop competing for ``name`` and release it at once."""

    @abc.abstractmethod
    async def _give_away(self, name: str) -> None:
        """Release ``name``, whose worker crashed too often, for another member."""

    async def _rejoined(self) -> None:  # noqa: B027 - optional
        """The member lock leads again, before the group is told (default: nothing)."""

    def _pending(self) -> bool:
        """Something waits for a later tick (default: nothing)."""
        return False

    async def _standby(self, view: balance.View) -> bool:
        """Decide, from ``view``, which names this member stands by for (default:
        nothing to do); True if that is not settled yet."""
        return False

    async def _drain(self) -> None:  # noqa: B027 - optional
        """A graceful stop begins: let the workers finish their current unit (default:
        nothing; the mode that holds names itself drains them)."""

    async def _on_event(self, event: GroupEvent) -> None:  # noqa: B027 - optional
        """Mode-specific events (default: none)."""


async def _wait(session: Any, key: Key) -> bool:
    granted: bool = await session.wait_lock(key[0], key[1], WATCH_WAIT_S)
    return granted


async def _unlock(session: Any, key: Key) -> None:
    await session.unlock(*key)


def group_session(session: object) -> GroupSession:
    """``session``, which must be able to serve a group.

    Raises:
        ConfigurationError: its backend has no ``GroupSession`` capability.
    """
    if not can(session, GroupSession):
        raise ConfigurationError(
            f"{type(session).__name__} sessions cannot serve a Coordinator "
            "(no GroupSession capability)"
        )
    return cast(GroupSession, session)


async def _notify(session: GroupSession, *, channel: str, payload: str) -> None:
    await session.notify(channel, payload)
