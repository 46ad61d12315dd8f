"""What every built-in adapter shares: the session's calls, the row and pid checks.

An adapter subclasses [`BaseSession`][pgleaderlock.backends.BaseSession] and writes only
driver calls: how to run one of the four statements (``_fetch``), how to close the
connection, how to watch its socket, and which library error a driver error stands for
(``_classify``, usually one lookup in a table). ``try_lock``, ``unlock``, ``holds``,
``wait_lock``, ``watch``, ``abort`` and ``close`` are written once, below it.

Every statement also returns ``pg_backend_pid()``: a session whose server backend
changes between statements is behind a transaction-mode pooler, where a session-level
advisory lock is held by whichever server connection ran the statement. Such a session
is refused ([`SessionNotDedicatedError`][pgleaderlock.SessionNotDedicatedError]).

``BaseSession`` is built in layers, one idea to a module, each importable from here:
``pgleaderlock.backends.checked`` (the session base: the driver calls, the checked row,
the setup statements, the probes, the connection's end), ``pgleaderlock.backends.locking``
(the lock calls, the wait on the server and its claim), and this module (the library's
tables, fencing terms, many locks and notifications, for fencing, the schedule's ledger
and a Coordinator). The socket checks live in ``pgleaderlock.backends.sockets``, the SQL
in ``pgleaderlock.backends.sql``, the error translation in
``pgleaderlock.backends.errors``; this module re-exports them. It imports no driver. A
third-party backend may build on it (import it as ``pgleaderlock.backends.base``, or the
same names from ``pgleaderlock.backends``), or use only the statements and
[`translate`][pgleaderlock.backends.translate].
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import functools
import sys
from collections.abc import Sequence
from typing import Any, TypeVar, cast

from ..lowlevel import (
    Backend,
    BumpedTerm,
    ConnectionError,
    FencedSessions,
    LibraryTable,
    MissingPrivilegeError,
    PgLeaderLockError,
    TableCheck,
    TermTable,
)
from ..lowlevel import ConnectOptions as ConnectOptions
from ..lowlevel import SessionInfo as SessionInfo
from ..lowlevel import SessionNotDedicatedError as SessionNotDedicatedError
from ..lowlevel import StandbyError as StandbyError
from ..lowlevel import UnclaimedGrantError as UnclaimedGrantError
from ..lowlevel import key_to_oid as key_to_oid
from . import errors, sql
from .checked import CheckedSession
from .errors import *  # noqa: F403  # re-exported (errors.__all__): backends import them from here
from .errors import sqlstate, translate
from .locking import LockingSession
from .sockets import set_keepalive, tcp_acknowledged
from .sql import *  # noqa: F403  # re-exported (sql.__all__): backends import them from here
from .sql import (
    DUPLICATE_TABLE,
    GROUP_SNAPSHOT,
    LOCK_NOT_AVAILABLE,
    NOTIFY,
    TABLE_CHECK,
    TRY_LOCK_MANY,
    UNLOCK_MANY,
    Statement,
    _bump_many_statement,
    _bump_statement,
    _end_fenced_statement,
    lock_timeout_ms,
)

T = TypeVar("T")

__all__ = ["BaseSession", "CheckedSession", "LockingSession", "set_keepalive", "tcp_acknowledged"]
__all__ += errors.__all__
__all__ += sql.__all__


def module_backend(module_name: str) -> Backend:
    """The [`Backend`][pgleaderlock.Backend] a driver module declares with its own
    functions, each named as the field it fills: ``connect``, ``wrap``, ``check_dsn``,
    and those of ``claims``, ``connect_budget``, ``fetch_row``, ``fetch_row_sync``,
    ``connect_error`` and ``transaction`` it defines; named after the module
    (``pgleaderlock.backends.asyncpg``: ``"asyncpg"``). The built-in adapters end with
    ``backend = module_backend(__name__)``."""
    module = sys.modules[module_name]
    fields = [field.name for field in dataclasses.fields(Backend) if field.name != "name"]
    found = {name: getattr(module, name) for name in fields if hasattr(module, name)}
    return Backend(name=module_name.rpartition(".")[2], **found)


class BaseSession(LockingSession):
    """A [`LockSession`][pgleaderlock.LockSession] with every optional capability
    (``wait_lock``, ``watch``, ``abort``), written once over a few driver calls.

    A subclass implements:

    - `_fetch`: run a [`Statement`][pgleaderlock.backends.Statement] with its values and
      return its row; when the call is cancelled, drop the connection without a network wait
      (and, for [`WAIT_LOCK`][pgleaderlock.backends.WAIT_LOCK], first ask the server to
      cancel it, within [`CANCEL_TIMEOUT_S`][pgleaderlock.backends.CANCEL_TIMEOUT_S]) and
      re-raise.
    - `_classify`: the library error a driver error stands for.
    - `_closed`, `_abort`, `_close`: the connection's state and how to drop it (at once) or
      close it (bounded).
    - optionally `_arm` and `_disarm`: start and stop listening for the server ending the
      idle session; `_fire` is the listener.

    Every statement's row is checked here (the value first, ``pg_backend_pid()`` last) and
    so is the pid ([`check_pid`][pgleaderlock.backends.check_pid]); driver errors are
    translated with [`translate`][pgleaderlock.backends.translate].
    """

    # ------------------------------------------------ the library's tables, fencing

    async def prepare_table(self, table: LibraryTable) -> None:
        """Make sure this session may use ``table`` (``TableSession``): create it if it
        is missing and the role may (``table.create``), or make it again when the
        session's own role owns it and it is not as it must be (``table.unsafe``: the
        participants table's row-level security); then check that it is a plain table
        that a trusted role owns, in a schema a trusted role owns, that it is safe, and
        that the role has the privileges it needs. It checks at every call (the core
        calls it once per session).

        Raises:
            UntrustedObjectError: the table (or its schema) is another role's, or not a
                plain table: it is not used.
            MissingPrivilegeError: the role may not create it, or lacks a privilege on
                it; the message has the statement that mends it.
            ConfigurationError: the schema does not exist.
        """
        check = await self._check_table(table)
        if check.relkind is None and check.schema_owner is not None and check.schema_trusted:
            if not (check.schema_usage and check.schema_create):
                raise MissingPrivilegeError(check.cannot_create())
            await self.run_ddl(table.create)
            check = await self._check_table(table)
        elif check.owner == check.role and check.schema_trusted and table.unsafe(check):
            # The session's own table, made by an earlier version or changed since (its
            # row-level security): made as it must be again (``table.create`` is
            # idempotent), then checked again; what it cannot mend is refused below.
            await self.run_ddl(table.create)
            check = await self._check_table(table)
        check.verify()

    async def _check_table(self, table: LibraryTable) -> TableCheck:
        values = (table.schema, table.name, list(table.trusted_roles))
        row = await self._row(TABLE_CHECK, values)
        return TableCheck.of(table, row)

    async def run_ddl(self, sql: str) -> None:
        """Run a ``CREATE ... IF NOT EXISTS``; losing a race with another creator (which
        PostgreSQL may report as a duplicate) is fine."""
        if self._watch is not None:
            self.watch(None)
        try:
            await self._execute_ddl(sql)
        except Exception as exc:
            cls = self._classify(exc)
            if cls is None:
                raise
            if sqlstate(exc) not in DUPLICATE_TABLE:
                raise translate(exc, "create table", cls) from exc

    async def bump_term(self, table: TermTable, key1: int, key2: int, wait_s: float) -> int | None:
        """Increment the lock's fencing term (``FencingSession``), waiting at most
        ``wait_s`` for fenced transactions of older terms (``None`` after that). The
        core has the table checked first (``prepare_table``)."""
        info = self._info or await self.identify()
        values = (key1, key2, info.backend_pid, lock_timeout_ms(wait_s))
        row = await self._bumped(table, _bump_statement(table), values)
        if row is None:
            return None
        term, prior, prior_at = row[:3]
        if not isinstance(term, int) or not isinstance(prior, int | None):
            raise ConnectionError(f"fencing term: unexpected result {row[:3]!r}")
        at = prior_at if isinstance(prior_at, dt.datetime) else None
        return BumpedTerm(term, prior, at)

    async def _bumped(
        self, table: TermTable, statement: Statement, values: tuple[Any, ...]
    ) -> tuple[object, ...] | None:
        """Run a term bump: its row, or ``None`` when its wait for the term rows ended
        in ``lock_timeout``."""
        try:
            return await self._row(statement, values)
        except PgLeaderLockError as exc:
            if sqlstate(exc.__cause__) == LOCK_NOT_AVAILABLE and not self._closed():
                return None
            raise

    async def end_fenced(self, table: TermTable, keys: list[tuple[int, int]]) -> FencedSessions:
        """End the fenced transactions of older terms that hold the term rows of
        ``keys`` (``FencingSession``; see
        [`end_fenced_statement`][pgleaderlock.backends.sql.end_fenced_statement])."""
        firsts, seconds = [k[0] for k in keys], [k[1] for k in keys]
        row = await self._row(_end_fenced_statement(table), (firsts, seconds))
        ended, refused, roles = (cast(list[Any] | None, value) or [] for value in row[:3])
        return FencedSessions(
            tuple(int(pid) for pid in ended),
            tuple((int(pid), str(role)) for pid, role in zip(refused, roles, strict=True)),
        )

    # ------------------------------------------------ many locks (GroupSession)

    async def try_lock_many(self, keys: list[tuple[int, int]]) -> list[tuple[int, int]]:
        """``pg_try_advisory_lock`` for each of ``keys``: those granted now."""
        if not keys:
            return []
        info = self._info or await self.identify()
        firsts, seconds = [k[0] for k in keys], [k[1] for k in keys]
        values = (firsts, seconds, info.backend_pid, self._token, self._lease_ms)
        row = await self._row(TRY_LOCK_MANY, values)
        positions = cast(list[int] | None, row[0]) or []
        return [keys[i - 1] for i in positions]

    async def unlock_many(self, keys: list[tuple[int, int]]) -> int:
        """``pg_advisory_unlock`` for each of ``keys``: how many this session held."""
        if not keys:
            return 0
        info = self._info or await self.identify()
        firsts, seconds = [k[0] for k in keys], [k[1] for k in keys]
        row = await self._row(UNLOCK_MANY, (firsts, seconds, info.backend_pid, self._token))
        return int(cast(int, row[0]))

    async def bump_terms(
        self, table: TermTable, keys: list[tuple[int, int]], wait_s: float
    ) -> dict[tuple[int, int], int] | None:
        """Increment the fencing terms of ``keys`` (held by this session): key -> term
        (a ``BumpedTerm``, with the row's previous term); ``None`` when fenced
        transactions of older terms still hold a row after ``wait_s`` (no term
        changed)."""
        if not keys:
            return {}
        info = self._info or await self.identify()
        firsts, seconds = [k[0] for k in keys], [k[1] for k in keys]
        values = (firsts, seconds, info.backend_pid, lock_timeout_ms(wait_s))
        row = await self._bumped(table, _bump_many_statement(table), values)
        if row is None:
            return None
        k1s, k2s, terms, priors = (cast(list[int] | None, value) or [] for value in row[:4])
        ats = cast(list[dt.datetime | None] | None, row[4]) or [None] * len(terms)
        if len(priors) != len(terms):
            raise ConnectionError(f"fencing term: unexpected result {row[:5]!r}")
        return {
            (a, b): BumpedTerm(t, p, at)
            for a, b, t, p, at in zip(k1s, k2s, terms, priors, ats, strict=True)
        }

    async def group_snapshot(self, prefix: str, trusted_roles: Sequence[str] = ()) -> list[Any]:
        """The sessions named ``prefix...`` and every two-key advisory lock, each with
        whether its role is trusted (see
        [`GROUP_SNAPSHOT`][pgleaderlock.backends.sql.GROUP_SNAPSHOT])."""
        values = (prefix, list(trusted_roles))
        rows: list[Any] = await self._translated(
            GROUP_SNAPSHOT.what, self._fetch_all(GROUP_SNAPSHOT, values)
        )
        return rows

    async def notify(self, channel: str, payload: str) -> None:
        """``pg_notify(channel, payload)``."""
        await self._row(NOTIFY, (channel, payload))

    async def listen(self, channel: str) -> None:
        """``LISTEN channel``: from now on `notifications` returns its payloads."""
        await self._translated("listen", self._listen(channel))

    async def notifications(self, timeout_s: float) -> list[tuple[int, str]]:
        """The notifications received on the channels listened to, as (the sending
        backend's pid, payload): those already in, or else the first to come within
        ``timeout_s`` (an empty list if none). Raises once the session is lost."""
        received: list[tuple[int, str]] = await self._translated("listen", self._receive(timeout_s))
        return received

    async def query(self, template: str, values: tuple[object, ...]) -> list[tuple[Any, ...]]:
        """Every row of one of the library's statements (``QuerySession``; a schedule's
        ledger), run in autocommit on this session."""
        statement = _query_statement(template)
        rows = await self._translated(statement.what, self._fetch_all(statement, values))
        return [tuple(row) for row in rows]


@functools.lru_cache(maxsize=256)
def _query_statement(template: str) -> Statement:
    """One ``Statement`` per template, so that a driver that prepares statements
    (asyncpg) prepares each once per session."""
    return Statement("ledger", template)
