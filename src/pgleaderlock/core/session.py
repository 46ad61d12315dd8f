"""The contract between the core and a database backend.

A [`LockSession`][pgleaderlock.LockSession] is one dedicated database session that the
lifecycle task owns alone. Backends implement it with thin I/O adapters: no retries, no
timers, no policy. The core bounds every call with a timeout and closes a session after any
call that was interrupted (a ``pg_try_advisory_lock`` cut off by a timeout may still have
been granted on the server: only closing the session makes sure the lock is not left
behind).

This module is the home of these types; backend authors import them from
``pgleaderlock.backends``, their public interface, together with the shared base.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Mapping
from contextlib import AbstractAsyncContextManager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

if TYPE_CHECKING:
    from .config import LibraryTable, TermTable

__all__ = [
    "DEFAULT_CLAIM_S",
    "AbortableSession",
    "Backend",
    "BoundedWaitSession",
    "ConnectOptions",
    "FencedSessions",
    "FencingSession",
    "KeepAliveSession",
    "LockSession",
    "ProbingSession",
    "QuerySession",
    "Row",
    "SessionFactory",
    "SessionInfo",
    "SetupSession",
    "SocketSession",
    "TableSession",
    "TransportSession",
    "WaitingSession",
    "WatchableSession",
]


DEFAULT_CLAIM_S = 1.0
"""[`ConnectOptions.claim_s`][pgleaderlock.backends.ConnectOptions] with the default
timings (see [`claim_bound`][pgleaderlock.core.config.claim_bound])."""


@runtime_checkable
class LockSession(Protocol):
    """One dedicated session holding (or trying to hold) one advisory lock.

    Every method may raise [`ConnectionError`][pgleaderlock.ConnectionError] (the session is dead
    or unusable) or [`LockError`][pgleaderlock.LockError]. Implementations translate their
    driver's exceptions into those, with the driver's exception as ``__cause__``.
    """

    @property
    def backend_pid(self) -> int | None:
        """The server process id of this session, or ``None`` when not known."""
        ...

    async def try_lock(self, key1: int, key2: int) -> bool:
        """``pg_try_advisory_lock(key1, key2)``: True if granted now, False if held elsewhere."""
        ...

    async def unlock(self, key1: int, key2: int) -> bool:
        """``pg_advisory_unlock(key1, key2)``: True if this session held the lock."""
        ...

    async def holds(self, key1: int, key2: int) -> bool:
        """The health probe: does *this* session still hold the lock (``pg_locks``)?

        Raises if the session is dead. A bare ``SELECT 1`` is not enough: it cannot tell
        that a pooler moved the session to another server backend. It asks every time;
        a session that can also probe more cheaply offers that as ``ProbingSession``,
        which the core uses once ``holds()`` has confirmed the lock.
        """
        ...

    async def close(self) -> None:
        """Close the session (which frees its locks). Idempotent, bounded, never raises.

        It must drop the connection even if the awaiting task is cancelled.
        """
        ...


@runtime_checkable
class WaitingSession(Protocol):
    """Optional capability: wait on the server for the lock (fast failover).

    A follower that waits in ``pg_advisory_lock`` is granted the lock the instant the
    holder's session ends, instead of at its next poll.
    """

    async def wait_lock(self, key1: int, key2: int, timeout_s: float) -> bool:
        """Wait on the server until the lock is granted (True) or ``timeout_s`` passes.

        One round trip: ``SELECT set_config('lock_timeout', '<ms>', true),
        pg_advisory_lock(key1, key2), pg_backend_pid()``; a ``lock_not_available``
        error (SQLSTATE 55P03) means the wait timed out and returns False. ``timeout_s``
        is always > 0 (a zero lock_timeout would mean "wait forever").

        The server may grant the lock while nobody reads the answer (the caller's
        process stopped, its event loop blocked): a session that can, bounds that with
        ``ConnectOptions.claim_s`` (the grant sets a short ``idle_session_timeout``,
        and returning True first replaces it by the lease).
        """
        ...


@runtime_checkable
class BoundedWaitSession(Protocol):
    """Optional capability: a wait on the server that never outlives its call.

    [`WaitingSession.wait_lock`][pgleaderlock.backends.WaitingSession.wait_lock] may go
    on waiting on the server after it returned False (the next call for the same lock
    waits on). This wait leaves the server's queue when it returns, free to ask for
    another lock afterwards, but ends in a ``lock_timeout`` (an ERROR line in the
    server's log). The library's own locks no longer use it: a
    [`Semaphore`][pgleaderlock.Semaphore]'s followers wait in one piece too (issue 33).
    """

    async def wait_lock_once(self, key1: int, key2: int, timeout_s: float) -> bool:
        """Wait on the server until the lock is granted (True) or ``timeout_s`` passes
        (False; the wait has ended on the server too): one ``pg_advisory_lock`` under a
        ``lock_timeout`` of ``timeout_s``, claimed as ``wait_lock`` claims a grant. A
        wait of ``wait_lock`` still in flight is dropped first (with the session)."""
        ...


@runtime_checkable
class WatchableSession(Protocol):
    """Optional capability: notice at once that the server ended an idle session.

    A terminated backend or a server shutdown sends a FATAL message and closes the
    socket; watching the idle socket turns that into a wake-up within milliseconds
    instead of at the next health probe.
    """

    def watch(self, callback: Callable[[], None] | None) -> None:
        """Call ``callback`` once, as soon as the idle session's socket becomes readable
        (data or EOF). ``None`` removes the watch.

        Any other call on the session (a query, ``close()``) removes the watch first, so
        that it never competes with the driver for the socket; the core arms it again
        after each successful probe. ``callback`` runs in the event loop and must only
        set a flag or an event.
        """
        ...


@runtime_checkable
class AbortableSession(Protocol):
    """Optional capability: drop the connection at once, synchronously.

    The core calls ``abort()`` right before it cancels a call that timed out or that a
    stop request interrupts, so that the driver's own cancellation handling (psycopg
    cancels the query on the server and waits for that, up to seconds) finds nothing
    left to wait for. The server frees the session's locks when it sees the connection
    close. ``close()`` is still called afterwards.
    """

    def abort(self) -> None:
        """Close the socket now, with no network wait. Idempotent, never raises."""
        ...


@dataclass(frozen=True)
class SessionInfo:
    """What a new session found out about itself, for the core's checks.

    Attributes:
        backend_pid: ``pg_backend_pid()``: the server process that runs its statements.
        protocol_pid: the process id the protocol reported at connect (psycopg's
            ``info.backend_pid``, asyncpg's ``get_server_pid()``). A pooler reports one
            of its own, so the two differ behind PgBouncer (in every pool mode) and are
            equal on a direct connection.
        in_recovery: ``pg_is_in_recovery()``: the server is a standby.
        lease_supported: the server has ``idle_session_timeout`` (PostgreSQL 14 and
            later), so a session granted a lock can carry the lock's lease
            ([`ConnectOptions.lease_s`][pgleaderlock.backends.ConnectOptions]).
        shared_stats: the server keeps statistics in shared memory (PostgreSQL 15 and
            later), flushed by an idle backend now or by a timer later.
    """

    backend_pid: int
    protocol_pid: int | None
    in_recovery: bool
    lease_supported: bool = True
    shared_stats: bool = False

    @property
    def behind_pooler(self) -> bool:
        """The protocol's pid is not the server backend's: a pooler sits in between."""
        return self.protocol_pid is not None and self.protocol_pid != self.backend_pid


@runtime_checkable
class SetupSession(Protocol):
    """Optional capability: say who serves the session, then prepare it, before its
    first lock call.

    The core calls ``identify()`` right after the session is opened (or returned by
    ``connect_fn``), checks what it reports (a standby is refused with
    [`StandbyError`][pgleaderlock.StandbyError]; behind a pooler, a second session is
    opened to tell session mode, accepted, from transaction or statement mode, refused
    with [`SessionNotDedicatedError`][pgleaderlock.SessionNotDedicatedError]), and only
    then calls ``configure()``.
    """

    async def identify(self, options: ConnectOptions | None = None) -> SessionInfo:
        """Roll back an open transaction, switch to autocommit, and report what the
        server says about this session. Later calls return the same answer. With
        ``options``, a session that is plainly direct (its protocol pid is its backend
        pid) on a primary may get its settings in the same round trip."""
        ...

    async def configure(self, options: ConnectOptions) -> None:
        """Apply ``options.server_settings`` and ``application_name`` for the whole
        session, in a way a session-mode pooler accepts (``set_config``, not startup
        parameters)."""
        ...

    async def backend_now(self) -> int:
        """Ask ``pg_backend_pid()`` again; raise
        [`SessionNotDedicatedError`][pgleaderlock.SessionNotDedicatedError] if it is
        not the session's backend any more."""
        ...


@runtime_checkable
class ProbingSession(Protocol):
    """Optional capability: the periodic health probe, started without a task.

    An idle leader probes every ``health_interval_s``; with a thousand leaders in one
    process that is hundreds of probes a second, and a task per probe is a large part of
    their client cost. A session that can start its probe as a plain future lets the core
    await it directly.
    """

    def start_probe(self) -> asyncio.Future[None] | None:
        """Start the cheap probe and return a future that resolves once the session's own
        backend has answered: it proves that the session lives on the same backend, on a
        primary, not that it holds the lock. The core calls it only once a ``holds()``
        since the lock's last grant said the lock stays with the session (the choice is
        the core's). The future fails with a library error
        ([`ConnectionError`][pgleaderlock.ConnectionError] when the session is gone),
        ``start_probe`` never raises itself and leaves the watch (``watch()``) armed. A
        future cancelled before it resolves leaves the session unusable: the caller
        aborts it.

        Returns ``None`` when the session cannot start such a probe now: the core then
        calls ``holds()``.
        """
        ...


@runtime_checkable
class KeepAliveSession(Protocol):
    """Optional capability: show the server that the client lives, asking nothing.

    A session granted a lock carries the lock's lease (``idle_session_timeout``): the
    server ends it when the client stays silent for ``lease_s``. While the lifecycle task
    awaits slow callbacks it does not probe; it keeps the lease with this instead, so
    that only a client whose event loop stops loses the lock to its lease.
    """

    def keep_alive(self) -> asyncio.Future[None] | None:
        """Send the server something it answers at once (a protocol ``Sync``, or the
        cheapest statement) and return a future of the answer; it fails once the session
        is gone, never raises itself. ``None``: not possible now. A future cancelled
        before it resolves leaves the session unusable: the caller aborts it."""
        ...


@runtime_checkable
class TransportSession(Protocol):
    """Optional capability: tell a slow server from a silent network.

    When a health probe is late, the core asks whether the server has acknowledged
    everything the session sent (TCP). If it has, the path works and the server will
    not drop the session for silence, so the lock is kept while the answer is awaited
    (not LEADER meanwhile); if it has not, or it cannot be told, the session is treated
    as lost at once.
    """

    def acknowledged(self) -> bool | None:
        """True if the server acknowledged all sent data (or the session is a unix
        socket); False if not; None if unknown."""
        ...


@runtime_checkable
class SocketSession(Protocol):
    """Optional capability: the descriptor of the session's socket.

    Not used by the lock itself. A process that runs work for the lock's holder and
    must not outlive it (``pgleaderlock exec``'s keeper) holds a duplicate of it: the
    server sees the connection close, and frees the lock, only once every descriptor of
    the socket is closed, so no longer before that process has ended.
    """

    def fileno(self) -> int:
        """The socket's file descriptor (owned by the driver: never close it), or -1
        when it is not known or the session is closed."""
        ...


@runtime_checkable
class TableSession(Protocol):
    """Optional capability, needed for ``Fencing(enabled=True)`` and by a
    [`Coordinator`][pgleaderlock.Coordinator]: check one of the library's tables before
    using it. The core calls it once per session and table."""

    async def prepare_table(self, table: LibraryTable) -> None:
        """Make sure the session may use one of the library's tables: create it if
        missing (and allowed; ``table.create``), make it again if the session's role
        owns it and it is not safe (``table.unsafe``), refuse one another role owns or
        that is not safe ([`UntrustedObjectError`][pgleaderlock.UntrustedObjectError])
        or that the role lacks privileges on
        ([`MissingPrivilegeError`][pgleaderlock.MissingPrivilegeError]). It checks every
        time it is called: remembering what was checked is the core's."""
        ...


@runtime_checkable
class QuerySession(Protocol):
    """Optional capability, needed by a [`Scheduler`][pgleaderlock.schedule.Scheduler]:
    run one of the library's own statements on the lock's session, which holds the lock
    (a schedule's slot is claimed there, so only the leader's session can claim it)."""

    async def query(self, template: str, values: tuple[object, ...]) -> list[tuple[Any, ...]]:
        """Every row of ``template`` (parameters numbered ``{0}``, ``{1}``, ..., each with
        an explicit cast) with ``values``, in autocommit. The template is one of the
        library's (schema-qualified, trusted tables): never the user's SQL."""
        ...


@runtime_checkable
class FencingSession(Protocol):
    """Optional capability, needed for ``Fencing(enabled=True)``: bump the lock's fencing term."""

    async def bump_term(self, table: TermTable, key1: int, key2: int, wait_s: float) -> int | None:
        """Increment the lock's term in ``table`` (created if missing) on this session,
        which holds the lock, and return the new term. The statement commits durably
        (``synchronous_commit=on``) and waits for every transaction that holds the term
        row (``fence()``'s shared row lock) to end, for at most ``wait_s``: ``None`` if
        they still hold it then (nothing was changed). The term's high 32 bits are the
        server's timeline, so that two primaries after a split never hand out the same
        term."""
        ...

    async def end_fenced(self, table: TermTable, keys: list[tuple[int, int]]) -> FencedSessions:
        """End the sessions whose transactions passed ``fence()`` for any of ``keys``
        and still hold their term rows: fenced transactions of an older term, kept open
        by a frozen or partitioned old leader, which fencing rolls back anyway. Only the
        sessions this role may end are ended (its own role's; any but a superuser's with
        ``pg_signal_backend``); the others are reported."""
        ...


@dataclass(frozen=True)
class FencedSessions:
    """What [`FencingSession.end_fenced`][pgleaderlock.backends.FencingSession] did.

    Attributes:
        ended: the server pids of the sessions ended (``pg_terminate_backend``).
        refused: ``(pid, role)`` of the sessions this role may not end: they keep the
            new term waiting until their transactions end.
    """

    ended: tuple[int, ...] = ()
    refused: tuple[tuple[int, str], ...] = ()


Row = tuple[Any, ...]
"""A row a statement returned."""

SessionFactory = Callable[[], Awaitable[object]]
"""``connect_fn``: returns a [`LockSession`][pgleaderlock.LockSession] or a raw driver
connection to wrap."""


@dataclass(frozen=True)
class ConnectOptions:
    """What the core asks of every new session.

    Attributes:
        application_name: identifies the holder in ``pg_stat_activity``.
        connect_timeout_s: the driver's own connect timeout (the core adds its own too).
        server_settings: session settings (GUCs) to set at connect time, e.g. the
            server-side TCP keepalives that bound a partitioned leader's lock.
        lease_s: the lease: once a lock call grants this session a lock, the session
            carries ``idle_session_timeout`` of this many seconds, so that the server
            ends it (and frees its locks) when the client stops probing it (a blocked
            event loop, a frozen process). 0: no lease. The built-in adapters set it in
            the lock statement itself (see [`TRY_LOCK`][pgleaderlock.backends.TRY_LOCK]).
        claim_s: the claim: a lock granted by a wait on the server (``wait_lock``: the
            session was queued, and the grant came when the holder left, not when the
            client asked) carries ``idle_session_timeout`` of only this many seconds
            (at most ``lease_s``), until the session has read the grant and claimed it
            (then the lease). A waiter whose process is stopped, or whose event loop is
            blocked, when it is granted the lock is ended within ``claim_s``, and the
            next waiter leads, instead of a lease later. 0: no
            claim (the grant carries the lease at once). The built-in adapters set it in
            [`WAIT_LOCK`][pgleaderlock.backends.WAIT_LOCK] and claim with
            [`CLAIM`][pgleaderlock.backends.CLAIM].
    """

    application_name: str
    connect_timeout_s: float
    server_settings: Mapping[str, str] = field(default_factory=dict)
    lease_s: float = 0.0
    claim_s: float = DEFAULT_CLAIM_S


@dataclass(frozen=True)
class Backend:
    """A driver adapter, as registered in the ``pgleaderlock.backends`` entry-point group.

    Attributes:
        name: the name users pass as ``backend=``.
        connect: opens a new dedicated session for a DSN.
        wrap: adapts a raw driver connection returned by ``connect_fn``, or returns
            ``None`` if the object is not one of this driver's connections.
        check_dsn: raises [`ConfigurationError`][pgleaderlock.ConfigurationError] for a DSN
            the driver cannot parse (called once, before any I/O).
        claims: for backends that connect with something other than a DSN string
            (a SQLAlchemy ``AsyncEngine``): True if this object is theirs.
        fetch_row: ``(conn, template, values)``: run one statement on a connection of the
            caller's, inside the caller's transaction (``fence()``, checkpoints): the
            template numbers its parameters ``{0}``, ``{1}``, ...; an awaitable of the
            first row (``None`` without one), or ``None`` (not an awaitable) when
            ``conn`` is not one of this driver's connections. Raises
            [`ConfigurationError`][pgleaderlock.ConfigurationError] outside a transaction.
        fetch_row_sync: the same for a synchronous connection (the threaded lock); its
            row comes wrapped in a 1-tuple, so that "no row" and "not mine" differ.
        connect_error: ``(exc) -> error or None``: the library error for a driver error
            raised while connecting outside the adapter (inside a ``connect_fn``), e.g.
            [`ServerRefusedError`][pgleaderlock.ServerRefusedError] for a wrong
            password; ``None`` when ``exc`` is not this driver's.
        transaction: ``(conn) -> context manager or None``: ``async with`` it runs a
            transaction on a connection of the caller's (a savepoint when one is open
            already); ``None`` when ``conn`` is not this driver's.
        connect_budget: ``(dsn, connect_timeout_s) -> seconds``: the longest ``connect``
            may take for this DSN when each host gets its own attempt of
            ``connect_timeout_s`` (or the DSN's own ``connect_timeout``). ``None``: one
            attempt, ``connect_timeout_s``.
    """

    name: str
    connect: Callable[[Any, ConnectOptions], Awaitable[LockSession]]
    wrap: Callable[[object], LockSession | None]
    check_dsn: Callable[[Any], None]
    claims: Callable[[object], bool] | None = None
    connect_budget: Callable[[Any, float], float] | None = None
    fetch_row: Callable[[object, str, tuple[object, ...]], Awaitable[Row | None] | None] | None = (
        None
    )
    fetch_row_sync: Callable[[object, str, tuple[object, ...]], tuple[Row | None] | None] | None = (
        None
    )
    connect_error: Callable[[BaseException], Exception | None] | None = None
    transaction: Callable[[object], AbstractAsyncContextManager[object] | None] | None = None
