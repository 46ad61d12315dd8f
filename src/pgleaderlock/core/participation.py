"""Who leads a [`LeaderLock`][pgleaderlock.LeaderLock], and choosing who leads: the
lock's part that publishes its participant row, announces a new leadership, honours and
writes hand-over reservations, hands over to a candidate of a higher priority, and
subscribes to the process's leader watch.

The statements are the participants table's ([`pgleaderlock.core.participants`][]);
the readers are [`pgleaderlock.core.leader`][]'s, the watch is
[`pgleaderlock.core.watch`][]'s. See [Who leads](../guides/who-leads.md) and
[Security](../security.md) for what a row of another role can and cannot do.
"""

from __future__ import annotations

import asyncio
import itertools
import os
import socket
from collections.abc import Awaitable, Callable, Mapping
from typing import Any, Protocol, TypeVar, cast

import pluggy

from ._logging import get_logger
from .config import LockConfig
from .errors import ConfigurationError, ConnectionError, HandOverError, sqlstate
from .keyring import Keyring
from .keys import key_to_oid
from .leader import (
    CHANNEL,
    LeaderInfo,
    LeaderReader,
    Participant,
    ParticipantTable,
    Target,
    short_session,
)
from .machine import Machine
from .models import Event
from .options import Participation
from .participants import NOTIFY_ONLY
from .runner import Runner
from .session import Backend, QuerySession, SessionFactory
from .slot import SessionSlot
from .watch import LeaderWatch, Subscription, watch_for

__all__ = ["Participating", "default_identity"]

log = get_logger()

T = TypeVar("T")

_identities = itertools.count(1)

_CONSIDER_LOOKS = 5
"""How many times a leader with a priority looks for a higher one to queue."""

_STATEMENT_ERRORS = ("42", "22", "23", "0A", "2B", "44")
"""SQLSTATE classes of a statement the server refused (a table changed or gone, a
privilege missing): the lock goes on without what the statement would have done."""


def _statement_error(exc: BaseException) -> bool:
    code = sqlstate(exc.__cause__ if exc.__cause__ is not None else exc)
    return code is not None and code[:2] in _STATEMENT_ERRORS


def default_identity() -> str:
    """``<host>:<pid>:<n>``: unique among the locks of this process."""
    return f"{socket.gethostname()}:{os.getpid()}:{next(_identities)}"


class _Lock(Protocol):
    """What the participation methods use of a [`LeaderLock`][pgleaderlock.LeaderLock]."""

    # the lock's own
    _config: LockConfig
    _machine: Machine
    _runner: Runner
    _slot: SessionSlot
    _backend: Backend | None
    _key1: int
    _key2: int
    _name: str | None
    _log_fields: dict[str, Any]
    plugins: pluggy.PluginManager
    # participation's (Participating)
    _metadata_json: str | None
    _metadata: Mapping[str, Any] | None
    _identity: str
    _priority: int | None
    _handover_delay_s: float
    _publishes: bool
    _considering: asyncio.Task[None] | None
    _announced: bool
    _eligible: bool
    _participants: ParticipantTable
    _target: Target
    _watch_interval_s: float
    _published: bool
    _publish_warned: bool
    _watch: LeaderWatch | None
    _subscription: Subscription | None

    @property
    def label(self) -> str: ...
    @property
    def keys(self) -> tuple[int, int]: ...
    @property
    def is_leader(self) -> bool: ...
    @property
    def _reservation_s(self) -> float: ...
    def _keyring(self) -> tuple[int, int] | Keyring: ...
    async def _emit(self, event: Event, data: dict[str, Any]) -> None: ...
    async def step_down(self, timeout_s: float | None = None) -> None: ...
    async def participants(self) -> list[Participant]: ...
    async def hand_over(self, to: str, timeout_s: float | None = None) -> None: ...
    async def _read(self, fn: Callable[[LeaderReader], Awaitable[T]]) -> T: ...
    def _row(self, eligible: bool) -> tuple[object, ...]: ...
    async def _publish(self) -> None: ...
    async def _announce(self, slot: SessionSlot) -> None: ...
    async def _admit(self, slot: SessionSlot) -> bool: ...
    def _poked(self) -> None: ...
    async def _consider(self) -> None: ...
    def _wants_watch(self) -> bool: ...
    async def _leader_changed(self, info: LeaderInfo | None) -> None: ...


class Participating:
    """The who-leads part of [`LeaderLock`][pgleaderlock.LeaderLock]'s API and its
    participant row (set up by ``_setup_participation`` from the lock's
    [`Participation`][pgleaderlock.Participation] options)."""

    _metadata_json: str | None
    _metadata: Mapping[str, Any] | None
    _identity: str
    _priority: int | None
    _handover_delay_s: float
    _publishes: bool
    _considering: asyncio.Task[None] | None
    _announced: bool
    _eligible: bool
    _participants: ParticipantTable
    _target: Target
    _watch_interval_s: float
    _published: bool
    _publish_warned: bool
    _watch: LeaderWatch | None
    _subscription: Subscription | None

    def _setup_participation(
        self: _Lock,
        part: Participation,
        driver_dsn: Any,
        connect_fn: SessionFactory | None,
        connect_timeout_s: float,
    ) -> None:
        """Who leads (see core.leader and core.watch): the lock's row, its watch."""
        self._metadata_json = part.metadata_json
        self._metadata = part.metadata
        self._identity = part.identity or default_identity()
        # Only a lock with something to publish writes a participant row (one statement
        # per new session); every leader announces itself with NOTIFY.
        self._priority = part.priority
        self._handover_delay_s = part.handover_delay_s
        self._publishes = part.publishes
        self._considering = None
        self._announced = False  # the grant's statement announced this leadership
        self._eligible = part.eligible
        self._participants = ParticipantTable(part.table, part.schema, self._config.trusted_roles)
        self._target = Target(self._backend, driver_dsn, connect_fn, connect_timeout_s)
        self._watch_interval_s = (
            self._config.health_interval_s
            if part.watch_interval_s is None
            else part.watch_interval_s
        )
        self._published = False  # this session's participant row was written
        self._publish_warned = False
        self._watch = None
        self._subscription = None
        if not isinstance(self._keyring(), tuple):
            # A Semaphore: its holders take slot keys, several at once; who leads, as
            # published and announced here, is about one lock's keys.
            if part.metadata is not None or part.priority is not None or not part.eligible:
                raise ConfigurationError(
                    "metadata, priority and eligible are for a LeaderLock, not a Semaphore"
                )
            self._publishes = False
            return
        self._slot.after_open = self._publish
        self._runner.announce = self._announce
        self._runner.admit = self._admit

    @property
    def _reservation_s(self: _Lock) -> float:
        """How long a reservation counts at most, after it was written (the leader's
        choice when it writes one, and a reader's cap on any it finds)."""
        return max(2.0, self._config.command_timeout_s)

    # ------------------------------------------------------------------ who leads

    async def leader(self: _Lock) -> LeaderInfo | None:
        """Who leads this lock now, as the server says (``pg_locks``), with what the
        leader published (``metadata``...) when its row is that very session's.

        From any replica, leader or not (and observers). Read on the process's leader
        watch session when this lock watches (``on_leader_changed``, ``eligible=False``),
        else on a short session of its own.

        Returns:
            The leader, or ``None`` when nobody holds the lock.

        Raises:
            TimeoutError: the server did not answer within the connect and command
                timeouts.
        """
        watch = self._watch
        if watch is not None:
            return await watch.leader(self.keys)
        return await self._read(lambda reader: reader.leader(self.keys))

    async def participants(self: _Lock) -> list[Participant]:
        """Every live lock session of a trusted role (this lock's own, a superuser, or
        one of ``trusted_roles``) that published a row for this lock (candidates and
        observers), and which of them leads or waits; empty when the participants
        table cannot be read. Rows of other roles are never listed (``pgleaderlock
        status`` shows them, marked untrusted); at most
        [`PARTICIPANTS_MAX`][pgleaderlock.core.participants.PARTICIPANTS_MAX]."""
        watch = self._watch
        if watch is not None:
            return await watch.participants(self.keys)
        return await self._read(lambda reader: reader.participants(self.keys))

    async def _read(self: _Lock, fn: Callable[[LeaderReader], Awaitable[T]]) -> T:
        config = self._config
        async with asyncio.timeout(
            (config.connect_budget_s or config.connect_timeout_s) + config.command_timeout_s
        ):
            async with short_session(self._target, "pgleaderlock:leader") as session:
                return await fn(LeaderReader(session, self._participants, self.label))

    def _row(self: _Lock, eligible: bool) -> tuple[object, ...]:
        return (
            self._key1, self._key2, self._identity, self._name, self._priority, eligible,
            self._metadata_json, self._priority is not None, CHANNEL,
            f"{self._key1},{self._key2}",
        )  # fmt: skip

    async def _publish(self: _Lock) -> None:
        """A new session's participant row (``SessionSlot.after_open``): written on
        the lock's own session, before its first lock call. A failure (no privilege
        on the table, another role's table) is logged once: the lock works without
        it, and ``leader()`` then has no metadata."""
        self._published = False
        session = self._slot.session
        if not self._publishes or not isinstance(session, QuerySession):
            return
        try:
            await self._slot.prepare(self._participants)
            await session.query(self._participants.upsert(), self._row(True))
            self._published = True
        except Exception as exc:
            if not self._publish_warned:
                self._publish_warned = True
                log.warning("participant_row_failed", error=str(exc),
                            table=self._participants.shown, **self._log_fields)  # fmt: skip

    async def _announce(self: _Lock, slot: SessionSlot) -> None:
        """The new leader's announcement (``Runner.announce``, before the
        ``on_acquired`` callbacks): its row leads since now, and ``NOTIFY``."""
        session = slot.session
        if not isinstance(session, QuerySession):
            return
        payload = f"{self._key1},{self._key2}"
        announced, self._announced = self._announced, False
        try:
            if announced:
                pass  # done with the grant (``_admit``)
            elif self._published:
                values = (self._key1, self._key2, self._identity, self._machine.term,
                          CHANNEL, payload)  # fmt: skip
                await session.query(self._participants.announce(), values)
            else:
                await session.query(NOTIFY_ONLY, (CHANNEL, payload))
        except Exception as exc:
            log.warning("announce_failed", error=str(exc), **self._log_fields)
        self._poked()  # a candidate of a higher priority may be waiting already

    # ------------------------------------------------------------------ choosing who leads

    async def hand_over(self: _Lock, to: str, timeout_s: float | None = None) -> None:
        """Hand leadership to one chosen waiting replica, by its ``identity``: it leads
        next, and no other candidate announces leadership meanwhile.

        This lock reserves the lock for ``to`` (on its own row in the participants
        table, for at most ``max(2, command_timeout_s)`` seconds) and steps down. A
        candidate that PostgreSQL grants the lock before ``to`` (the first in its
        queue) finds the reservation right after the grant, before it announces
        anything, and lets the lock go again; so the lock passes down the queue to
        ``to``. Every lock that publishes a row (``identity``, ``metadata`` or
        ``priority``) honours reservations; one that does not would take the lock.
        Only a candidate of a trusted role (this lock's own, a superuser, or one of
        ``trusted_roles``) can be the target, and a reservation counts only when the
        session that held the lock wrote it (the table's policies see to that); a
        reader honours it for at most ``max(2, command_timeout_s)`` seconds of its own
        after it was written.

        Args:
            to: the target's ``identity``.
            timeout_s: as for [`step_down`][pgleaderlock.LeaderLock.step_down].

        Raises:
            HandOverError: this lock does not lead, published no row, ``to`` is its
                own identity, or ``to`` is not waiting for the lock now as a candidate of
                a trusted role.
        """
        if not self.is_leader:
            raise HandOverError(f"{self.label}: not leading, nothing to hand over")
        if to == self._identity:
            raise HandOverError(
                f"{self.label}: {to!r} is this lock's own identity, which leads already "
                "(give a waiting replica's identity)"
            )
        if not self._published:
            raise HandOverError(
                f"{self.label}: this lock has no row in {self._participants.shown} (give it "
                "identity=, metadata= or priority=, and the privileges on the table)"
            )
        config = self._config
        oids = (key_to_oid(self._key1), key_to_oid(self._key2))
        values = (self._key1, self._key2, self._identity, to, self._reservation_s,
                  *oids, list(config.trusted_roles))  # fmt: skip
        statement = self._participants.reserve()

        async def reserve(slot: SessionSlot) -> list[tuple[Any, ...]]:
            session = slot.session
            assert isinstance(session, QuerySession)
            return await session.query(statement, values)

        # One statement on the lock's own session (idle between probes): the target
        # must be waiting now, and the reservation is written in the same breath.
        try:
            reserved = await self._runner.on_session(reserve, config.command_timeout_s)
        except ConnectionError as exc:
            raise HandOverError(f"{self.label}: lost the lock before handing it over") from exc
        if not reserved:
            raise HandOverError(
                f"{self.label}: {to!r} is not waiting for the lock (as a candidate of a "
                "trusted role)"
            )
        log.info("handing_over", to=to, **self._log_fields)
        await self.step_down(timeout_s)

    async def _admit(self: _Lock, slot: SessionSlot) -> bool:
        """``Runner.admit``, right after a grant and before the machine hears of it: is
        the lock reserved for another waiting candidate? Then let it go again
        (unannounced) and report a failed attempt. Without fencing, announce the new
        leadership in the same statement (``since``, ``NOTIFY``): one round trip from
        the grant to the notification, and before the lock is LEADER, so that a session
        that ends meanwhile fails the lock call itself, with the server's message."""
        session = slot.session
        if not isinstance(session, QuerySession):
            return True
        keys = (self._key1, self._key2)
        payload = f"{keys[0]},{keys[1]}"
        fenced = self._config.term_table is not None  # announced once the term is bumped
        if not self._published:
            if not fenced:
                await session.query(NOTIFY_ONLY, (CHANNEL, payload))
                self._announced = True
            return True
        values: tuple[object, ...] = (
            *keys, key_to_oid(keys[0]), key_to_oid(keys[1]), self._identity,
            list(self._config.trusted_roles), self._reservation_s,
        )  # fmt: skip
        statement = self._participants.reserved_elsewhere()
        if not fenced:
            statement = self._participants.admit()
            values = (*values, CHANNEL, payload)
        try:
            rows = await session.query(statement, values)
        except Exception as exc:
            if not _statement_error(exc):
                raise  # the session failed: so does the lock call
            log.warning("reservation_unreadable", error=str(exc), **self._log_fields)
            return True
        if not (rows and rows[0][0]):
            self._announced = not fenced
            return True
        log.debug("reserved_for_another", **self._log_fields)  # and let go already
        return False

    def _poked(self: _Lock) -> None:
        """The watch heard of this lock's keys (or ticked): with a priority, while
        leading, look (after ``handover_delay_s``) whether to hand over."""
        if self._priority is None or not self.is_leader:
            return
        if self._considering is not None and not self._considering.done():
            return
        self._considering = asyncio.get_running_loop().create_task(
            self._consider(), name=f"pgleaderlock-priority-{self._key1}-{self._key2}"
        )

    async def _consider(self: _Lock) -> None:
        """Hand over to the waiting candidate of the highest priority above this
        lock's, if there is one (looking a few times while one of a higher priority
        is known but not waiting yet: it is about to queue)."""
        assert self._priority is not None
        for _ in range(_CONSIDER_LOOKS):
            await asyncio.sleep(self._handover_delay_s)
            if not self.is_leader:
                return
            try:
                higher = [
                    p for p in await self.participants()
                    if p.info.trusted and p.eligible and not p.leading
                    and p.info.priority is not None and p.info.priority > self._priority
                ]  # fmt: skip
                ready = [p for p in higher if p.waiting]
                if ready:
                    best = max(ready, key=lambda p: cast(int, p.info.priority))
                    assert best.info.identity is not None
                    await self.hand_over(to=best.info.identity)
                    return
            except Exception as exc:
                log.warning("priority_handover_failed", error=str(exc), **self._log_fields)
                return
            if not higher:
                return

    def _wants_watch(self: _Lock) -> bool:
        hook = getattr(self.plugins.hook, Event.LEADER_CHANGED.hook)
        return not self._eligible or self._priority is not None or bool(hook.get_hookimpls())

    def _start_watch(self: _Lock) -> None:
        if self._watch is not None or not self._wants_watch():
            return
        config = self._config
        watch = watch_for(
            self._target, self._participants, self._watch_interval_s,
            (config.connect_budget_s or config.connect_timeout_s) + config.command_timeout_s,
        )  # fmt: skip
        row = None
        if not self._eligible:
            row = (self._identity, self._name, None, self._metadata_json)
        self._subscription = Subscription(
            self.keys, self._leader_changed, row, self.label, self._poked
        )
        self._watch = watch
        watch.subscribe(self._subscription)

    async def _stop_watch(self: _Lock) -> None:
        considering, self._considering = self._considering, None
        if considering is not None and considering is not asyncio.current_task():
            considering.cancel()
            await asyncio.gather(considering, return_exceptions=True)
        watch, self._watch = self._watch, None
        sub, self._subscription = self._subscription, None
        if watch is not None and sub is not None:
            await watch.unsubscribe(sub)

    async def _leader_changed(self: _Lock, info: LeaderInfo | None) -> None:
        await self._emit(Event.LEADER_CHANGED, {"leader": info})
