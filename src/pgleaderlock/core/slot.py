"""The lifecycle task's one session: opened through a backend or ``connect_fn`` and
checked, closed within a bound, aborted synchronously, watched while idle.

A slot holds at most one [`LockSession`][pgleaderlock.LockSession]. The machine says when
to open, close or watch, and the runner asks the slot. Opening includes the checks every
session must pass before its first lock call (docs/guides/ha-and-poolers.md):

- a standby (``pg_is_in_recovery()``) is refused with
  [`StandbyError`][pgleaderlock.StandbyError] (retried: it may be promoted);
- a session whose protocol-reported pid is not its ``pg_backend_pid()`` sits behind a
  pooler. A second session is opened the same way and asked for its backend: a pooler
  in transaction or statement mode hands an idle client's server connection to the next
  client (PgBouncer reuses the most recently used one), so both report the same backend;
  in session mode they cannot. The first case is refused with
  [`SessionNotDedicatedError`][pgleaderlock.SessionNotDedicatedError] before any lock
  call; the lock statements themselves also run only on the session's own backend, so a
  pooler that moves a statement later leaves no lock behind either;
- then the session's settings are applied (``SetupSession.configure``), never before
  the checks: through a transaction pooler they would stick to a shared server
  connection.
"""

from __future__ import annotations

import asyncio
import functools
import inspect
import weakref
from collections.abc import Awaitable, Callable
from dataclasses import replace
from typing import Any, TypeVar, cast

from ._logging import StructuredLogger
from .config import LockConfig
from .errors import (
    ConfigurationError,
    PooledConnectionError,
    SessionNotDedicatedError,
    StandbyError,
)
from .registry import connect_error, resolve, wrap_connection
from .session import (
    AbortableSession,
    Backend,
    ConnectOptions,
    LockSession,
    ProbingSession,
    SessionFactory,
    SetupSession,
    TableSession,
    WatchableSession,
)
from .tables import LibraryTable, missing_table

T = TypeVar("T")

__all__ = ["SessionSlot", "can", "check_connect_fn", "connection_target"]

CLOSE_TIMEOUT_S = 5.0
OPEN_GRACE_S = 0.5
"""How long an open that its caller gave up on may still finish, to be closed at once
(see ``SessionSlot._connect_or_close``)."""
POOLER_CHECK_ROUNDS = 4
"""How many more times the pooler check compares backends after the first look."""
CLAIM_PER_SLOT_S = 0.01
"""What a new session's claim grows by for every other lock (session slot) of this
process: a process that runs many locks may have to claim many grants at once (all its
followers, when the process that led them dies), each read and claimed in turn by one
event loop."""
CLAIM_BACKOFF_MAX = 64.0
"""The claim of a lock whose grants went unclaimed doubles, up to this factor (and never
beyond the lease)."""

_SLOTS: weakref.WeakSet[SessionSlot] = weakref.WeakSet()
"""The session slots of this process (one per lock, and a Coordinator's own)."""

_CAPABILITIES: dict[tuple[type, type], bool] = {}


def can(session: object, capability: type) -> bool:
    """``isinstance(session, capability)`` for the optional session capabilities, cached
    per class: a runtime protocol check costs microseconds on every call otherwise."""
    key = (type(session), capability)
    found = _CAPABILITIES.get(key)
    if found is None:
        found = _CAPABILITIES[key] = isinstance(session, capability)
    return found


def connection_target(
    backend: str | None, dsn: Any, connect_fn: object, config: LockConfig
) -> tuple[Backend | None, Any, LockConfig]:
    """Where sessions come from, checked before any I/O: the backend and the DSN its
    driver takes (``None, None`` with ``connect_fn``, which must be an ``async def``),
    and ``config`` with its ``connect_budget_s``: every host once, the pooler check's
    second session, and the setup statements.

    Raises:
        ConfigurationError: a bad DSN, backend or ``connect_fn``.
        BackendUnavailableError: the backend's driver is not installed.
    """
    found: Backend | None = None
    driver_dsn = None
    budget = config.connect_timeout_s
    if connect_fn is None:
        found, driver_dsn = resolve(backend, dsn)
        found.check_dsn(driver_dsn)
        if found.connect_budget is not None:
            budget = found.connect_budget(driver_dsn, budget)
    else:
        check_connect_fn(connect_fn)
    bound = 2 * budget + config.command_timeout_s
    return found, driver_dsn, replace(config, connect_budget_s=bound)


def check_connect_fn(connect_fn: object) -> None:
    """Refuse a ``connect_fn`` that cannot be awaited: a plain function would fail at
    every attempt. An ``async def`` function (or method, ``functools.partial`` of one,
    or an object with an ``async def __call__``) is accepted; a lambda or plain function
    returning a coroutine cannot be told apart before it is called, so it is refused
    too: wrap it in ``async def``.

    Raises:
        ConfigurationError: ``connect_fn`` is not an async callable.
    """
    target = connect_fn
    while isinstance(target, functools.partial):
        target = target.func
    call = target if inspect.isfunction(target) or inspect.ismethod(target) else None
    if call is None and callable(target) and not inspect.isclass(target):
        call = getattr(target, "__call__", None)  # noqa: B004 - the method, to inspect it
    if call is None or not inspect.iscoroutinefunction(call):
        raise ConfigurationError(
            f"connect_fn must be an async function (async def ...) returning a connection "
            f"or a LockSession, got {connect_fn!r}"
        )


class SessionSlot:
    """Where the lock's current session lives.

    Args:
        backend: opens sessions with `dsn` and `options`; `None` with `connect_fn`.
        dsn: the DSN (or engine) the backend accepts.
        options: what every session is opened with.
        connect_fn: the user's factory; its result is wrapped into a
            [`LockSession`][pgleaderlock.LockSession]. Overrides `backend`.
        log: the lock's logger.
        fields: added to every log record.
    """

    def __init__(
        self,
        *,
        backend: Backend | None,
        dsn: Any,
        options: ConnectOptions,
        connect_fn: SessionFactory | None,
        log: StructuredLogger,
        fields: dict[str, Any],
    ) -> None:
        self._backend, self._dsn, self._options = backend, dsn, options
        self._connect_fn = connect_fn
        self._log, self._fields = log, fields
        self.session: LockSession | None = None
        self._warned_lease = False
        # What the core knows of the session (forgotten with it): whether ``holds()``
        # confirmed its lock since the last grant, and which tables it checked.
        self._verified = False
        self._prepared: set[LibraryTable] = set()
        self._claim_factor = 1.0  # doubled for each grant that went unclaimed
        _SLOTS.add(self)
        self.after_open: Callable[[], Awaitable[None]] | None = None
        """Run on each new session once it passed its checks, within the open's bound
        (a lock publishes its participant row there); it must not raise."""

    @property
    def backend_pid(self) -> int | None:
        return self.session.backend_pid if self.session is not None else None

    async def open(self) -> LockSession:
        """Open a session, check it and keep it (the caller bounds the time this takes).

        Raises:
            StandbyError: the server is a standby.
            SessionNotDedicatedError: a pooler shares server connections between clients.
            PooledConnectionError: ``connect_fn`` returned a pool's connection (it was
                handed back to its pool).
            ConfigurationError: ``connect_fn`` returned something that is not awaitable
                or not a connection.
        """
        options = self.session_options()
        session = await self._connect_or_close(options)
        self._verified, self._prepared = False, set()
        try:
            if can(session, SetupSession):
                await self._check(cast(SetupSession, session), options)
        except BaseException:
            await self._close(session)
            raise
        self.session = session
        if self.after_open is not None:
            await self.after_open()
        self._log.debug(
            "session_opened",
            backend_pid=session.backend_pid,
            application_name=self._options.application_name,
            **self._fields,
        )
        return session

    def session_options(self) -> ConnectOptions:
        """The options of the next session: the slot's, with the claim
        ([`ConnectOptions.claim_s`][pgleaderlock.backends.ConnectOptions]) grown by
        ``CLAIM_PER_SLOT_S`` for every other lock (slot) of this process and
        doubled for each grant of this slot's sessions that went unclaimed (halved back
        with each grant), never beyond the lease."""
        options = self._options
        if options.claim_s <= 0:
            return options
        others = len(_SLOTS) - 1
        claim = options.claim_s * self._claim_factor + CLAIM_PER_SLOT_S * others
        if options.lease_s > 0:
            claim = min(claim, options.lease_s)
        return replace(options, claim_s=claim)

    def claim_failed(self) -> None:
        """A grant to this slot's session went unclaimed (the server ended the session):
        the next sessions' claims are twice as long, up to the lease."""
        self._claim_factor = min(CLAIM_BACKOFF_MAX, self._claim_factor * 2)

    async def _connect_or_close(self, options: ConnectOptions) -> LockSession:
        """`_connect`; if the caller gives up meanwhile (a timeout, a shutdown), a
        connection about to be made (within ``OPEN_GRACE_S``) is made and closed, rather
        than cut off half-made, which some drivers leave open on the server until the
        garbage collector finds it."""
        made = asyncio.ensure_future(self._connect(options))
        try:
            return await asyncio.shield(made)
        except asyncio.CancelledError:
            try:
                async with asyncio.timeout(OPEN_GRACE_S):
                    session = await asyncio.shield(made)
            except BaseException as exc:  # not made in time, or cut short again: cut it off
                made.cancel()
                await asyncio.gather(made, return_exceptions=True)
                if not isinstance(exc, Exception | asyncio.CancelledError):
                    raise  # KeyboardInterrupt, SystemExit: not lost
            else:
                await self._close(session)
            raise

    async def _connect(self, options: ConnectOptions) -> LockSession:
        if self._connect_fn is None:
            assert self._backend is not None
            return await self._backend.connect(self._dsn, options)
        made = self._connect_fn()
        if not inspect.isawaitable(made):
            raise ConfigurationError(
                f"connect_fn must be an async function; it returned {type(made).__name__}"
            )
        try:
            obj = await made
        except Exception as exc:
            error = connect_error(exc)  # e.g. a refusal for good, not a retryable failure
            if error is None:
                raise
            raise error from exc
        try:
            return wrap_connection(obj)
        except PooledConnectionError as exc:
            if exc.give_back is not None:
                try:
                    await exc.give_back()  # a pool would otherwise wait for it forever
                except Exception as failed:
                    self._log.warning("give_back_failed", error=repr(failed), **self._fields)
            raise

    async def _check(self, session: SetupSession, options: ConnectOptions) -> None:
        info = await session.identify(options)
        if info.in_recovery:
            raise StandbyError(
                f"the server (backend {info.backend_pid}) is a standby: an advisory lock "
                "taken there does not exclude one taken on the primary"
            )
        if info.behind_pooler:
            await self._check_pooler(session, info.backend_pid, options)
        if options.lease_s and not info.lease_supported and not self._warned_lease:
            self._warned_lease = True
            self._log.warning(
                "lease_not_enforced",
                reason="the server has no idle_session_timeout (PostgreSQL < 14): a "
                "frozen leader keeps its lock until its session ends",
                **self._fields,
            )
        await session.configure(options)

    async def _check_pooler(self, session: SetupSession, own: int, options: ConnectOptions) -> None:
        """Tell a session-mode pooler (accepted) from one that shares server connections.

        A second client asks for its backend right after this session asked for its
        own, a few times over. A session-mode pooler keeps this session's backend for
        it: the two never meet, and this session never moves. A transaction or statement
        pooler hands an idle client's backend to the next client that asks: with no
        other traffic the second client gets this session's backend at once (PgBouncer
        reuses the most recently released one); with other clients' traffic in between,
        this session itself lands on another backend. Either gives it away.
        """
        probe = cast(SetupSession, await self._connect(options))
        try:
            theirs = (await probe.identify()).backend_pid
            for _ in range(POOLER_CHECK_ROUNDS):
                if theirs == own:
                    break
                # Each raises SessionNotDedicatedError if its session moved to another
                # backend between two statements.
                await session.backend_now()
                theirs = await probe.backend_now()
        finally:
            await self._close(cast(LockSession, probe))
        if theirs == own:
            raise SessionNotDedicatedError(
                "a pooler in transaction or statement mode sits between this client and "
                f"PostgreSQL: a second client was served by this session's server backend "
                f"({own}). Session-level advisory locks need a direct connection or a "
                "session-mode pooler"
            )
        self._log.debug("session_behind_pooler", mode="session", **self._fields)

    # ------------------------------------------------------------------ probes

    def granted(self) -> None:
        """A lock call granted a lock (and, for a wait, the grant was claimed): the next
        probe asks ``pg_locks`` (`holds`), and a claim doubled for unclaimed grants is
        halved back."""
        self._verified = False
        self._claim_factor = max(1.0, self._claim_factor / 2)

    async def holds(self, key1: int, key2: int) -> bool:
        """The session's ``holds()``. Once it says the lock stays with the session (a
        pooler that resets server connections after each transaction would have freed
        it), `start_probe` takes the cheap probe until the next grant: the server's
        cost of ``pg_locks`` grows with its lock table, the cheap probe's does not."""
        assert self.session is not None
        held = await self.session.holds(key1, key2)
        self._verified = held
        return held

    def start_probe(self) -> asyncio.Future[None] | None:
        """The session's cheap probe, started (``ProbingSession``), once `holds` has
        confirmed the lock since its grant; ``None`` otherwise (then `holds`)."""
        session = self.session
        if not self._verified or session is None or not can(session, ProbingSession):
            return None
        return cast(ProbingSession, session).start_probe()

    # ------------------------------------------------------------------ tables

    async def prepare(self, table: LibraryTable) -> None:
        """Have the session check ``table`` (``TableSession.prepare_table``), once per
        session; a session without the capability is taken as it is."""
        session = self.session
        if table in self._prepared or session is None or not can(session, TableSession):
            return
        await cast(TableSession, session).prepare_table(table)
        self._prepared.add(table)

    async def with_table(self, table: LibraryTable, call: Callable[[], Awaitable[T]]) -> T:
        """``call()`` with ``table`` prepared first; once more after checking it again if
        the table went missing since (dropped by an operator)."""
        await self.prepare(table)
        try:
            return await call()
        except Exception as exc:
            if not missing_table(exc):
                raise
        self._prepared.discard(table)
        await self.prepare(table)
        return await call()

    # ------------------------------------------------------------------ closing

    async def close(self) -> None:
        """Close the session, if any (which frees its locks on the server)."""
        session, self.session = self.session, None
        if session is not None:
            await self._close(session)

    async def _close(self, session: LockSession) -> None:
        await _close(session, self._log, self._fields)

    def abort(self) -> None:
        """Drop the session's connection synchronously (see
        [`AbortableSession`][pgleaderlock.backends.AbortableSession])."""
        session = self.session
        if session is not None and can(session, AbortableSession):
            try:
                cast(AbortableSession, session).abort()
            except Exception as exc:  # abort() must not raise; be defensive anyway
                self._log.warning("session_abort_failed", error=repr(exc), **self._fields)

    def watch(self, callback: Callable[[], None]) -> None:
        """Call ``callback`` once the idle session's socket becomes readable, if the
        session can be watched (any call on the session removes the watch)."""
        session = self.session
        if session is not None and can(session, WatchableSession):
            cast(WatchableSession, session).watch(callback)


async def _close(session: LockSession, log: StructuredLogger, fields: dict[str, Any]) -> None:
    try:
        async with asyncio.timeout(CLOSE_TIMEOUT_S):
            await session.close()
    except Exception as exc:  # close() must not raise; be defensive anyway
        log.warning("session_close_failed", error=repr(exc), **fields)
