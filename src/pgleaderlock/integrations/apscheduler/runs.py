"""What a run of a job knows about itself: the term it started under, its worker
context, its ledger slot, and the leadership it is bound to."""

from __future__ import annotations

import contextvars

from ...coordination import WorkerContext
from ...lowlevel import ConfigurationError, LeaderLock
from ...lowlevel import Leadership as FencingToken
from ...schedule.scheduler import Run
from ...threaded import ThreadedLeaderLock

__all__ = ["Leadership", "current_context", "current_run", "current_term"]

Leadership = LeaderLock | ThreadedLeaderLock
"""What the APScheduler helpers accept: a lock, or a lock running in its own thread."""


_RUN_TERM: contextvars.ContextVar[tuple[int | None]] = contextvars.ContextVar(
    "pgleaderlock_run_term"
)
"""Inside a run of a ``leader_only`` or ``owned_only`` job: a 1-tuple of the term it
started under."""
_RUN_CONTEXT: contextvars.ContextVar[WorkerContext] = contextvars.ContextVar(
    "pgleaderlock_run_context"
)
"""Inside a run of an ``owned_only`` job: the name's worker context."""


def current_term() -> int | None:
    """The fencing term of the leadership under which the current run of a
    [`leader_only`][pgleaderlock.integrations.apscheduler.leader_only] job started (for
    an [`owned_only`][pgleaderlock.integrations.apscheduler.owned_only] job: its name's
    term, as the coordinator's [`WorkerContext.term`][pgleaderlock.WorkerContext]).

    Call it anywhere inside the run: in the job, in a function it calls, in a task it
    creates or in ``asyncio.to_thread`` (each copies the run's context). The value is
    fixed for the run: it is the lock's [`term`][pgleaderlock.LeaderLock.term] when
    the run was let through, even if the lock has since lost and regained leadership
    under a newer term. The run is bound to that leadership: ``lock.fence(conn)`` in it
    fences with this term, and is refused once that leadership has ended, even if the
    lock leads again. The term is also the token to hand to an external system.

    ```python
    @leader_only(lock)
    async def relay() -> None:
        term = current_term()
        async with await psycopg.AsyncConnection.connect(DSN) as conn, conn.transaction():
            await lock.fence(conn)  # with `term`: FencedError once it has ended
            await publish(conn, fencing_term=term)
    ```

    Returns:
        The term; ``None`` when the lock (or coordinator) has no fencing
        (``fencing=False``).

    Raises:
        RuntimeError: called outside a run of a ``leader_only`` or ``owned_only`` job (a
            job of a bound
            scheduler that is not decorated with it reads
            [`SchedulerBinding.term`][pgleaderlock.integrations.apscheduler.SchedulerBinding.term]
            instead).
    """
    try:
        return _RUN_TERM.get()[0]
    except LookupError:
        raise RuntimeError(
            "current_term() is called outside a run of a job decorated with leader_only(lock)"
            " or owned_only(coordinator, name)"
        ) from None


def _leadership(lock: LeaderLock) -> tuple[bool, int | None]:
    """Whether ``lock`` leads, and its term, read together from any thread: the term
    first, then the state (a term read as None while the lock became leader in between
    is read again)."""
    term = lock.term
    if not lock.is_leader:
        return False, None
    if term is None:
        term = lock.term
        if term is None and not lock.is_leader:
            return False, None
    return True, term


def _run_context(
    term: int | None, ctx: WorkerContext | None, lead: FencingToken | None = None
) -> contextvars.Context:
    """The context a run runs in: its term and worker context, and bound to the
    leadership it started under (``lock.fence(conn)`` in it fences with that term)."""
    context = contextvars.copy_context()
    context.run(_RUN_TERM.set, (term,))
    if ctx is not None:
        context.run(_RUN_CONTEXT.set, ctx)
    if lead is not None:
        context.run(lead.__enter__)  # left bound: the context ends with the run
    return context


def current_context() -> WorkerContext:
    """The [`WorkerContext`][pgleaderlock.WorkerContext] of the name under which the
    current run of an [`owned_only`][pgleaderlock.integrations.apscheduler.owned_only]
    job started: its name, its fencing term, and fenced checkpoints
    ([`load_checkpoint`][pgleaderlock.WorkerContext.load_checkpoint],
    [`save_checkpoint`][pgleaderlock.WorkerContext.save_checkpoint]).

    Like [`current_term`][pgleaderlock.integrations.apscheduler.current_term], it is
    fixed for the run and seen by the tasks and threads the run starts.

    ```python
    @owned_only(coord, "billing:invoices")
    async def invoice_batch() -> None:
        ctx = current_context()
        async with await psycopg.AsyncConnection.connect(DSN) as conn, conn.transaction():
            position = await ctx.load_checkpoint(conn) or 0
            await ctx.save_checkpoint(conn, await invoice_after(conn, position))
    ```

    Raises:
        RuntimeError: called outside a run of an ``owned_only`` job.
    """
    try:
        return _RUN_CONTEXT.get()
    except LookupError:
        raise RuntimeError(
            "current_context() is called outside a run of a job decorated with "
            "owned_only(coordinator, name)"
        ) from None


def _lock_of(source: Leadership) -> LeaderLock:
    if isinstance(source, ThreadedLeaderLock):
        return source.lock
    if isinstance(source, LeaderLock):
        return source
    raise ConfigurationError(f"expected a LeaderLock or ThreadedLeaderLock, got {source!r}")


_RUN: contextvars.ContextVar[Run] = contextvars.ContextVar("pgleaderlock_apscheduler_run")
"""Inside a run of a job of a scheduler bound in ledger mode: its claimed slot."""


def current_run() -> Run:
    """The ledger's [`Run`][pgleaderlock.schedule.Run] of the current run of a job of a
    scheduler bound with [`bind_scheduler`][pgleaderlock.integrations.apscheduler.bind_scheduler]
    (ledger mode, the default): its slot (the APScheduler run time), the fencing term
    it was claimed under, its attempt, how late it started, and
    [`run.transaction(conn)`][pgleaderlock.schedule.Run.transaction], a fenced
    transaction that marks the slot done when it commits (for ``async def`` jobs).

    ```python
    async def settle_invoices() -> None:
        run = current_run()
        async with await psycopg.AsyncConnection.connect(DSN) as conn:
            async with run.transaction(conn):  # commits once per slot, or not at all
                await conn.execute("INSERT INTO settlements (slot) VALUES (%s)", (run.slot,))
    ```

    Raises:
        RuntimeError: called outside such a run.
    """
    try:
        return _RUN.get()
    except LookupError:
        raise RuntimeError(
            "current_run() is called outside a run of a job of a scheduler bound with "
            "bind_scheduler(scheduler, lock) in ledger mode"
        ) from None
