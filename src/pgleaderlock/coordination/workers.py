"""The workers of one member: a coroutine per name, run only while the member leads the
name, cancelled and awaited the moment it does not, restarted after a crash."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import gc
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar

from ..lowlevel import ConfigurationError, Leadership, LibraryTable, Supervisor, fetch_row
from .protocol import checkpoint_name, name_keys

if TYPE_CHECKING:
    from ..lowlevel import RetryStrategy, TermTable

__all__ = ["CheckpointTable", "WorkerContext", "WorkerFunction", "Workers", "gc_deferred"]


@dataclass(frozen=True)
class CheckpointTable(LibraryTable):
    """Where fenced checkpoints live: the seeds' subscriptions table
    (``subscription_name text primary key, last_position bigint, updated_at
    timestamptz``), named with its schema. A name of a group is stored as
    ``<group>:<name>`` (see
    [`checkpoint_name`][pgleaderlock.coordination.protocol.checkpoint_name])."""

    name: str = "pgleaderlock_subscriptions"

    knobs: ClassVar[tuple[str, str]] = ("checkpoint_table", "checkpoint_schema")
    columns: ClassVar[str] = (
        "subscription_name text PRIMARY KEY, last_position bigint,"
        " updated_at timestamptz NOT NULL DEFAULT pg_catalog.now()"
    )

    @property
    def load(self) -> str:
        return f"SELECT last_position FROM {self.sql} WHERE subscription_name = {{0}}"

    @property
    def save(self) -> str:
        return (
            f"INSERT INTO {self.sql} (subscription_name, last_position, updated_at)"
            " VALUES ({0}, ({1})::int8, pg_catalog.now()) ON CONFLICT (subscription_name)"
            " DO UPDATE SET last_position = EXCLUDED.last_position,"
            " updated_at = EXCLUDED.updated_at RETURNING last_position"
        )


class WorkerContext:
    """What a worker is told: its name, the fencing term of this leadership, and fenced
    checkpoints.

    Attributes:
        name: the name this worker runs for.
        term: with ``fencing=True``, the name's fencing term for this leadership (the
            token to hand to other systems); ``None`` without fencing.
        member: the member (replica) that runs it.
    """

    def __init__(
        self,
        name: str,
        term: int | None,
        member: str,
        terms: TermTable | None,
        checkpoints: CheckpointTable,
        group: str,
        *,
        keys: tuple[int, int] | None = None,
    ) -> None:
        self.name = name
        self.term = term
        self.member = member
        self.group = group
        self._checkpoints = checkpoints
        # The name's lock (``name_keys``), which its member knows already: hashing the
        # name again would cost the start of thousands of workers after a failover.
        self._keys = name_keys(group, name) if keys is None else keys
        self._stored_as = checkpoint_name(group, name)
        self._draining = False
        self._supervisor: Supervisor | None = None  # set as the worker starts
        # The name's leadership this worker began under: its fences follow it, not the
        # member's current term of the name (as a lock's leader tasks do).
        self._leadership = None
        if terms is not None and term is not None:
            self._leadership = Leadership(self, name, term, terms, self._keys)

    @property
    def draining(self) -> bool:
        """True while a graceful stop (the coordinator's ``shutdown()`` or ``remove()``,
        with ``drain_s`` > 0) lets this worker finish its current unit of work: a worker
        that loops checks it between units and returns. A worker still running after
        ``drain_s`` is cancelled as usual."""
        return self._draining

    async def idle(self, seconds: float) -> None:
        """Sleep ``seconds`` between units of work: a graceful stop's drain waits only
        for workers that run a unit of work. A worker that sleeps here when the drain
        starts is ended at once (cancelled: the ``CancelledError`` comes out of this
        call), and one that comes here during the drain ends here; so a stop with no
        work running returns at once, whatever ``drain_s`` is."""
        supervisor = self._supervisor
        if supervisor is None:
            await asyncio.sleep(seconds)
        else:
            await supervisor.idle(seconds)

    async def fence(self, conn: object) -> int:
        """Fence the caller's transaction on ``conn`` with the term of this worker's
        leadership of the name (a [`Leadership`][pgleaderlock.Leadership], as
        [`LeaderLock.fence`][pgleaderlock.LeaderLock.fence] in a leader task): refused
        once that leadership has ended, even if this member leads the name again. Call
        it before the transaction's writes.

        Raises:
            FencedError: a newer leadership of this name has begun: roll back.
            ConfigurationError: the coordinator has no fencing, or ``conn`` is not in a
                transaction.
        """
        if self._leadership is None:
            raise ConfigurationError(
                "fenced work and checkpoints need a Coordinator with fencing: "
                "options=LockOptions(fencing=Fencing(enabled=True)) (fencing=True in 0.1)"
            )
        return await self._leadership.fence(conn)

    async def load_checkpoint(self, conn: object) -> int | None:
        """The name's last saved position (or ``None``), read in the caller's
        transaction on ``conn``, fenced.

        Raises:
            FencedError: a newer leadership of this name has begun.
        """
        await self.fence(conn)
        row = await fetch_row(conn, self._checkpoints.load, (self._stored_as,))
        return None if row is None or row[0] is None else int(row[0])

    async def save_checkpoint(self, conn: object, position: int) -> None:
        """Save the name's position in the caller's transaction on ``conn``, fenced: a
        stale leader can never move a checkpoint. Commit the transaction (with the
        writes the position stands for) to make it count.

        Raises:
            FencedError: a newer leadership of this name has begun: roll back.
        """
        if isinstance(position, bool) or not isinstance(position, int):
            raise ConfigurationError(f"a checkpoint position is an int, got {position!r}")
        await self.fence(conn)
        await fetch_row(conn, self._checkpoints.save, (self._stored_as, position))

    def __repr__(self) -> str:
        return f"<WorkerContext name={self.name!r} term={self.term} member={self.member}>"


WorkerFunction = Callable[[WorkerContext], Awaitable[object]]
"""A worker: a coroutine function taking its [`WorkerContext`][pgleaderlock.WorkerContext]."""


class Workers:
    """The running workers of one member, by name (a
    [`Supervisor`][pgleaderlock.core.supervisor.Supervisor], as a lock's leader tasks).

    Args:
        retry: delays between restarts of a crashed worker.
        give_up_after: crashes in a row after which ``crashed_out`` is called for the
            name (``None``: never; the worker then keeps being restarted).
        crashed_out: called with the name whose worker crashed too often.
        cancel_timeout_s: how long to wait for a cancelled worker to end.
        label: the group, for logs.
    """

    def __init__(
        self,
        retry: RetryStrategy,
        give_up_after: int | None,
        crashed_out: Callable[[str], None],
        cancel_timeout_s: float = 10.0,
        label: str = "",
    ) -> None:
        self._tasks = Supervisor(
            kind="worker",
            label=label,
            retry=retry,
            give_up_after=give_up_after,
            gave_up=crashed_out if give_up_after is not None else _keep,
            cancel_timeout_s=cancel_timeout_s,
        )
        self._contexts: dict[str, WorkerContext] = {}

    @property
    def running(self) -> frozenset[str]:
        return self._tasks.running

    def start(self, name: str, fn: WorkerFunction, context: WorkerContext) -> None:
        """Start ``fn(context)`` for ``name`` unless it runs already."""
        if self._tasks.runs(name):
            return
        self._contexts[name] = context
        context._supervisor = self._tasks
        self._tasks.start(name, functools.partial(fn, context), until=lambda: context.draining)

    async def drain(
        self, names: set[str] | frozenset[str] | None = None, timeout_s: float | None = None
    ) -> None:
        """Let the workers of ``names`` (all when ``None``) finish their current unit of
        work: their contexts say ``draining``, and this waits until they have returned,
        for at most ``timeout_s`` (``None``: until cancelled). ``stop`` cancels the rest."""
        chosen = set(self._contexts) if names is None else set(names) & set(self._contexts)
        for name in chosen:
            self._contexts[name]._draining = True
        await self._tasks.drain(chosen, timeout_s)

    async def stop(self, names: set[str] | frozenset[str] | None = None) -> None:
        """Cancel and await the workers of ``names`` (all when ``None``)."""
        chosen = set(self._contexts) if names is None else set(names)
        for name in chosen:
            self._contexts.pop(name, None)
        await self._tasks.stop(None if names is None else chosen)


@contextlib.contextmanager
def gc_deferred() -> Iterator[None]:
    """Defer the garbage collector's passes while a member starts many workers at once
    (after a failover): they allocate objects by the thousand, which would otherwise
    set off full collections of a process running thousands of workers, tens of
    milliseconds each, in the middle of the start. The collector runs as usual
    afterwards (its thresholds are kept); if it was disabled, this does nothing."""
    if not gc.isenabled():
        yield
        return
    gc.disable()
    try:
        yield
    finally:
        gc.enable()


def _keep(name: str) -> None:
    """Without ``give_away_after_crashes`` a worker given up by its retry strategy stays
    given up until the name's next leadership."""
