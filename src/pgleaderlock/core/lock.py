"""`LeaderLock`: the public API.

A lock is put together here from its parts: its settings (``lock_config``), the machine
that decides ([`pgleaderlock.core.machine`][]), the slot that holds its session
(``core.slot``), the runner whose lifecycle task performs the machine's effects and is
the only code that touches the session (``core.runner``), and its hooks. The public
coroutines hand requests to the machine and wake the task; a request may also cut short
the database call in flight, if the machine's effect allows it.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import itertools
import os
import socket
import time
from collections.abc import Awaitable, Callable, Mapping
from typing import Any, Self, TypeVar, Unpack, cast

import pluggy

from ._logging import get_logger
from .config import (
    FollowerMode,
    LockConfig,
    default_application_name,
    lock_config,
    session_settings,
)
from .errors import (
    ConfigurationError,
    ConnectionError,
    HandOverError,
    ShutdownError,
    sqlstate,
)
from .fencing import Fencing, unbound
from .hooks import On, emit, leadership_ended, new_plugin_manager
from .keyring import Keyring
from .keys import check_key, check_name, key_to_oid, lock_keys
from .leader import (
    CHANNEL,
    LeaderInfo,
    LeaderReader,
    Participant,
    ParticipantTable,
    Target,
    short_session,
)
from .machine import Machine, Request
from .models import (
    Callback,
    ErrorCallback,
    Event,
    LeaderChangedCallback,
    LockState,
    LockStatistics,
    StateChangeCallback,
)
from .options import DeprecatedOptions, LockOptions, check_options, merge_deprecated
from .participants import NOTIFY_ONLY
from .retry import RetryStrategy, check_retry_strategy, default_retry_strategy
from .runner import Runner
from .session import Backend, ConnectOptions, QuerySession, SessionFactory
from .slot import SessionSlot, connection_target
from .watch import LeaderWatch, Subscription, watch_for

__all__ = ["LeaderLock", "lock_settings", "run_on_session"]

log = get_logger()

T = TypeVar("T")

_EXIT_TIMEOUT_S = 10.0

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


class LeaderLock(Fencing):
    """Leader election on one PostgreSQL session-level advisory lock.

    One `LeaderLock` owns one lifecycle task and one dedicated database session (never
    from a pool). Several processes create a `LeaderLock` with the same keys; at most
    one of them is [`LEADER`][pgleaderlock.LockState.LEADER] at any moment. Its
    [`state`][pgleaderlock.LeaderLock.state] is one of [`LockState`][pgleaderlock.LockState];
    [`statistics()`][pgleaderlock.LeaderLock.statistics] counts what happened so far.

    Args:
        dsn: PostgreSQL connection string (URL or key=value), or an object a backend
            accepts (a SQLAlchemy ``AsyncEngine``). May be ``None`` when ``connect_fn``
            is given. A ``postgresql+DRIVER://`` scheme selects a backend.
        key1: first advisory lock key, a signed 32-bit integer.
        key2: second advisory lock key, a signed 32-bit integer.
        retry_strategy: delay between acquisition attempts and reconnections;
            default [`ExponentialBackoff(error_max_s=2.0)`][pgleaderlock.ExponentialBackoff]
            (waits for a taken lock grow to 30 s; after a connection error the next
            attempt is at most 2 s away, so a promoted primary is found quickly).
            Returning `None` stops the lock.
        health_interval_s: seconds between health probes while LEADER.
        reconnect_grace_s: flap damping: how long to silently reconnect and re-acquire
            after the session fails, before reporting
            [`on_lost`][pgleaderlock.LeaderLock.on_lost]. `None` disables it.
        auto_reacquire: go back to FOLLOWER after loss or
            [`step_down()`][pgleaderlock.LeaderLock.step_down]; if False the lock stops
            instead.
        shutdown_event: an external event; setting it has the effect of
            [`shutdown()`][pgleaderlock.LeaderLock.shutdown].
        connect_fn: a custom factory returning a [`LockSession`][pgleaderlock.LockSession]
            or a raw driver connection (psycopg ``AsyncConnection``); overrides ``dsn``.
        name: a label for logs and ``application_name`` (set by
            [`from_name`][pgleaderlock.LeaderLock.from_name]).
        options: everything beyond the specification's arguments, in groups:
            [`LockOptions`][pgleaderlock.LockOptions] of
            [`Timing`][pgleaderlock.Timing] (probe, connect and command timeouts,
            ``tcp_user_timeout_s``, the lease, ``drain_s``, ``escalate_after_s``),
            [`Fencing`][pgleaderlock.Fencing] (terms, their table, ``acquire_delay_s``,
            the grace), [`Participation`][pgleaderlock.Participation] (identity,
            metadata, priority, eligibility, hand-over, the leader watch),
            [`Session`][pgleaderlock.Session] (backend, ``application_name``, follower
            mode, retrying refusals), ``trusted_roles`` and ``load_plugins``. Default:
            ``LockOptions()``. See [Configuration](../configuration.md).
        **deprecated: the flat keywords of 0.1 (``lease_s=``, ``fencing=``, ...), each
            with a ``DeprecationWarning`` that names its new spelling; removed in 0.3.
            Giving a setting both ways is a ``ConfigurationError``.

    Raises:
        ConfigurationError: for keys outside the signed 32-bit range, non-positive
            intervals, timings that break the partition bound or the lease, a
            malformed DSN.
        BackendUnavailableError: for an unknown backend or a missing driver.
    """

    def __init__(
        self,
        dsn: str | Any | None,
        key1: int,
        key2: int,
        *,
        retry_strategy: RetryStrategy | None = None,
        health_interval_s: float = 5.0,
        reconnect_grace_s: float | None = None,
        auto_reacquire: bool = True,
        shutdown_event: asyncio.Event | None = None,
        connect_fn: SessionFactory | None = None,
        name: str | None = None,
        options: LockOptions | None = None,
        **deprecated: Unpack[DeprecatedOptions],
    ) -> None:
        self._key1 = check_key("key1", key1)
        self._key2 = check_key("key2", key2)
        self._name = None if name is None else check_name(name, "name")
        if deprecated:
            options = merge_deprecated(options, deprecated, owner=type(self).__name__)
        self._options = opts = check_options(options)
        self._config = lock_config(
            opts,
            health_interval_s=health_interval_s,
            reconnect_grace_s=reconnect_grace_s,
            auto_reacquire=auto_reacquire,
        )
        check_retry_strategy(retry_strategy)
        self._retry: RetryStrategy = retry_strategy or default_retry_strategy()
        self._external_stop = shutdown_event
        self._connect_options = ConnectOptions(
            application_name=opts.session.application_name or default_application_name(self.label),
            connect_timeout_s=self._config.connect_timeout_s,
            server_settings=session_settings(self._config),
            lease_s=self._config.lease_s,
            claim_s=self._config.claim_s,
        )
        self._backend: Backend | None
        self._backend, driver_dsn, self._config = connection_target(
            opts.session.backend, dsn, connect_fn, self._config
        )

        self.plugins: pluggy.PluginManager = new_plugin_manager(load_entry_points=opts.load_plugins)
        """This lock's plugin manager: ``lock.plugins.register(plugin)``."""

        self._machine = Machine(self._config, self._retry)
        fields: dict[str, Any] = {"lock": self.label, "key1": self._key1, "key2": self._key2}
        self._log_fields = fields
        self._slot = SessionSlot(
            backend=self._backend,
            dsn=driver_dsn,
            options=self._connect_options,
            connect_fn=connect_fn,
            log=log,
            fields=fields,
        )
        self._runner = Runner(self._machine, self._slot, self._emit, self._keyring(), fields)
        self._runner.leaving = functools.partial(leadership_ended, self.plugins, fields)

        # Who leads (see core.leader and core.watch).
        part = opts.participation
        self._metadata_json = part.metadata_json
        self._metadata = part.metadata
        self._identity = part.identity or default_identity()
        # Only a lock with something to publish writes a participant row (one statement
        # per new session); every leader announces itself with NOTIFY.
        self._priority = part.priority
        self._handover_delay_s = part.handover_delay_s
        self._publishes = part.publishes
        self._considering: asyncio.Task[None] | None = None
        self._announced = False  # the grant's statement announced this leadership
        self._eligible = part.eligible
        self._participants = ParticipantTable(part.table, part.schema, self._config.trusted_roles)
        self._target = Target(self._backend, driver_dsn, connect_fn, opts.timing.connect_timeout_s)
        self._watch_interval_s = (
            self._config.health_interval_s
            if part.watch_interval_s is None
            else part.watch_interval_s
        )
        self._published = False  # this session's participant row was written
        self._publish_warned = False
        self._watch: LeaderWatch | None = None
        self._subscription: Subscription | None = None
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
    def _reservation_s(self) -> float:
        """How long a reservation counts at most, after it was written (the leader's
        choice when it writes one, and a reader's cap on any it finds)."""
        return max(2.0, self._config.command_timeout_s)

    def _keyring(self) -> tuple[int, int] | Keyring:
        """Which lock the session takes (a [`Semaphore`][pgleaderlock.Semaphore]
        chooses among its slots)."""
        return self.keys

    @classmethod
    def from_name(
        cls,
        name: str,
        dsn: str | Any | None = None,
        *,
        retry_strategy: RetryStrategy | None = None,
        health_interval_s: float = 5.0,
        reconnect_grace_s: float | None = None,
        auto_reacquire: bool = True,
        shutdown_event: asyncio.Event | None = None,
        connect_fn: SessionFactory | None = None,
        options: LockOptions | None = None,
        **deprecated: Unpack[DeprecatedOptions],
    ) -> Self:
        """A lock whose keys are derived from ``name`` by
        [`lock_keys`][pgleaderlock.lock_keys].

        Args:
            name: the lock's name; the same name gives the same keys in every process
                (and in SQL).
            dsn: as for the constructor.
            retry_strategy: as for the constructor.
            health_interval_s: as for the constructor.
            reconnect_grace_s: as for the constructor.
            auto_reacquire: as for the constructor.
            shutdown_event: as for the constructor.
            connect_fn: as for the constructor.
            options: as for the constructor ([`LockOptions`][pgleaderlock.LockOptions]).
            **deprecated: as for the constructor: the flat keywords of 0.1, with a
                ``DeprecationWarning``.
        """
        if deprecated:
            options = merge_deprecated(options, deprecated, owner=f"{cls.__name__}.from_name")
        key1, key2 = lock_keys(name)
        return cls(
            dsn,
            key1,
            key2,
            retry_strategy=retry_strategy,
            health_interval_s=health_interval_s,
            reconnect_grace_s=reconnect_grace_s,
            auto_reacquire=auto_reacquire,
            shutdown_event=shutdown_event,
            connect_fn=connect_fn,
            name=name,
            options=options,
        )

    @property
    def options(self) -> LockOptions:
        """The [`LockOptions`][pgleaderlock.LockOptions] this lock was made with (old
        keywords applied)."""
        return self._options

    # ------------------------------------------------------------------ properties

    @property
    def state(self) -> LockState:
        """The current state."""
        return self._machine.state

    @property
    def is_leader(self) -> bool:
        """True while LEADER. False during RECONNECTING: the lock is not held then."""
        return self._machine.state is LockState.LEADER

    @property
    def draining(self) -> bool:
        """True while a graceful stop lets leader work finish its current unit
        (``drain_s``): the lock is still LEADER, and releases the lock once the
        [`on_draining`][pgleaderlock.LeaderLock.on_draining] callbacks have returned, or
        ``drain_s`` has passed. Leader work checks it between units of work."""
        return self._machine.draining

    @property
    def lease_s(self) -> float:
        """The lease: how long the server keeps the lock of a leader whose session shows
        no life (see the ``lease_s`` argument)."""
        return self._config.lease_s

    @property
    def keys(self) -> tuple[int, int]:
        """``(key1, key2)``."""
        return self._key1, self._key2

    @property
    def name(self) -> str | None:
        """The lock's name, if it was given one."""
        return self._name

    @property
    def label(self) -> str:
        """How logs, metrics and status name this lock: its name, else ``"key1,key2"``."""
        return self._name if self._name is not None else f"{self._key1},{self._key2}"

    @property
    def backend(self) -> Backend | None:
        """The driver [`Backend`][pgleaderlock.Backend] that opens this lock's sessions
        (`None` with `connect_fn`), resolved once, in the constructor."""
        return self._backend

    @property
    def application_name(self) -> str:
        """The ``application_name`` of this lock's sessions."""
        return self._connect_options.application_name

    @property
    def connect_options(self) -> ConnectOptions:
        """What every session of this lock is opened with (``application_name``, the
        partition-bound server settings). A ``connect_fn`` should apply them too."""
        return self._connect_options

    @property
    def retry_strategy(self) -> RetryStrategy:
        """The strategy asked for every delay (acquisition and reconnection)."""
        return self._retry

    @property
    def follower_mode(self) -> FollowerMode:
        """``"wait"`` or ``"poll"``."""
        return self._config.follower_mode

    @property
    def leader_since(self) -> float | None:
        """``time.time()`` when the current leadership began, or None when not LEADER."""
        since = self._machine.leader_since
        return None if since is None else time.time() - (time.monotonic() - since)

    @property
    def backend_pid(self) -> int | None:
        """The server pid of the current session, if any."""
        return self._slot.backend_pid

    @property
    def stop_error(self) -> Exception | None:
        """The error that stopped the lock for good in its last run (one that retrying
        cannot mend, e.g. [`ServerRefusedError`][pgleaderlock.ServerRefusedError]), or
        ``None``: what [`wait_for_leadership`][pgleaderlock.LeaderLock.wait_for_leadership]
        raises, for status pages and readiness checks."""
        return self._machine.fatal_error

    @property
    def identity(self) -> str:
        """This lock's identity among the replicas (``identity=``)."""
        return self._identity

    @property
    def metadata(self) -> Mapping[str, Any] | None:
        """The document this lock publishes while it leads (``metadata=``)."""
        return self._metadata

    @property
    def priority(self) -> int | None:
        """This lock's priority (``priority=``), or ``None``."""
        return self._priority

    @property
    def eligible(self) -> bool:
        """``False`` for an observer, which never takes the lock."""
        return self._eligible

    def statistics(self) -> LockStatistics:
        """A snapshot of this lock's state and counters (cheap; no I/O).

        Returns:
            A frozen [`LockStatistics`][pgleaderlock.LockStatistics]; the counters cover
                the lock's whole life.
        """
        stats = self._machine.statistics(
            leader_since=self.leader_since, backend_pid=self.backend_pid
        )
        machine, now = self._machine, time.monotonic()
        due, offset = machine.due, time.time() - now  # monotonic + offset = wall clock
        failing, confirmed = machine.failing_since, machine.confirmed_at
        return dataclasses.replace(
            stats,
            stalled_s=0.0 if due is None or not self._runner.running else max(0.0, now - due),
            failing_since=None if failing is None else failing + offset,
            confirmed_at=None if confirmed is None else confirmed + offset,
        )

    def __repr__(self) -> str:
        label = f"name={self._name!r} " if self._name is not None else ""
        return f"<LeaderLock {label}keys=({self._key1}, {self._key2}) state={self.state.value}>"

    # ------------------------------------------------------------------ callbacks

    on_acquired = On[Callback](Event.ACQUIRED)
    """Register a callback for leadership acquired (decorator)."""
    on_released = On[Callback](Event.RELEASED)
    """Register a callback for leadership released voluntarily (decorator)."""
    on_lost = On[Callback](Event.LOST)
    """Register a callback for leadership lost involuntarily (decorator)."""
    on_acquire_failed = On[Callback](Event.ACQUIRE_FAILED)
    """Register a callback for an attempt that found the lock held elsewhere."""
    on_state_change = On[StateChangeCallback](Event.STATE_CHANGE)
    """Register a callback called with ``(from_state, to_state)`` on every change."""
    on_error = On[ErrorCallback](Event.ERROR)
    """Register a callback for database errors and exceptions raised by callbacks."""
    on_stopped = On[Callback](Event.STOPPED)
    """Register a callback for the lock reaching STOPPED (decorator)."""
    on_draining = On[Callback](Event.DRAINING)
    """Register a callback for the start of a graceful stop's drain (``drain_s`` > 0):
    finish the current unit of leader work and return. These callbacks run beside the
    lifecycle task (which keeps probing); the lock is released once they have all
    returned, or after ``drain_s`` (they are cancelled then)."""

    on_leader_changed = On[LeaderChangedCallback](Event.LEADER_CHANGED)
    """Register a callback called with the new [`LeaderInfo`][pgleaderlock.LeaderInfo]
    (``None``: nobody leads) whenever who leads changes, on every replica (followers
    and observers too), and once with the leader first seen after ``start()``. Register
    it before ``start()``. The callbacks run on the process's shared leader watch (see
    [Who leads](../guides/who-leads.md)), one at a time: keep them short."""

    async def _emit(self, event: Event, data: dict[str, Any]) -> None:
        await emit(self.plugins, event, {"lock": self, **data}, self._callback_failed)

    def _callback_failed(self, name: str, event: Event, exc: Exception) -> None:
        log.error("callback_failed", exc=exc, callback=name, on=event.value,
                  error=repr(exc), **self._log_fields)  # fmt: skip

    # ------------------------------------------------------------------ who leads

    async def leader(self) -> LeaderInfo | None:
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

    async def participants(self) -> list[Participant]:
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

    async def _read(self, fn: Callable[[LeaderReader], Awaitable[T]]) -> T:
        config = self._config
        async with asyncio.timeout(
            (config.connect_budget_s or config.connect_timeout_s) + config.command_timeout_s
        ):
            async with short_session(self._target, "pgleaderlock:leader") as session:
                return await fn(LeaderReader(session, self._participants, self.label))

    def _row(self, eligible: bool) -> tuple[object, ...]:
        return (
            self._key1, self._key2, self._identity, self._name, self._priority, eligible,
            self._metadata_json, self._priority is not None, CHANNEL,
            f"{self._key1},{self._key2}",
        )  # fmt: skip

    async def _publish(self) -> None:
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

    async def _announce(self, slot: SessionSlot) -> None:
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

    async def hand_over(self, to: str, timeout_s: float | None = None) -> None:
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
            HandOverError: this lock does not lead, published no row, or ``to`` is
                not waiting for the lock now as a candidate of a trusted role.
        """
        if not self.is_leader:
            raise HandOverError(f"{self.label}: not leading, nothing to hand over")
        if to == self._identity:
            return
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
            reserved = await run_on_session(self, reserve, config.command_timeout_s)
        except ConnectionError as exc:
            raise HandOverError(f"{self.label}: lost the lock before handing it over") from exc
        if not reserved:
            raise HandOverError(
                f"{self.label}: {to!r} is not waiting for the lock (as a candidate of a "
                "trusted role)"
            )
        log.info("handing_over", to=to, **self._log_fields)
        await self.step_down(timeout_s)

    async def _admit(self, slot: SessionSlot) -> bool:
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

    def _poked(self) -> None:
        """The watch heard of this lock's keys (or ticked): with a priority, while
        leading, look (after ``handover_delay_s``) whether to hand over."""
        if self._priority is None or not self.is_leader:
            return
        if self._considering is not None and not self._considering.done():
            return
        self._considering = asyncio.get_running_loop().create_task(
            self._consider(), name=f"pgleaderlock-priority-{self._key1}-{self._key2}"
        )

    async def _consider(self) -> None:
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

    def _wants_watch(self) -> bool:
        hook = getattr(self.plugins.hook, Event.LEADER_CHANGED.hook)
        return not self._eligible or self._priority is not None or bool(hook.get_hookimpls())

    def _start_watch(self) -> None:
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

    async def _stop_watch(self) -> None:
        considering, self._considering = self._considering, None
        if considering is not None and considering is not asyncio.current_task():
            considering.cancel()
            await asyncio.gather(considering, return_exceptions=True)
        watch, self._watch = self._watch, None
        sub, self._subscription = self._subscription, None
        if watch is not None and sub is not None:
            await watch.unsubscribe(sub)

    async def _leader_changed(self, info: LeaderInfo | None) -> None:
        await self._emit(Event.LEADER_CHANGED, {"leader": info})

    # ------------------------------------------------------------------ lifecycle API

    async def start(self) -> None:
        """Start the lifecycle task: STOPPED -> FOLLOWER. Idempotent.

        Returns once the task has made the Start transition; acquisition goes on in the
        background (see [`wait_for_leadership`][pgleaderlock.LeaderLock.wait_for_leadership]).
        """
        self._start_watch()
        if not self._eligible:
            return  # an observer: no lifecycle task, no lock session
        name = f"pgleaderlock-{self._key1}-{self._key2}"
        with unbound(self):  # started from leader work (a give-away): not under its term
            started = self._runner.start(name, self._external_stop)
        await asyncio.shield(started)

    async def shutdown(self, timeout_s: float | None = None) -> None:
        """Release the lock (if held), close the session and stop the task. Idempotent.

        Args:
            timeout_s: how long to wait; ``None`` waits for the orderly stop, which every
                database call bounds by its own timeout.

        Raises:
            ShutdownError: the task did not stop within ``timeout_s``; it was then
                cancelled and the session closed (which frees the lock on the server).
        """
        task = self._runner.task
        if task is None or task.done():
            await self._stop_watch()
            return
        self._runner.request(Request.STOP)
        if task is asyncio.current_task():
            return  # called from a callback: the task stops once the callback returns
        try:
            await self._stop_when_stopped(task, timeout_s)
        finally:
            await self._stop_watch()

    async def _stop_when_stopped(self, task: asyncio.Task[None], timeout_s: float | None) -> None:
        try:
            async with asyncio.timeout(timeout_s):
                await asyncio.shield(task)
        except TimeoutError:
            self._runner.abort()  # no driver may spend time cancelling on the server
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
            raise ShutdownError(
                f"shutdown did not complete within {timeout_s} s; the task was cancelled "
                "and the connection closed"
            ) from None

    async def step_down(self, timeout_s: float | None = None) -> None:
        """Voluntarily release leadership (LEADER -> RELEASING -> FOLLOWER or STOPPED).

        Returns at once when not LEADER. Otherwise waits until the release completes;
        if that takes longer than ``timeout_s``, the session is closed instead (which
        frees the lock on the server). With ``auto_reacquire=True`` the lock goes back
        to FOLLOWER and waits one retry delay before its next attempt, so that others
        can take over.
        """
        task = self._runner.task
        if task is None or task.done():
            return
        own_task = task is asyncio.current_task()
        if self._machine.requested(Request.STOP):  # shutdown wins: return once the task has ended
            if not own_task:
                await asyncio.wait({task}, timeout=timeout_s)
            return
        if not self._runner.request(Request.RELEASE):
            return  # not leading: nothing to release
        done = self._runner.release_done()
        if own_task:
            return
        try:
            async with asyncio.timeout(timeout_s):
                await asyncio.shield(done)
        except TimeoutError:
            log.warning("step_down_timeout", timeout_s=timeout_s, **self._log_fields)
            self._runner.request(Request.FORCE)
            await asyncio.shield(done)
        if self._machine.requested(Request.STOP):
            await asyncio.gather(asyncio.shield(task), return_exceptions=True)

    async def wait_for_leadership(self, timeout_s: float | None = None) -> bool:
        """Wait until this lock is LEADER (and its
        [`on_acquired`][pgleaderlock.LeaderLock.on_acquired] callbacks have run).

        Returns:
            True once LEADER; False if ``timeout_s`` elapsed first, or if the lock
                is stopped (or stops while waiting), since it cannot lead then.

        Raises:
            PgLeaderLockError: the lock stopped on an error that retrying cannot mend
                (a [`ServerRefusedError`][pgleaderlock.ServerRefusedError], a
                [`SessionNotDedicatedError`][pgleaderlock.SessionNotDedicatedError], a
                [`ConfigurationError`][pgleaderlock.ConfigurationError]), with the
                driver's error as its cause: waiting longer would never help.
        """
        try:
            async with asyncio.timeout(timeout_s):
                leader = await self._runner.wait_leader()
        except TimeoutError:
            return False
        fatal = self._machine.fatal_error
        if not leader and fatal is not None and not self._runner.running:
            raise fatal
        return leader

    async def __aenter__(self) -> Self:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        if exc and exc[0] is not None:
            try:
                await self.shutdown(timeout_s=_EXIT_TIMEOUT_S)
            except ShutdownError as err:
                log.error("shutdown_failed", error=str(err), **self._log_fields)
        else:
            await self.shutdown()


async def run_on_session(
    lock: LeaderLock, fn: Callable[[SessionSlot], Awaitable[T]], timeout_s: float
) -> T:
    """For the layers built on a lock (a Coordinator's shared sessions hold many locks
    on one lock's session): ``fn(slot)`` on ``lock``'s session (``slot.session``) while
    it leads, as a call its machine schedules between probes, bounded by ``timeout_s``
    like the lock's own calls. The slot also serves the session's checked tables
    (``SessionSlot.with_table``) and its probe choice (``SessionSlot.granted``). A call
    that fails (or times out) loses the leadership, as a failed probe does: the lock's
    state changes before the next call can run.

    Raises:
        ConnectionError: the lock does not lead, or lost its session before the call
            ran; a timeout; or what ``fn`` raised, as ``call_failure`` reports it.
    """
    return await lock._runner.on_session(fn, timeout_s)


def lock_settings(lock: LeaderLock) -> LockConfig:
    """For the layers built on a lock: its validated settings (timeouts, the fencing
    table), read-only."""
    return lock._config
