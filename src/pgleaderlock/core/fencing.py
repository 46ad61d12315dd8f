"""Fencing tokens for a lock's leadership: the term, and ``fence()`` for transactions.

With ``LeaderLock(..., fencing=True)`` every acquisition increments the lock's term in a
table, on the lock's own session, before the lock is announced as LEADER. A transaction
on any connection calls [`fence`][pgleaderlock.LeaderLock.fence] first: it takes a
shared lock on the term row until the transaction ends and checks that the term is
still the one this process leads under. The next leader's increment needs that row, so
it waits for every fenced transaction of the old term to end: a transaction that passed
``fence()`` under term *t* and commits is ordered before every transaction that passes
``fence()`` under term *t + 1*.

The wait is bounded both ways. ``fence()`` never waits for a bump: it skips a row that a
bump has locked (and fails, as the term is moving on). A bump waits for the old term's
transactions for ``fencing_grace_s``, then ends their sessions: a frozen old leader, or
one cut off from the server, cannot keep the next leader out. To be found, a fenced
transaction marks itself with a shared transaction-level advisory lock on the key's
``int8`` form ([`fence_marker`][pgleaderlock.core.fencing.fence_marker]).
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from typing import Protocol

from .config import LockConfig, TermTable
from .errors import ConfigurationError, FencedError
from .machine import Machine
from .models import LockState
from .registry import fetch_row, fetch_row_sync

__all__ = [
    "Fencing",
    "check_term",
    "fence_marker",
    "fence_template",
    "fence_transaction",
    "fence_transaction_sync",
    "fence_values",
    "term_of",
]


def fence_marker(key1: int, key2: int) -> int:
    """The ``int8`` advisory key with which a fenced transaction marks itself:
    ``key1 << 32 | key2`` (``key2`` as unsigned 32 bits). ``pg_locks`` shows it as
    ``classid = key1, objid = key2, objsubid = 1`` (the lock itself: ``objsubid = 2``),
    so that the next leader finds the sessions whose fenced transactions hold the term
    row."""
    return (key1 << 32) | (key2 & 0xFFFFFFFF)


def fence_template(table: TermTable) -> str:
    """The lock's current term, with a shared lock on its row until the caller's
    transaction ends, and the transaction's marker (parameters: the two keys and
    [`fence_marker`][pgleaderlock.core.fencing.fence_marker]; see
    [`fence_values`][pgleaderlock.core.fencing.fence_values]).

    ``SKIP LOCKED``: a row that a term bump holds (a new leadership is beginning) is not
    waited for; no row comes back and the fence fails at once. The marker is taken with
    ``pg_try_advisory_xact_lock_shared``, which never waits either."""
    return (
        f"SELECT term, pg_catalog.pg_try_advisory_xact_lock_shared(({{2}})::int8)"
        f" FROM {table.sql} WHERE key1 = ({{0}})::int4 AND key2 = ({{1}})::int4"
        " FOR SHARE SKIP LOCKED"
    )


def fence_values(key1: int, key2: int) -> tuple[int, int, int]:
    """The parameters of [`fence_template`][pgleaderlock.core.fencing.fence_template]."""
    return key1, key2, fence_marker(key1, key2)


def term_of(row: tuple[object, ...] | None) -> int | None:
    """The term a fence row holds (``None``: no row, or no term)."""
    value = None if row is None else row[0]
    return None if value is None else int(value)  # type: ignore[call-overload]


def check_term(term: int, current: int | None, label: str) -> None:
    """Raise [`FencedError`][pgleaderlock.FencedError] unless the table still holds
    ``term`` (``current``) for the lock called ``label``."""
    if current is None:
        raise FencedError(
            f"{label}: the fencing term {term} could not be confirmed: its row is being "
            "bumped by a new leadership (or is gone), so this transaction must not commit "
            "(roll it back)"
        )
    if current != term:
        raise FencedError(
            f"{label}: the fencing term moved on from {term} to {current}: another leader "
            "began, so this transaction must not commit (roll it back)"
        )


async def fence_transaction(
    conn: object, table: TermTable, keys: tuple[int, int], term: int, label: str
) -> int:
    """The one fence: lock the row of ``keys`` in ``table`` for the transaction on
    ``conn`` and check that it still holds ``term`` (of the lock or name ``label``).

    Returns:
        ``term``.

    Raises:
        FencedError: the term moved on (or is being bumped): roll back.
        ConfigurationError: ``conn`` is not in a transaction, or of a kind no installed
            backend knows.
    """
    row = await fetch_row(conn, fence_template(table), fence_values(*keys))
    check_term(term, term_of(row), label)
    return term


def fence_transaction_sync(
    conn: object, table: TermTable, keys: tuple[int, int], term: int, label: str
) -> int:
    """[`fence_transaction`][pgleaderlock.core.fencing.fence_transaction] on a
    synchronous connection."""
    row = fetch_row_sync(conn, fence_template(table), fence_values(*keys))
    check_term(term, term_of(row), label)
    return term


class _Lock(Protocol):
    """What the fencing methods use of a [`LeaderLock`][pgleaderlock.LeaderLock]."""

    _config: LockConfig
    _machine: Machine
    _key1: int
    _key2: int

    @property
    def label(self) -> str: ...
    @property
    def state(self) -> LockState: ...
    @property
    def term(self) -> int | None: ...
    def _fencing(self) -> tuple[TermTable, int]: ...
    async def fence(self, conn: object) -> int: ...


class Fencing:
    """The fencing part of [`LeaderLock`][pgleaderlock.LeaderLock]'s API."""

    @property
    def term(self: _Lock) -> int | None:
        """With ``fencing=True``: the fencing token of the current leadership, strictly
        increasing per lock across all processes (also after a server restart or a
        failover); ``None`` when not LEADER or without fencing."""
        return self._machine.term

    async def fence(self: _Lock, conn: object) -> int:
        """Fence the caller's transaction on ``conn``: call it inside the transaction,
        first (before its writes, and before the reads they depend on); the transaction
        may commit only if this returns.

        It takes a shared lock on the lock's term row until the transaction ends, so the
        next leader's term bump waits for this transaction, and a transaction fenced
        here can never commit after a later term began.

        Args:
            conn: a psycopg ``AsyncConnection``, an asyncpg ``Connection``, or a
                SQLAlchemy ``AsyncConnection`` or ``AsyncSession``, in a transaction.

        Returns:
            The term the transaction runs under.

        Raises:
            FencedError: this lock is not LEADER, or its term has moved on: roll back.
            ConfigurationError: the lock has no fencing, or ``conn`` is not in a
                transaction, or of a kind no installed backend knows.
        """
        table, term = self._fencing()
        return await fence_transaction(conn, table, (self._key1, self._key2), term, self.label)

    @contextlib.asynccontextmanager
    async def fenced(self: _Lock, conn: object) -> AsyncIterator[int]:
        """``async with lock.fenced(conn) as term:``: [`fence`][pgleaderlock.LeaderLock.fence]
        on entry; the caller's transaction then commits or rolls back as usual."""
        yield await self.fence(conn)

    def fence_sync(self: _Lock, conn: object) -> int:
        """[`fence`][pgleaderlock.LeaderLock.fence] for a synchronous connection (psycopg
        ``Connection``), from any thread: what the threaded lock uses."""
        table, term = self._fencing()
        return fence_transaction_sync(conn, table, (self._key1, self._key2), term, self.label)

    def _fencing(self: _Lock) -> tuple[TermTable, int]:
        table = self._config.term_table
        if table is None:
            raise ConfigurationError("fence() needs LeaderLock(..., fencing=True)")
        term = self.term
        if term is None:
            raise FencedError(f"{self.label} is not leader (state {self.state.value})")
        return table, term
