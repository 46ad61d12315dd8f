"""Fencing tokens for a lock's leadership: the term, the leadership that work runs under,
and ``fence()`` for transactions.

With ``Fencing(enabled=True)`` every acquisition increments the lock's term in a
table, on the lock's own session, before the lock is announced as LEADER. A transaction
on any connection calls [`fence`][pgleaderlock.LeaderLock.fence] first: it takes a
shared lock on the term row until the transaction ends, and the server checks that the
row still holds the term the work runs under (it refuses the statement otherwise, which
aborts the transaction). The next leader's increment needs that row, so it waits for
every fenced transaction of the old term to end: a transaction that passed ``fence()``
under term *t* and commits is ordered before every transaction that passes ``fence()``
under term *t + 1*.

**A fence follows the leadership, not the process.** Work begun under term *t* fences
with *t* ([`Leadership`][pgleaderlock.Leadership]), even if it fences after this
process lost the lock and leads again under a later term: it is refused then. The
leader-work entry points (leader tasks, scheduled jobs, the APScheduler helpers) bind
the leadership they start under to a context variable, which the tasks and threads
they start inherit; ``lock.leadership()`` binds one explicitly.

The wait is bounded both ways. ``fence()`` never waits for a bump: it fails at once on a
row that a bump has locked (``NOWAIT``: the term is moving on). A bump waits for the old
term's transactions for ``fencing_grace_s``, then ends their sessions: a frozen old
leader, or one cut off from the server, cannot keep the next leader out. To be found, a
fenced transaction marks itself with a shared transaction-level advisory lock on the
key's ``int8`` form ([`fence_marker`][pgleaderlock.core.fencing.fence_marker]).
"""

from __future__ import annotations

import contextlib
import contextvars
import re
from collections.abc import AsyncIterator, Callable, Iterator
from typing import Protocol, Self

from .config import LockConfig, TermTable
from .errors import ConfigurationError, FencedError, sqlstate
from .machine import Machine
from .models import LockState
from .registry import fetch_row, fetch_row_sync

__all__ = [
    "Fencing",
    "Leadership",
    "bound_leadership",
    "check_term",
    "fence_marker",
    "fence_template",
    "fence_transaction",
    "fence_transaction_sync",
    "fence_values",
    "refused_term",
    "term_of",
    "unbound",
]


def fence_marker(key1: int, key2: int) -> int:
    """The ``int8`` advisory key with which a fenced transaction marks itself:
    ``key1 << 32 | key2`` (``key2`` as unsigned 32 bits). ``pg_locks`` shows it as
    ``classid = key1, objid = key2, objsubid = 1`` (the lock itself: ``objsubid = 2``),
    so that the next leader finds the sessions whose fenced transactions hold the term
    row."""
    return (key1 << 32) | (key2 & 0xFFFFFFFF)


REFUSAL = "pgleaderlock: fenced: the term is "
"""How the server's refusal of a fence whose term has moved on begins (see
[`fence_template`][pgleaderlock.core.fencing.fence_template])."""

_REFUSED = re.compile(re.escape(REFUSAL) + r"(\d+), not (\d+)")

ROW_LOCKED = "55P03"
"""``lock_not_available``: the fence's ``NOWAIT`` found the term row locked by a term
bump (a new leadership is beginning)."""


def fence_template(table: TermTable) -> str:
    """Lock the lock's term row (a shared lock, until the caller's transaction ends),
    mark the transaction, and check **on the server** that the row holds the term the
    work runs under (parameters: the two keys,
    [`fence_marker`][pgleaderlock.core.fencing.fence_marker] and the term; see
    [`fence_values`][pgleaderlock.core.fencing.fence_values]). Returns the term.

    The server refuses, failing the statement and so aborting the caller's transaction
    (which then cannot commit, even if the caller ignores the
    [`FencedError`][pgleaderlock.FencedError] it is turned into), when

    - the row holds another term: ``invalid input syntax for type bigint:
      "pgleaderlock: fenced: the term is <N>, not <term>"`` (SQLSTATE 22P02);
    - a term bump holds the row (a new leadership is beginning): ``NOWAIT`` does not
      wait for it, ``could not obtain lock on row`` (SQLSTATE 55P03).

    No row (the row was deleted) returns nothing: the caller refuses. The marker is
    taken with ``pg_try_advisory_xact_lock_shared``, which never waits either."""
    return (
        "SELECT CASE WHEN term = ({3})::int8 THEN term"
        f" ELSE ('{REFUSAL}' || term || ', not ' || ({{3}})::int8)::int8 END,"
        " pg_catalog.pg_try_advisory_xact_lock_shared(({2})::int8)"
        f" FROM {table.sql} WHERE key1 = ({{0}})::int4 AND key2 = ({{1}})::int4"
        " FOR SHARE NOWAIT"
    )


def fence_values(key1: int, key2: int, term: int) -> tuple[int, int, int, int]:
    """The parameters of [`fence_template`][pgleaderlock.core.fencing.fence_template]."""
    return key1, key2, fence_marker(key1, key2), term


def term_of(row: tuple[object, ...] | None) -> int | None:
    """The term a fence row holds (``None``: no row, or no term)."""
    value = None if row is None else row[0]
    return None if value is None else int(value)  # type: ignore[call-overload]


def refused_term(exc: BaseException) -> tuple[int | None] | None:
    """If ``exc`` (a driver's error, or a wrapper of one) is the server's refusal of a
    fence: a 1-tuple of the term the row held (``None``: its row is locked by a term
    bump); else ``None``."""
    seen: set[int] = set()
    todo: list[BaseException | None] = [exc]
    while todo:
        error = todo.pop()
        if error is None or id(error) in seen:
            continue
        seen.add(id(error))
        if sqlstate(error) == ROW_LOCKED:
            return (None,)
        found = _REFUSED.search(str(error))
        if found is not None:
            return (int(found.group(1)),)
        orig = getattr(error, "orig", None)  # SQLAlchemy's DBAPIError
        todo += [error.__cause__, error.__context__]
        if isinstance(orig, BaseException):
            todo.append(orig)
    return None


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


def _refused(exc: Exception, term: int, label: str) -> None:
    """Raise [`FencedError`][pgleaderlock.FencedError] from ``exc`` if it is the
    server's refusal of a fence under ``term``."""
    held = refused_term(exc)
    if held is not None:
        try:
            check_term(term, held[0], label)
        except FencedError as fenced:
            raise fenced from exc


async def fence_transaction(
    conn: object, table: TermTable, keys: tuple[int, int], term: int, label: str
) -> int:
    """The one fence: lock the row of ``keys`` in ``table`` for the transaction on
    ``conn`` and have the server check that it still holds ``term`` (of the lock or
    name ``label``).

    Returns:
        ``term``.

    Raises:
        FencedError: the term moved on (or is being bumped): the server refused the
            statement, so the transaction is aborted: roll back.
        ConfigurationError: ``conn`` is not in a transaction, or of a kind no installed
            backend knows.
    """
    try:
        row = await fetch_row(conn, fence_template(table), fence_values(*keys, term))
    except Exception as exc:
        _refused(exc, term, label)
        raise
    check_term(term, term_of(row), label)
    return term


def fence_transaction_sync(
    conn: object, table: TermTable, keys: tuple[int, int], term: int, label: str
) -> int:
    """[`fence_transaction`][pgleaderlock.core.fencing.fence_transaction] on a
    synchronous connection."""
    try:
        row = fetch_row_sync(conn, fence_template(table), fence_values(*keys, term))
    except Exception as exc:
        _refused(exc, term, label)
        raise
    check_term(term, term_of(row), label)
    return term


# ---------------------------------------------------------------------- the leadership

_BOUND: contextvars.ContextVar[tuple[Leadership, ...]] = contextvars.ContextVar(
    "pgleaderlock_leadership", default=()
)
"""The leaderships the running code works under, innermost last (at most one per owner
is looked at: the innermost)."""


class Leadership:
    """One leadership of a lock: its fencing term, as a token that work begun under it
    carries (a *sequencer*, in the words of Google's Chubby: etcd's ``IsOwner()``
    comparison, a ZooKeeper lock node's sequence number).

    Work begun while the lock leads under term *t* fences with *t*: its fences are
    refused (``FencedError``, by the server) once that leadership has ended, **even if
    this process leads again** under a later term meanwhile, because another replica may
    have led in between. A fence of the lock's *current* term would let such a zombie
    unit (begun under *t*, finished after a loss, inside ``asyncio.shield``, in a thread,
    or in a task that swallowed its cancellation) commit under *t + 1*.

    Get one with [`lock.leadership()`][pgleaderlock.LeaderLock.leadership]. It is also a
    context manager (``with`` or ``async with``) that binds it to the running context:
    inside the block, [`lock.fence(conn)`][pgleaderlock.LeaderLock.fence] fences with
    its term, and so do the asyncio tasks created there (they copy the context) and the
    threads started with ``asyncio.to_thread`` or ``contextvars.copy_context().run``.
    The lock's leader tasks, its [`Scheduler`][pgleaderlock.schedule.Scheduler]'s jobs,
    and the APScheduler helpers' runs are bound this way already.

    ```python
    async with lock.leadership() as lead:   # the current term, bound to this block
        rows = await read_batch()
        await asyncio.shield(write(rows))   # fences with lead.term, wherever it ends
    ```

    Attributes:
        label: the lock's (or name's) label, for messages.
        term: the fencing term.
    """

    __slots__ = ("_keys", "_live", "_owner", "_table", "label", "term")

    def __init__(
        self,
        owner: object,
        label: str,
        term: int,
        table: TermTable,
        keys: tuple[int, int],
        live: Callable[[], int | None] | None = None,
    ) -> None:
        self._owner = owner
        self.label = label
        self.term = term
        self._table = table
        self._keys = keys
        self._live = live  # the owner's term now, as this process knows it

    @property
    def owner(self) -> object:
        """What leads: the [`LeaderLock`][pgleaderlock.LeaderLock] (or the name's
        [`WorkerContext`][pgleaderlock.WorkerContext])."""
        return self._owner

    @property
    def current(self) -> bool:
        """Whether this process still leads under this term, as far as it knows (the
        server has the last word: [`fence`][pgleaderlock.Leadership.fence]). Always
        True for a Coordinator worker's leadership of a name: there only the server
        decides."""
        return self._live is None or self._live() == self.term

    def _check(self) -> None:
        if self._live is None:
            return
        now = self._live()
        if now is None:
            raise FencedError(
                f"{self.label} is not leader: the leadership of term {self.term}, under "
                "which this work began, has ended (roll back)"
            )
        if now != self.term:
            raise FencedError(
                f"{self.label}: the leadership of term {self.term}, under which this work "
                f"began, has ended (it leads under term {now} now, and another replica may "
                "have led in between): this transaction must not commit (roll it back)"
            )

    async def fence(self, conn: object) -> int:
        """Fence the caller's transaction on ``conn`` with this leadership's term: call
        it inside the transaction, first. The server checks that the term row still
        holds the term and keeps the row share-locked until the transaction ends (see
        [`LeaderLock.fence`][pgleaderlock.LeaderLock.fence]).

        Returns:
            The term.

        Raises:
            FencedError: this leadership has ended (also when the lock leads again under
                a later term): roll back.
            ConfigurationError: ``conn`` is not in a transaction, or of a kind no
                installed backend knows.
        """
        self._check()
        return await fence_transaction(conn, self._table, self._keys, self.term, self.label)

    def fence_sync(self, conn: object) -> int:
        """[`fence`][pgleaderlock.Leadership.fence] for a synchronous connection
        (psycopg ``Connection``), from any thread."""
        self._check()
        return fence_transaction_sync(conn, self._table, self._keys, self.term, self.label)

    @contextlib.asynccontextmanager
    async def fenced(self, conn: object) -> AsyncIterator[int]:
        """``async with lead.fenced(conn) as term:``: [`fence`][pgleaderlock.Leadership.fence]
        on entry; the caller's transaction then commits or rolls back as usual."""
        yield await self.fence(conn)

    def __enter__(self) -> Self:
        _BOUND.set((*_BOUND.get(), self))
        return self

    def __exit__(self, *exc: object) -> None:
        bound = _BOUND.get()
        for i in range(len(bound) - 1, -1, -1):
            if bound[i] is self:
                _BOUND.set(bound[:i] + bound[i + 1 :])
                return

    async def __aenter__(self) -> Self:
        return self.__enter__()

    async def __aexit__(self, *exc: object) -> None:
        self.__exit__(*exc)

    def __repr__(self) -> str:
        return f"<Leadership {self.label} term={self.term}>"


def bound_leadership(owner: object) -> Leadership | None:
    """The leadership of ``owner`` that the running code is bound to, or ``None``."""
    for lead in reversed(_BOUND.get()):
        if lead._owner is owner:
            return lead
    return None


@contextlib.contextmanager
def unbound(owner: object) -> Iterator[None]:
    """Within the block, no leadership of ``owner`` is bound (for the tasks that a lock
    starts for itself, which must not inherit the leadership of work that started it)."""
    bound = _BOUND.get()
    if not any(lead._owner is owner for lead in bound):
        yield
        return
    token = _BOUND.set(tuple(lead for lead in bound if lead._owner is not owner))
    try:
        yield
    finally:
        _BOUND.reset(token)


def _check_term_argument(term: object) -> int:
    if isinstance(term, bool) or not isinstance(term, int) or term < 1:
        raise ConfigurationError(f"term must be a positive int (a fencing term), got {term!r}")
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
    def leadership(self, *, term: int | None = None) -> Leadership: ...
    async def fence(self, conn: object, *, term: int | None = None) -> int: ...
    def _fence_keys(self) -> tuple[int, int] | None: ...


class Fencing:
    """The fencing part of [`LeaderLock`][pgleaderlock.LeaderLock]'s API."""

    @property
    def term(self: _Lock) -> int | None:
        """With ``Fencing(enabled=True)``: the fencing token of the current leadership, strictly
        increasing per lock across all processes (also after a server restart or a
        failover); ``None`` when not LEADER or without fencing.

        This is the lock's term *now*. Work that began under an earlier term (a leader
        task, a job run) fences with its own: see
        [`leadership`][pgleaderlock.LeaderLock.leadership]."""
        return self._machine.term

    def leadership(self: _Lock, *, term: int | None = None) -> Leadership:
        """The leadership the calling code works under, as a
        [`Leadership`][pgleaderlock.Leadership] token: the one bound to the running
        context (inside a leader task, a [`Scheduler`][pgleaderlock.schedule.Scheduler]
        job, an APScheduler helper's run, a ``with lock.leadership():`` block, and the
        tasks and threads they start), else the lock's current one.

        Use it as a context manager to bind the current leadership to work that this
        code starts itself, so that its fences are refused once that leadership has
        ended, even if the lock leads again by then:

        ```python
        async with lock.leadership() as lead:
            await asyncio.shield(relay(lock))   # lock.fence(conn) in it: lead.term
        ```

        Args:
            term: a term handed on from where the work began (a message header, a
                stored job's term): the leadership of that term, whichever is bound.

        Returns:
            The leadership (its fences refused once it has ended, or if the lock does
            not lead under it now).

        Raises:
            FencedError: no leadership is bound and the lock is not LEADER.
            ConfigurationError: the lock has no fencing, or ``term`` is not a positive
                int.
        """
        table = self._config.term_table
        if table is None:
            raise ConfigurationError(
                "fence() needs fencing: options=LockOptions(fencing=Fencing(enabled=True)) "
                "(fencing=True in 0.1)"
            )
        if term is None:
            bound = bound_leadership(self)
            if bound is not None:
                return bound
            term = self._machine.term
        else:
            term = _check_term_argument(term)
        keys = self._fence_keys()
        if term is None or keys is None:
            raise FencedError(f"{self.label} is not leader (state {self.state.value})")
        machine = self._machine

        def live() -> int | None:  # the term this process leads under now, on these keys
            return machine.term if self._fence_keys() == keys else None

        return Leadership(self, self.label, term, table, keys, live)

    def _fence_keys(self: _Lock) -> tuple[int, int] | None:
        """The keys of the term row that fences this lock's work (a semaphore: its held
        slot's, ``None`` when it holds none)."""
        return self._key1, self._key2

    async def fence(self: _Lock, conn: object, *, term: int | None = None) -> int:
        """Fence the caller's transaction on ``conn``: call it inside the transaction,
        first (before its writes, and before the reads they depend on); the transaction
        may commit only if this returns.

        It fences with the term of the leadership the calling code works under (see
        [`leadership`][pgleaderlock.LeaderLock.leadership]): inside a leader task, a
        scheduled job or a ``with lock.leadership():`` block, the term it began under;
        elsewhere the lock's current term. The server checks that the lock's term row
        still holds that term (it refuses the statement otherwise, which aborts the
        transaction) and keeps a shared lock on the row until the transaction ends, so
        the next leader's term bump waits for this transaction, and a transaction fenced
        here can never commit after a later term began.

        Args:
            conn: a psycopg ``AsyncConnection``, an asyncpg ``Connection``, or a
                SQLAlchemy ``AsyncConnection`` or ``AsyncSession``, in a transaction.
            term: fence with this term (one handed on from where the work began)
                instead.

        Returns:
            The term the transaction runs under.

        Raises:
            FencedError: the leadership the work runs under has ended (this lock is not
                LEADER, or leads under another term, or the term has moved on): roll
                back.
            ConfigurationError: the lock has no fencing, or ``conn`` is not in a
                transaction, or of a kind no installed backend knows.
        """
        return await self.leadership(term=term).fence(conn)

    @contextlib.asynccontextmanager
    async def fenced(self: _Lock, conn: object, *, term: int | None = None) -> AsyncIterator[int]:
        """``async with lock.fenced(conn) as term:``: [`fence`][pgleaderlock.LeaderLock.fence]
        on entry; the caller's transaction then commits or rolls back as usual."""
        yield await self.fence(conn, term=term)

    def fence_sync(self: _Lock, conn: object, *, term: int | None = None) -> int:
        """[`fence`][pgleaderlock.LeaderLock.fence] for a synchronous connection (psycopg
        ``Connection``), from any thread: what the threaded lock uses."""
        return self.leadership(term=term).fence_sync(conn)
