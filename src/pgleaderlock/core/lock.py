"""``LeaderLock``: the asyncio lifecycle task that executes the state machine.

The task is the only code that touches the session, the state and the timers (spec
§5.1). It asks the machine (:func:`pgleaderlock.core.machine.step`) what every input
means and performs the returned actions; it never decides a transition itself.

Public coroutines (``shutdown()``, ``step_down()``) only set flags and wake the task.
A stop request may also interrupt an in-flight connect or ``pg_try_advisory_lock``: the
task is cancelled at that await (and only there), after which the session is closed,
because an interrupted lock call may have been granted on the server.
"""

from __future__ import annotations

import asyncio
import inspect
import math
import time
from collections.abc import Callable
from typing import Any, Literal, Self, TypeVar, cast

import pluggy

from ._logging import get_logger, mask_dsn
from .calls import CallGuard, Interrupted
from .config import (
    default_application_name,
    optional_positive,
    positive,
    session_settings,
)
from .errors import (
    ConfigurationError,
    ConnectionError,
    LockError,
    LockNotHeldError,
    PgLeaderLockError,
    SessionNotDedicatedError,
    ShutdownError,
)
from .hooks import callback_plugin, new_plugin_manager, ordered_impls
from .keys import check_key, lock_keys
from .machine import Action, Conditions, Transition, step
from .models import (
    Callback,
    ErrorCallback,
    Input,
    LockState,
    RetryContext,
    StateChangeCallback,
)
from .retry import ExponentialBackoff, RetryStrategy
from .session import (
    AbortableSession,
    ConnectOptions,
    LockSession,
    SessionFactory,
    WaitingSession,
    WatchableSession,
)

__all__ = ["LeaderLock"]

log = get_logger()

T = TypeVar("T")
F = TypeVar("F", bound=Callable[..., Any])

FollowerMode = Literal["wait", "poll"]

EventName = Literal[
    "acquired", "released", "lost", "acquire_failed", "state_change", "error", "stopped"
]

NON_RETRYABLE: tuple[type[BaseException], ...] = (SessionNotDedicatedError, ConfigurationError)
"""Errors after which retrying cannot help: the lock stops (after ``on_error``)."""

_HOOKS: dict[EventName, str] = {
    "acquired": "pgleaderlock_acquired",
    "released": "pgleaderlock_released",
    "lost": "pgleaderlock_lost",
    "acquire_failed": "pgleaderlock_acquire_failed",
    "state_change": "pgleaderlock_state_change",
    "error": "pgleaderlock_error",
    "stopped": "pgleaderlock_stopped",
}

_NOT_LEADING = frozenset({LockState.FOLLOWER, LockState.ACQUIRING, LockState.STOPPED})
_EXIT_TIMEOUT_S = 10.0
_ABNORMAL_STOP_CALLBACKS_S = 1.0
_CLOSE_TIMEOUT_S = 5.0


class LeaderLock:
    """Leader election on one PostgreSQL session-level advisory lock.

    One ``LeaderLock`` owns one lifecycle task and one dedicated database session (never
    from a pool). Several processes create a ``LeaderLock`` with the same keys; at most
    one of them is LEADER at any moment.

    Args:
        dsn: PostgreSQL connection string (URL or key=value), or an object a backend
            accepts (a SQLAlchemy ``AsyncEngine``). May be ``None`` when ``connect_fn``
            is given. A ``postgresql+DRIVER://`` scheme selects a backend.
        key1: first advisory lock key, a signed 32-bit integer.
        key2: second advisory lock key, a signed 32-bit integer.
        retry_strategy: delay between acquisition attempts and reconnections;
            default ``ExponentialBackoff()``. Returning ``None`` stops the lock.
        health_interval_s: seconds between health probes while LEADER.
        reconnect_grace_s: flap damping: how long to silently reconnect and re-acquire
            after the session fails, before reporting ``on_lost``. ``None`` disables it.
        auto_reacquire: go back to FOLLOWER after loss or ``step_down()``; if False the
            lock stops instead.
        shutdown_event: an external event; setting it has the effect of ``shutdown()``.
        connect_fn: a custom factory returning a :class:`~pgleaderlock.LockSession` or a
            raw driver connection (psycopg ``AsyncConnection``); overrides ``dsn``.
        health_timeout_s: timeout of one health probe. A silent failure is detected
            within ``health_interval_s + health_timeout_s``.
        connect_timeout_s: timeout for opening a session.
        command_timeout_s: timeout for ``pg_try_advisory_lock`` and ``pg_advisory_unlock``.
        tcp_user_timeout_s: after how long of network silence the *server* drops this
            session (and so frees the lock). Must exceed ``health_interval_s +
            health_timeout_s`` so that a partitioned leader has always demoted itself
            before anyone else can be granted the lock. Default: that bound plus
            ``max(1, bound / 4)`` seconds.
        application_name: shown in ``pg_stat_activity``; default
            ``pgleaderlock:<name or keys>@<host>:<pid>``.
        backend: driver backend name (``"psycopg"``, ...); default from the DSN scheme,
            else psycopg.
        name: a label for logs and ``application_name`` (set by :meth:`from_name`).
        follower_mode: ``"wait"`` (default): after an attempt finds the lock taken, the
            follower waits *on the server* (``pg_advisory_lock`` under ``lock_timeout``)
            for as long as the retry strategy's delay, and is granted the lock the
            instant the holder's session ends. ``"poll"``: the spec's behaviour, sleep
            for the delay and try again with ``pg_try_advisory_lock``. Each wait that
            ends without the lock counts as one failed attempt (``on_acquire_failed``,
            then the strategy is asked). A waiting follower keeps one server backend
            busy, and the server may log the wait when ``log_lock_waits`` is on.
            Backends that cannot wait fall back to polling.
        load_plugins: register the plugins of the ``pgleaderlock.plugins`` entry-point
            group (unless ``PGLEADERLOCK_DISABLE_PLUGIN_AUTOLOAD`` is set).

    Raises:
        ConfigurationError: for keys outside the signed 32-bit range, non-positive
            intervals, timings that break the partition bound, a malformed DSN.
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
        health_timeout_s: float = 2.0,
        connect_timeout_s: float = 5.0,
        command_timeout_s: float = 5.0,
        tcp_user_timeout_s: float | None = None,
        application_name: str | None = None,
        backend: str | None = None,
        name: str | None = None,
        follower_mode: FollowerMode = "wait",
        load_plugins: bool = True,
    ) -> None:
        self._key1 = check_key("key1", key1)
        self._key2 = check_key("key2", key2)
        self._name = name
        self._health_interval_s = positive("health_interval_s", health_interval_s)
        self._health_timeout_s = positive("health_timeout_s", health_timeout_s)
        self._grace_s = optional_positive("reconnect_grace_s", reconnect_grace_s)
        self._connect_timeout_s = positive("connect_timeout_s", connect_timeout_s)
        self._command_timeout_s = positive("command_timeout_s", command_timeout_s)
        demotion_bound = self._health_interval_s + self._health_timeout_s
        if tcp_user_timeout_s is None:
            tcp_user_timeout_s = demotion_bound + max(1.0, demotion_bound / 4)
        user_timeout = positive("tcp_user_timeout_s", tcp_user_timeout_s)
        if user_timeout <= demotion_bound:
            raise ConfigurationError(
                f"tcp_user_timeout_s={user_timeout:g} must exceed health_interval_s + "
                f"health_timeout_s = {demotion_bound:g}: otherwise a partitioned leader's "
                "lock could be granted to another session before the old leader has "
                "noticed and demoted itself"
            )
        if not isinstance(auto_reacquire, bool):
            raise ConfigurationError(f"auto_reacquire must be a bool, got {auto_reacquire!r}")
        self._auto_reacquire = auto_reacquire
        if retry_strategy is not None and not callable(
            getattr(retry_strategy, "next_delay_s", None)
        ):
            raise ConfigurationError(
                f"retry_strategy must have a next_delay_s(ctx) method, got {retry_strategy!r}"
            )
        self._retry: RetryStrategy = retry_strategy or ExponentialBackoff()
        if follower_mode not in ("wait", "poll"):
            raise ConfigurationError(
                f"follower_mode must be 'wait' or 'poll', got {follower_mode!r}"
            )
        self._follower_mode: FollowerMode = follower_mode
        self._external_stop = shutdown_event
        self._application_name = application_name or default_application_name(self.label)
        self._connect_options = ConnectOptions(
            application_name=self._application_name,
            connect_timeout_s=self._connect_timeout_s,
            server_settings=session_settings(demotion_bound, user_timeout, follower_mode),
        )
        self._connect_fn = connect_fn
        if connect_fn is None:
            # The registry is not a driver: it imports the chosen backend lazily.
            from ..backends import resolve

            self._backend, self._driver_dsn = resolve(backend, dsn)
            self._backend.check_dsn(self._driver_dsn)
        elif not callable(connect_fn):
            raise ConfigurationError(f"connect_fn must be callable, got {connect_fn!r}")

        self.plugins: pluggy.PluginManager = new_plugin_manager(load_entry_points=load_plugins)
        """This lock's plugin manager: ``lock.plugins.register(plugin)``."""

        # Lifecycle state, owned by the task.
        self._state = LockState.STOPPED
        self._task: asyncio.Task[None] | None = None
        self._started: asyncio.Future[None] | None = None
        self._session: LockSession | None = None
        self._signal = asyncio.Event()  # wakes the task: stop, step_down, force
        self._stop_requested = False
        self._release_requested = False
        self._force_release = False
        self._releasing_for_step_down = False
        self._give_up = False
        self._call = CallGuard(self._abort_session)  # bounds every database call
        self._attempt_at: float | None = None
        self._wait_budget_s = 0.0  # wait mode: how long the next attempt waits on the server
        self._session_alarm = False  # the watched idle session became readable
        self._grace_deadline: float | None = None
        self._attempt = 0
        self._cycle_start: float | None = None
        self._last_error: Exception | None = None
        self._state_waiters: set[asyncio.Future[None]] = set()
        self._release_done: asyncio.Future[None] | None = None
        self._watcher: asyncio.Task[None] | None = None
        self._leader_since: float | None = None
        self._leader_ready = False  # LEADER, and the transition's callbacks have run
        self._stop_reported = False  # on_stopped has run for this run of the task

    # ------------------------------------------------------------------ construction

    @classmethod
    def from_name(cls, name: str, dsn: str | Any | None = None, **kwargs: Any) -> Self:
        """A lock whose keys are derived from ``name`` by :func:`~pgleaderlock.lock_keys`.

        Args:
            name: the lock's name; the same name gives the same keys in every process
                (and in SQL).
            dsn: as for the constructor.
            **kwargs: any other constructor argument.
        """
        key1, key2 = lock_keys(name)
        return cls(dsn, key1, key2, name=name, **kwargs)

    # ------------------------------------------------------------------ properties

    @property
    def state(self) -> LockState:
        """The current state."""
        return self._state

    @property
    def is_leader(self) -> bool:
        """True while LEADER. False during RECONNECTING: the lock is not held then."""
        return self._state is LockState.LEADER

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
    def application_name(self) -> str:
        """The ``application_name`` of this lock's sessions."""
        return self._application_name

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
        return self._follower_mode

    @property
    def leader_since(self) -> float | None:
        """``time.time()`` when the current leadership began, or None when not LEADER."""
        return self._leader_since if self.is_leader else None

    @property
    def backend_pid(self) -> int | None:
        """The server pid of the current session, if any."""
        return self._session.backend_pid if self._session is not None else None

    def __repr__(self) -> str:
        label = f"name={self._name!r} " if self._name is not None else ""
        return f"<LeaderLock {label}keys=({self._key1}, {self._key2}) state={self._state.value}>"

    # ------------------------------------------------------------------ callbacks

    def _register(self, event: EventName, fn: F) -> F:
        if not callable(fn):
            raise ConfigurationError(f"on_{event} needs a callable, got {fn!r}")
        self.plugins.register(callback_plugin(_HOOKS[event], fn))
        return fn

    def on_acquired(self, fn: Callback) -> Callback:
        """Register a callback for leadership acquired (decorator)."""
        return self._register("acquired", fn)

    def on_released(self, fn: Callback) -> Callback:
        """Register a callback for leadership released voluntarily (decorator)."""
        return self._register("released", fn)

    def on_lost(self, fn: Callback) -> Callback:
        """Register a callback for leadership lost involuntarily (decorator)."""
        return self._register("lost", fn)

    def on_acquire_failed(self, fn: Callback) -> Callback:
        """Register a callback for an attempt that found the lock held elsewhere."""
        return self._register("acquire_failed", fn)

    def on_state_change(self, fn: StateChangeCallback) -> StateChangeCallback:
        """Register a callback called with ``(from_state, to_state)`` on every change."""
        return self._register("state_change", fn)

    def on_error(self, fn: ErrorCallback) -> ErrorCallback:
        """Register a callback for database errors and exceptions raised by callbacks."""
        return self._register("error", fn)

    def on_stopped(self, fn: Callback) -> Callback:
        """Register a callback for the lock reaching STOPPED (decorator)."""
        return self._register("stopped", fn)

    async def _emit(self, event: EventName, **data: Any) -> None:
        """Run every implementation of the event's hook (callbacks included), in order."""
        kwargs = {"lock": self, **data}
        for impl in ordered_impls(getattr(self.plugins.hook, _HOOKS[event])):
            try:
                result = impl.function(*[kwargs[name] for name in impl.argnames])
                if inspect.isawaitable(result):
                    await result
            except Exception as exc:
                log.error(
                    "callback_failed",
                    callback=getattr(impl.function, "__qualname__", impl.plugin_name),
                    event=event,
                    error=repr(exc),
                    key1=self._key1,
                    key2=self._key2,
                    exc_info=True,
                )
                if event != "error":
                    await self._emit("error", error=exc)

    # ------------------------------------------------------------------ lifecycle API

    async def start(self) -> None:
        """Start the lifecycle task: STOPPED -> FOLLOWER. Idempotent.

        Returns once the task has made the Start transition; acquisition goes on in the
        background (see :meth:`wait_for_leadership`).
        """
        if self._task is None or self._task.done():
            loop = asyncio.get_running_loop()
            self._stop_requested = self._release_requested = self._force_release = False
            self._give_up = False
            self._stop_reported = False
            self._signal = asyncio.Event()  # a restart may run on another event loop
            self._started = loop.create_future()
            self._task = loop.create_task(
                self._run(), name=f"pgleaderlock-{self._key1}-{self._key2}"
            )
        assert self._started is not None
        await asyncio.shield(self._started)

    async def shutdown(self, timeout_s: float | None = None) -> None:
        """Release the lock (if held), close the session and stop the task. Idempotent.

        Args:
            timeout_s: how long to wait; ``None`` waits for the orderly stop, which every
                database call bounds by its own timeout.

        Raises:
            ShutdownError: the task did not stop within ``timeout_s``; it was then
                cancelled and the session closed (which frees the lock on the server).
        """
        task = self._task
        if task is None or task.done():
            return
        self._request_stop()
        if task is asyncio.current_task():
            return  # called from a callback: the task stops once the callback returns
        try:
            async with asyncio.timeout(timeout_s):
                await asyncio.shield(task)
        except TimeoutError:
            self._abort_session()  # no driver may spend time cancelling on the server
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
        task = self._task
        if task is None or task.done():
            return
        if self._stop_requested:  # shutdown wins: return once the task has ended
            if task is not asyncio.current_task():
                await asyncio.wait({task}, timeout=timeout_s)
            return
        if self._state is not LockState.LEADER and self._release_done is None:
            return
        if self._release_done is None:
            self._release_done = asyncio.get_running_loop().create_future()
        done = self._release_done
        self._release_requested = True
        self._signal.set()
        if task is asyncio.current_task():
            return
        try:
            async with asyncio.timeout(timeout_s):
                await asyncio.shield(done)
        except TimeoutError:
            log.warning("step_down_timeout", timeout_s=timeout_s, key1=self._key1, key2=self._key2)
            self._force_release = True
            self._signal.set()
            self._call.interrupt("force")
            await asyncio.shield(done)
        if self._stop_requested:
            await asyncio.gather(asyncio.shield(task), return_exceptions=True)

    async def wait_for_leadership(self, timeout_s: float | None = None) -> bool:
        """Wait until this lock is LEADER (and its ``on_acquired`` callbacks have run).

        Returns:
            True once LEADER; False if ``timeout_s`` elapsed first, or if the lock
                is stopped (or stops while waiting), since it cannot lead then.
        """
        loop = asyncio.get_running_loop()
        try:
            async with asyncio.timeout(timeout_s):
                while True:
                    if self._leader_ready:
                        return True
                    if self._task is None or self._task.done():
                        return False
                    waiter = loop.create_future()
                    self._state_waiters.add(waiter)
                    try:
                        await waiter
                    finally:
                        self._state_waiters.discard(waiter)
        except TimeoutError:
            return False

    async def __aenter__(self) -> Self:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        if exc and exc[0] is not None:
            try:
                await self.shutdown(timeout_s=_EXIT_TIMEOUT_S)
            except ShutdownError as err:
                log.error("shutdown_failed", error=str(err), key1=self._key1, key2=self._key2)
        else:
            await self.shutdown()

    # ------------------------------------------------------------------ requests

    def _request_stop(self) -> None:
        if not self._stop_requested:
            self._stop_requested = True
            self._signal.set()
            self._call.interrupt("stop")

    def _abort_session(self) -> None:
        """Drop the session's connection synchronously (see AbortableSession)."""
        session = self._session
        if session is not None and _can(session, AbortableSession):
            try:
                cast(AbortableSession, session).abort()
            except Exception as exc:  # abort() must not raise; be defensive anyway
                log.warning("session_abort_failed", error=repr(exc))

    async def _watch_external(self, event: asyncio.Event) -> None:
        await event.wait()
        self._request_stop()

    # ------------------------------------------------------------------ the task

    async def _run(self) -> None:
        assert self._started is not None
        if self._external_stop is not None:
            self._watcher = asyncio.get_running_loop().create_task(
                self._watch_external(self._external_stop)
            )
        try:
            await self._fire(Input.START)
            if not self._started.done():
                self._started.set_result(None)
            while self._state is not LockState.STOPPED:
                await self._fire(await self._next_input())
        except Exception as exc:  # a bug: report it, then clean up like a stop
            log.error("lifecycle_task_failed", error=repr(exc), exc_info=True)
            await self._emit("error", error=exc)
        finally:
            if self._watcher is not None:
                self._watcher.cancel()
                await asyncio.gather(self._watcher, return_exceptions=True)
                self._watcher = None
            self._call.close()
            await self._close_session()
            if not self._stop_reported:
                await self._stop_abnormally()
            if not self._started.done():
                self._started.set_result(None)
            self._resolve_release()
            self._wake_state_waiters()

    async def _stop_abnormally(self) -> None:
        """The task was cancelled (a forced shutdown) or crashed: still tell everyone.

        The callbacks get a short, fixed time: one of them may be what blocked the
        orderly stop in the first place.
        """
        old = self._state
        self._stop_reported = True
        try:
            async with asyncio.timeout(_ABNORMAL_STOP_CALLBACKS_S):
                if old is not LockState.STOPPED:
                    self._set_state(LockState.STOPPED)
                    await self._emit("state_change", old=old, new=LockState.STOPPED)
                await self._emit("stopped")
        except (TimeoutError, asyncio.CancelledError):
            log.warning("stop_callbacks_abandoned", key1=self._key1, key2=self._key2)
        finally:
            self._state = LockState.STOPPED

    def _conditions(self) -> Conditions:
        return Conditions(
            auto_reacquire=self._auto_reacquire,
            grace_enabled=self._grace_s is not None,
            step_down=self._releasing_for_step_down and not self._stop_requested,
        )

    async def _fire(self, input_: Input) -> None:
        transition = step(self._state, input_, self._conditions())
        log.debug("input", input=input_.value, state=self._state, key1=self._key1, key2=self._key2)
        if transition.changes_state:
            self._set_state(transition.target)
            await self._emit("state_change", old=transition.source, new=transition.target)
        if transition.source is LockState.RELEASING:
            self._releasing_for_step_down = False
        for action in transition.actions:
            await self._perform(action, transition)
        if self._state in _NOT_LEADING:
            self._resolve_release()  # a pending step_down() is over: we do not lead
        if transition.changes_state:
            # After the row's callbacks: wait_for_leadership() returns once on_acquired ran.
            self._leader_ready = self._state is LockState.LEADER
            self._wake_state_waiters()

    def _set_state(self, new: LockState) -> None:
        old, self._state = self._state, new
        self._leader_ready = False
        if new is LockState.LEADER:
            self._leader_since = time.time()
        log.info(
            "state_change",
            **{"from": old, "to": new},
            key1=self._key1,
            key2=self._key2,
            name=self._name,
        )

    def _wake_state_waiters(self) -> None:
        for waiter in self._state_waiters:
            if not waiter.done():
                waiter.set_result(None)

    def _resolve_release(self) -> None:
        done, self._release_done = self._release_done, None
        self._release_requested = self._force_release = False
        if done is not None and not done.done():
            done.set_result(None)

    async def _perform(self, action: Action, transition: Transition) -> None:
        now = time.monotonic()
        match action:
            case Action.OPEN_SESSION:
                pass  # the FOLLOWER step opens a session when the next attempt is due
            case Action.CLOSE_SESSION:
                await self._close_session()
            case Action.TRY_LOCK:
                if self._cycle_start is None:
                    self._cycle_start = now
            case Action.UNLOCK:
                self._releasing_for_step_down = (
                    transition.input is Input.RELEASE_REQUESTED and not self._stop_requested
                )
            case Action.START_HEALTH_LOOP:
                pass  # the LEADER step is the health loop
            case Action.START_GRACE:
                assert self._grace_s is not None
                self._grace_deadline = now + self._grace_s
            case Action.SCHEDULE_ATTEMPT:
                self._give_up_if_hopeless()
                self._wait_budget_s = 0.0
                self._attempt_at = now
            case Action.BACKOFF:
                self._backoff(now)
            case Action.RESET_RETRY:
                self._attempt = 0
                self._cycle_start = None
                self._last_error = None
            case Action.LOG_SESSION_LOST:
                log.warning(
                    "health_check_failed",
                    error=_describe(self._last_error),
                    key1=self._key1,
                    key2=self._key2,
                )
            case Action.LOG_RECOVERED:
                log.info("leadership_recovered", key1=self._key1, key2=self._key2)
            case Action.EMIT_ACQUIRED:
                log.info(
                    "lock_acquired",
                    key1=self._key1,
                    key2=self._key2,
                    attempt=self._attempt + 1,
                    backend_pid=self.backend_pid,
                )
                await self._emit("acquired")
            case Action.EMIT_ACQUIRE_FAILED:
                await self._emit("acquire_failed", attempt=self._attempt + 1)
            case Action.EMIT_LOST:
                log.warning("lock_lost", key1=self._key1, key2=self._key2)
                await self._emit("lost")
            case Action.EMIT_RELEASED:
                log.info("lock_released", key1=self._key1, key2=self._key2)
                await self._emit("released")
            case Action.EMIT_ERROR:
                error = self._last_error or PgLeaderLockError("unknown error")
                log.error(
                    "db_error",
                    error=_describe(error),
                    state=transition.source,
                    key1=self._key1,
                    key2=self._key2,
                )
                await self._emit("error", error=error)
            case Action.EMIT_STOPPED:
                log.info("lock_stopped", key1=self._key1, key2=self._key2)
                await self._emit("stopped")
                self._stop_reported = True

    def _backoff(self, now: float) -> None:
        self._attempt += 1
        self._wait_budget_s = 0.0
        if self._cycle_start is None:
            self._cycle_start = now
        if self._give_up_if_hopeless():
            return
        error = self._last_error
        delay = self._next_delay(RetryContext(self._attempt, now - self._cycle_start, error))
        if delay is None:
            self._give_up = True
            return
        if (
            error is None
            and self._follower_mode == "wait"
            and self._session is not None
            and _can(self._session, WaitingSession)
        ):
            # The lock is taken: spend the delay waiting on the server, so the lock is
            # ours the instant its holder's session ends. A failed connection sleeps.
            log.debug("wait_scheduled", wait_s=round(delay, 3), attempt=self._attempt)
            self._wait_budget_s = delay
            self._attempt_at = now
            return
        log.debug("retry_scheduled", delay_s=round(delay, 3), attempt=self._attempt)
        self._attempt_at = now + delay

    def _give_up_if_hopeless(self) -> bool:
        """Stop retrying after an error that retrying cannot mend (NON_RETRYABLE)."""
        if isinstance(self._last_error, NON_RETRYABLE):
            log.error("giving_up", reason="non-retryable error", error=_describe(self._last_error))
            self._give_up = True
        return self._give_up

    def _next_delay(self, ctx: RetryContext) -> float | None:
        """Ask the retry strategy; a strategy that fails or returns None gives up."""
        try:
            delay = self._retry.next_delay_s(ctx)
        except Exception as exc:
            log.error("retry_strategy_failed", error=repr(exc), exc_info=True)
            return None
        if delay is None:
            log.info("giving_up", reason="retry strategy returned None", attempt=ctx.attempt)
            return None
        return max(0.0, float(delay)) if math.isfinite(delay) else 0.0

    # ------------------------------------------------------------------ per-state steps

    async def _next_input(self) -> Input:
        match self._state:
            case LockState.FOLLOWER:
                return await self._follower_step()
            case LockState.ACQUIRING:
                return await self._acquiring_step()
            case LockState.LEADER:
                return await self._leader_step()
            case LockState.RECONNECTING:
                return await self._reconnecting_step()
            case LockState.RELEASING:
                return await self._releasing_step()
            case _:  # pragma: no cover - the loop ends at STOPPED
                raise AssertionError(self._state)

    async def _sleep_until(self, deadline: float | None) -> None:
        """Sleep until ``deadline`` (monotonic) or until a request wakes the task."""
        if self._signal.is_set():
            return
        try:
            async with asyncio.timeout_at(_loop_time(deadline)):
                await self._signal.wait()
        except TimeoutError:
            pass

    def _stop_pending(self) -> bool:
        return self._stop_requested or self._give_up

    async def _follower_step(self) -> Input:
        while True:
            if self._stop_pending():
                return Input.STOP_REQUESTED
            self._signal.clear()
            if self._attempt_at is not None and time.monotonic() >= self._attempt_at:
                break
            await self._sleep_until(self._attempt_at)
        self._attempt_at = None
        if self._session is None:
            try:
                self._session = await self._call(
                    self._open_session(), self._connect_timeout_s, interruptible="stop"
                )
            except Interrupted:
                return Input.STOP_REQUESTED
            except Exception as exc:
                self._last_error = _as_connection_error(exc, "connect", self._connect_timeout_s)
                return Input.DB_ERROR
        return Input.ACQUIRE_ATTEMPT

    async def _acquiring_step(self) -> Input:
        session = self._session
        assert session is not None
        wait_s, self._wait_budget_s = self._wait_budget_s, 0.0
        try:
            if wait_s > 0 and _can(session, WaitingSession):
                # On a stop, let the backend cancel the wait on the server first: the
                # queued backend would otherwise linger until it notices we left.
                granted = await self._call(
                    cast(WaitingSession, session).wait_lock(self._key1, self._key2, wait_s),
                    wait_s + self._command_timeout_s,
                    interruptible="stop",
                    abort_on_stop=False,
                )
            else:
                granted = await self._call(
                    session.try_lock(self._key1, self._key2),
                    self._command_timeout_s,
                    interruptible="stop",
                )
        except Interrupted:
            return Input.STOP_REQUESTED  # the row closes the session: it may hold the lock
        except Exception as exc:
            self._last_error = _as_connection_error(exc, "try_lock", self._command_timeout_s)
            return Input.DB_ERROR
        if granted:
            return Input.ACQUIRE_SUCCEEDED
        self._last_error = None
        return Input.ACQUIRE_FAILED

    async def _leader_step(self) -> Input:
        session = self._session
        assert session is not None
        if _can(session, WatchableSession):
            self._session_alarm = False
            cast(WatchableSession, session).watch(self._on_session_alarm)
        deadline = time.monotonic() + self._health_interval_s
        while True:
            if self._stop_requested:
                return Input.STOP_REQUESTED
            if self._release_requested:
                return Input.RELEASE_REQUESTED
            self._signal.clear()
            if self._session_alarm or time.monotonic() >= deadline:
                break
            await self._sleep_until(deadline)
        if self._session_alarm:
            log.debug("session_alarm", key1=self._key1, key2=self._key2)
        try:
            held = await self._call(session.holds(self._key1, self._key2), self._health_timeout_s)
        except Exception as exc:
            self._last_error = _as_connection_error(exc, "health check", self._health_timeout_s)
            return Input.HEALTH_FAILED
        if not held:
            self._last_error = LockNotHeldError(
                "the health probe found that this session no longer holds the lock"
            )
            return Input.HEALTH_FAILED
        return Input.HEALTH_OK

    def _on_session_alarm(self) -> None:
        """The idle session's socket became readable: most likely the server ended it.
        Probe at once instead of at the next interval."""
        self._session_alarm = True
        self._signal.set()

    async def _reconnecting_step(self) -> Input:
        assert self._grace_deadline is not None
        deadline = self._grace_deadline
        attempt = 0
        while True:
            if self._stop_requested:
                return Input.STOP_REQUESTED
            remaining = deadline - time.monotonic()
            if remaining <= 0 or self._release_requested:
                # step_down() while the session is gone ends the grace period early.
                return Input.GRACE_EXPIRED
            self._signal.clear()
            try:
                # Two bounded calls, each under the grace deadline, so that a timeout
                # aborts the session like any other call's (no nested timeouts).
                if self._session is None:
                    self._session = await self._call(
                        self._open_session(),
                        min(self._connect_timeout_s, remaining),
                        interruptible="stop",
                    )
                    remaining = deadline - time.monotonic()
                    if remaining <= 0:
                        return Input.GRACE_EXPIRED
                granted = await self._call(
                    self._session.try_lock(self._key1, self._key2),
                    min(self._command_timeout_s, remaining),
                    interruptible="stop",
                )
            except Interrupted:
                return Input.STOP_REQUESTED
            except Exception as exc:
                await self._close_session()
                self._last_error = _as_connection_error(exc, "reconnect", remaining)
                log.info("reconnect_failed", error=_describe(self._last_error), attempt=attempt + 1)
            else:
                if granted:
                    return Input.REACQUIRE_SUCCEEDED
                self._last_error = None
                return Input.REACQUIRE_FAILED
            attempt += 1
            elapsed = time.monotonic() - (deadline - (self._grace_s or 0.0))
            delay = self._next_delay(RetryContext(attempt, elapsed, self._last_error))
            if delay is None:
                return Input.GRACE_EXPIRED
            await self._sleep_until(min(deadline, time.monotonic() + delay))

    async def _releasing_step(self) -> Input:
        session = self._session
        assert session is not None
        try:
            if self._force_release:
                raise Interrupted
            # step_down's timeout may cut the unlock short (the session is then closed).
            released = await self._call(
                session.unlock(self._key1, self._key2),
                self._command_timeout_s,
                interruptible="force",
            )
        except Interrupted:
            self._last_error = ConnectionError(
                "step_down timed out; closing the session to release the lock"
            )
            return Input.RELEASE_FAILED
        except Exception as exc:
            self._last_error = _as_connection_error(exc, "unlock", self._command_timeout_s)
            return Input.DB_ERROR
        if released:
            return Input.RELEASE_SUCCEEDED
        self._last_error = LockError(
            "pg_advisory_unlock returned false: this session did not hold the lock"
        )
        return Input.RELEASE_FAILED

    # ------------------------------------------------------------------ sessions

    async def _open_session(self) -> LockSession:
        if self._connect_fn is not None:
            obj = await self._connect_fn()
            from ..backends import wrap_connection

            session = wrap_connection(obj)
        else:
            session = await self._backend.connect(self._driver_dsn, self._connect_options)
        log.debug(
            "session_opened",
            backend_pid=session.backend_pid,
            application_name=self._application_name,
        )
        return session

    async def _close_session(self) -> None:
        session, self._session = self._session, None
        if session is None:
            return
        try:
            async with asyncio.timeout(_CLOSE_TIMEOUT_S):
                await session.close()
        except Exception as exc:  # close() must not raise; be defensive anyway
            log.warning("session_close_failed", error=repr(exc))


_CAPABILITIES: dict[tuple[type, type], bool] = {}


def _can(session: object, capability: type) -> bool:
    """``isinstance(session, capability)`` for the optional session capabilities, cached
    per class: a runtime protocol check costs microseconds on every call otherwise."""
    key = (type(session), capability)
    found = _CAPABILITIES.get(key)
    if found is None:
        found = _CAPABILITIES[key] = isinstance(session, capability)
    return found


def _loop_time(deadline: float | None) -> float | None:
    """Convert a ``time.monotonic()`` deadline into the loop's clock."""
    if deadline is None:
        return None
    return asyncio.get_running_loop().time() + (deadline - time.monotonic())


def _describe(error: BaseException | None) -> str:
    if error is None:
        return "none"
    return mask_dsn(f"{type(error).__name__}: {error}")


def _as_connection_error(exc: Exception, what: str, timeout_s: float) -> Exception:
    """Errors from our own code pass through; timeouts and stray errors get context."""
    if isinstance(exc, PgLeaderLockError):
        return exc
    if isinstance(exc, TimeoutError):
        err = ConnectionError(f"{what} timed out after {timeout_s:g} s")
    else:
        err = ConnectionError(mask_dsn(f"{what} failed: {type(exc).__name__}: {exc}"))
    err.__cause__ = exc
    return err
