"""`LeaderLock`: the public API.

A lock is put together here from its parts: its settings (``lock_config``), the machine
that decides ([`pgleaderlock.core.machine`][]), the slot that holds its session
(``core.slot``), the runner whose lifecycle task performs the machine's effects and is
the only code that touches the session (``core.runner``), its hooks, and its part that
publishes and reads who leads (``core.participation``). The public coroutines hand
requests to the machine and wake the task; a request may also cut short the database
call in flight, if the machine's effect allows it.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import time
from collections.abc import Awaitable, Callable, Mapping
from typing import Any, Self, TypeVar, Unpack

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
    ShutdownError,
)
from .fencing import Fencing, unbound
from .hooks import On, emit, leadership_ended, new_plugin_manager
from .keyring import Keyring
from .keys import check_key, check_name, lock_keys
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
from .options import (
    DeprecatedOptions,
    LockArguments,
    LockOptions,
    check_options,
    merge_deprecated,
    without_deprecated,
)
from .participation import Participating
from .retry import RetryStrategy, check_retry_strategy, default_retry_strategy
from .runner import Runner
from .session import Backend, ConnectOptions, SessionFactory
from .slot import SessionSlot, connection_target

__all__ = ["LeaderLock", "lock_settings", "run_on_session"]

log = get_logger()

T = TypeVar("T")

_EXIT_TIMEOUT_S = 10.0


class LeaderLock(Fencing, Participating):
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
            default `ExponentialBackoff(error_max_s=2.0, down_s=0.1)`
            ([`ExponentialBackoff`][pgleaderlock.ExponentialBackoff]: waits for a taken
            lock grow to 30 s; after a connection error the next attempt is at most 2 s
            away, and 0.1 s while every host refuses or closes the connection at once,
            so a promoted primary is found quickly).
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

        self._setup_participation(
            opts.participation, driver_dsn, connect_fn, opts.timing.connect_timeout_s
        )

    def _keyring(self) -> tuple[int, int] | Keyring:
        """Which lock the session takes (a [`Semaphore`][pgleaderlock.Semaphore]
        chooses among its slots)."""
        return self.keys

    @classmethod
    def from_name(
        cls, name: str, dsn: str | Any | None = None, **arguments: Unpack[LockArguments]
    ) -> Self:
        """A lock whose keys are derived from ``name`` by
        [`lock_keys`][pgleaderlock.lock_keys].

        Args:
            name: the lock's name; the same name gives the same keys in every process
                (and in SQL).
            dsn: as for the constructor.
            **arguments: the constructor's keyword arguments (``retry_strategy``,
                ``health_interval_s``, ``reconnect_grace_s``, ``auto_reacquire``,
                ``shutdown_event``, ``connect_fn``, ``options``, and the flat keywords
                of 0.1, with a ``DeprecationWarning``), with its defaults.
        """
        arguments = without_deprecated(arguments, owner=f"{cls.__name__}.from_name")
        return cls(dsn, *lock_keys(name), name=name, **arguments)

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
