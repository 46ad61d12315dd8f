"""The part of a Coordinator that both session modes share: the member's event loop,
composed of its parts, and the workers.

One task per member runs the loop: it waits for an event (a notification from the
group, a tick, a lock's change, a request of the API) and acts, one event at a time, so
that the member's decisions never race each other. The loop's parts, each a class of
its own:

- `Membership` (`membership.py`): the member lock (the member's place in the group,
  and the session its statements run on) and the group's view read on it;
- `Mailbox` (`mailbox.py`): the messages sent to the group and received from it;
- `Balancer` (`balancer.py`): the tick, and the requests and grants that keep the
  group even;
- `RingWatch` (`watch.py`): the next member's lock, watched on the server.

What differs between the session modes (how names are taken and given back) is a
subclass's: the balancer's `Names` (`balancer.py`), and the hooks at the end of
`Engine`.
"""

from __future__ import annotations

import abc
import asyncio
import contextlib
import time
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any

from ..lowlevel import LockState, get_logger, is_permanent
from . import balance
from .balancer import Balancer
from .events import Broken, GroupEvent, Look, MemberGone, NameEvent, Received, Stop, looks
from .mailbox import Mailbox
from .membership import GroupView, Membership, Wiring
from .protocol import Key, Message, Role, name_keys
from .session import GroupSession, Sessions
from .settings import Settings
from .watch import RingWatch
from .workers import WorkerContext, WorkerFunction, Workers

__all__ = ["Engine", "GroupView", "Settings"]

log = get_logger("pgleaderlock.coordination")

OUTSIDE_TICK_S = 2.0
"""How often a member looks at the group while some of its names are held outside the
group (a plain lock): their release is announced to nobody."""
GONE_LOOK_MARGIN_S = 1.0
"""After a member is gone, a member looks at the group at the balance interval for the
claim bound (``LockConfig.claim_s``) twice over and this margin: a dead member's name
granted to a standby that is frozen is freed by the server when that standby does not
claim it in time, and nobody is told; the next look finds it free and waits for it."""


class Engine(abc.ABC):
    """The member's loop; see the module docstring."""

    MEMBER_ROLE: Role = "util"
    """The role of the member lock's session."""
    GONE_LOOK_DELAY_S = 0.0
    """After a member is gone and this one took its share of the names, how long it
    waits before it looks at the group (0: at once)."""

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.group, self.member = settings.group, settings.member
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
        self._fields: dict[str, Any] = {
            "lock": f"group:{settings.group}",
            "member": settings.member,
        }
        post, fields = self.events.put_nowait, self._fields
        sessions = Sessions(settings, fields)
        self.membership = Membership(
            settings, self.MEMBER_ROLE, self.names, post, self._member_lost, fields
        )
        wiring = Wiring(self.membership, sessions, post, fields)
        self.mailbox = Mailbox(wiring, self.note, self._missed)
        self.balancer = Balancer(self, self.names, wiring, self.mailbox)
        self.watch = RingWatch(wiring)
        self._task: asyncio.Task[None] | None = None
        self._started: asyncio.Future[None] | None = None
        self._helpers: list[asyncio.Task[None]] = []
        self._stop_event = asyncio.Event()
        self._connecting = False
        self._look_until = 0.0  # a member is gone: look often until then (monotonic)
        self.error: BaseException | None = None

    # ------------------------------------------------------------------ for the API

    @property
    def owned(self) -> frozenset[str]:
        """The names this member leads now."""
        return frozenset(self.names[k] for k in self.held() if k in self.names)

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
            self.mailbox.listening.clear()
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

    # ------------------------------------------------------------------ joining, leaving

    async def _join(self) -> None:
        """Start the member lock and wait until it leads, then check the session and the
        tables on it (``start()`` returns after the connection budget, as a lock's does
        after its first attempt, while this goes on): see `Membership.join`."""
        await self.membership.start()
        budget = self.settings.config.connect_budget_s or 30.0
        started = asyncio.get_running_loop().call_later(budget, self._set_started)
        self._connecting = True  # a shutdown meanwhile cuts the join short
        try:
            await self.membership.join()
        finally:
            self._connecting = False
            started.cancel()

    async def _leave(self, last: Callable[[GroupSession], Awaitable[object]] | None) -> None:
        """Leave the group: ``last(session)`` and a "leave" message while the member lock
        leads, then shut the member lock down (the others no longer count this member)."""
        lock = self.membership.lock
        if lock is None:
            return
        if lock.is_leader:
            try:
                if last is not None:
                    await self.membership.call(last)
            except Exception as exc:  # closing the session frees the locks anyway
                log.warning("release_failed", error=repr(exc), **self._fields)
            else:
                await self.mailbox.announce(Message("leave", self.member))
        await lock.shutdown()

    async def start_listening(self) -> None:
        """Start the mailbox's listener and wait (within the connection budget) until it
        listens, so that no answer to this member's first requests is missed."""
        self.spawn(self.mailbox.listen_forever(), f"pgleaderlock-listen:{self.group}")
        await self.mailbox.listening_within(self.settings.config.connect_budget_s or 30.0)

    def start_watching(self) -> None:
        """Start the ring watch."""
        self.spawn(self.watch.watch_forever(), f"pgleaderlock-watch:{self.group}")

    def spawn(self, coro: Coroutine[Any, Any, None], name: str) -> None:
        self._helpers.append(asyncio.get_running_loop().create_task(coro, name=name))

    # ------------------------------------------------------------------ the loop

    async def _main(self) -> None:
        assert self._started is not None
        balancer = self.balancer
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
                    if isinstance(event, MemberGone) and self.GONE_LOOK_DELAY_S:
                        claim = self.settings.config.claim_s
                        self._look_until = time.monotonic() + 2 * claim + GONE_LOOK_MARGIN_S
                        next_tick = min(next_tick, time.monotonic() + self.GONE_LOOK_DELAY_S)
                    elif looks(event):
                        await balancer.tick()
                        wait = self.settings.idle_tick_s
                        if balancer.unsettled:
                            wait = self.settings.balance_interval_s
                        if balancer.outside:  # nothing tells the group when those are freed
                            wait = min(wait, OUTSIDE_TICK_S)
                        if isinstance(event, MemberGone):
                            claim = self.settings.config.claim_s
                            self._look_until = time.monotonic() + 2 * claim + GONE_LOOK_MARGIN_S
                        if time.monotonic() < self._look_until:  # see GONE_LOOK_MARGIN_S
                            wait = min(wait, self.settings.balance_interval_s)
                        next_tick = time.monotonic() + wait
                except Exception as exc:
                    if is_permanent(exc, self.settings.config):
                        raise
                    log.warning("group_event_failed", kind=type(event).__name__,
                                error=repr(exc), **self._fields)  # fmt: skip
                    balancer.unsettled = True
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
                await self.mailbox.announce(Message("join", self.member))
            case Broken(error=error):
                raise error
            case MemberGone(member=member, seen_here=True, told=False):  # seen here, untold
                await self.mailbox.announce(Message("left", self.member, to=member))  # tell all
                await self._on_event(event)
            case _:
                await self._on_event(event)

    async def _on_message(self, message: Message) -> None:
        if message.sender == self.member:
            return
        match message.kind:
            case "request" if message.to == self.member:
                await self.balancer.on_request(message)
            case "grant" if message.to == self.member:
                self.balancer.answered(message.sender)
                await self.take(list(message.keys), handoff=True)
            case "done" if message.to == self.member:
                self.balancer.answered(message.sender)
            case "left":
                self.events.put_nowait(MemberGone(message.to))  # the dead member
            case "join" | "leave" | "released":
                self.events.put_nowait(Look(message.kind))
            case "moved":
                self.events.put_nowait(Look("changed"))

    def note(self, message: Message) -> None:
        """What must count before the loop gets to ``message`` (the mailbox calls it as
        the message arrives): see `Balancer.note`."""
        self.balancer.note(message)

    def _missed(self) -> None:
        """Messages may have been missed (the listening session was lost)."""
        self.balancer.forget_requests()

    # ------------------------------------------------------------------ workers

    def context(self, name: str, term: int | None) -> WorkerContext:
        settings = self.settings
        return WorkerContext(
            name, term, self.member, settings.terms, settings.checkpoints, self.group,
            keys=self.keys.get(name),
        )  # fmt: skip

    def start_worker(self, name: str, term: int | None) -> None:
        fn = self.functions.get(name)
        if fn is not None:
            self.workers.start(name, fn, self.context(name, term))

    # ------------------------------------------------------------------ for the modes

    @abc.abstractmethod
    async def _open(self) -> None:
        """Open the sessions, take the member's place in the group."""

    @abc.abstractmethod
    async def _close(self) -> None:
        """Stop the workers, release every name, close the sessions."""

    @abc.abstractmethod
    def held(self) -> set[Key]:
        """The keys this member leads now."""

    @abc.abstractmethod
    def to_take(self, view: balance.View) -> list[Key]:
        """The free names this member should take now."""

    @abc.abstractmethod
    async def take(self, keys: list[Key], *, handoff: bool) -> list[Key]:
        """Take ``keys`` (free, or granted to this member); return those now led here
        (with dedicated sessions: none known yet, the locks compete)."""

    @abc.abstractmethod
    async def give(self, keys: list[Key], to: str) -> int:
        """Hand ``keys`` to member ``to``; return how many were handed over."""

    @abc.abstractmethod
    async def _remove(self, name: str) -> None:
        """Stop competing for ``name`` and release it at once."""

    @abc.abstractmethod
    async def _give_away(self, name: str) -> None:
        """Release ``name``, whose worker crashed too often, for another member."""

    async def _member_lost(self, state: LockState) -> None:  # noqa: B027 - optional
        """The member lock left LEADER (for ``state``): its session may be gone (default:
        nothing to do; the names do not live on it)."""

    async def _rejoined(self) -> None:  # noqa: B027 - optional
        """The member lock leads again, before the group is told (default: nothing)."""

    def pending(self) -> bool:
        """Something waits for a later tick (default: nothing)."""
        return False

    async def standby(self, view: balance.View) -> bool:
        """Decide, from ``view``, which names this member stands by for (default:
        nothing to do); True if that is not settled yet."""
        return False

    async def _drain(self) -> None:  # noqa: B027 - optional
        """A graceful stop begins: let the workers finish their current unit (default:
        nothing; the mode that holds names itself drains them)."""

    async def _on_event(self, event: GroupEvent) -> None:  # noqa: B027 - optional
        """Mode-specific events (default: none)."""
