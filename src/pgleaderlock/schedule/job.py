"""What the ledger knows of a scheduled job: its [`Job`][pgleaderlock.schedule.Job]
(name, function, timing, policy) and each of its [`Run`][pgleaderlock.schedule.Run]s."""

from __future__ import annotations

import contextlib
import datetime as dt
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Literal

from ..lowlevel import FencedError, check_name, fetch_row, transaction
from .policy import Policy, takes_old_keywords
from .timing import Timing

if TYPE_CHECKING:
    from .scheduler import Scheduler

__all__ = ["Job", "JobFunction", "Run", "check_job_name"]

JobFunction = Callable[["Run"], Awaitable[object]]
"""A scheduled job: ``async def job(run: Run) -> ...``."""


@takes_old_keywords()
@dataclass(frozen=True)
class Job:
    """A registered schedule: what runs, when, and the [`Policy`][pgleaderlock.schedule.Policy]
    for slots that were missed, interrupted or failed (see
    [`Scheduler.add`][pgleaderlock.schedule.Scheduler.add])."""

    name: str
    fn: JobFunction
    timing: Timing
    policy: Policy = field(default_factory=Policy)
    outcome: Literal["done", "sent"] = "done"


class Run:
    """One run of a scheduled job: its slot, the term it runs under, and the fenced
    transaction that marks it done.

    Attributes:
        schedule: the schedule's name as the ledger keeps it (``<lock>:<job>``).
        slot: the slot's time, an aware UTC datetime (from the server's clock).
        term: the fencing term of the leadership that claimed the slot.
        attempt: 1, or more when the slot was run again: after its leader ended
            mid-run (``interrupted="rerun"``), or after an attempt that raised (the
            policy's [`Retry`][pgleaderlock.schedule.Retry]).
        late_s: how late the run started after its slot, by the server's clock.
    """

    def __init__(
        self,
        scheduler: Scheduler,
        schedule: str,
        slot: dt.datetime,
        term: int,
        attempt: int,
        started: dt.datetime,
    ) -> None:
        self._scheduler = scheduler
        self.schedule = schedule
        self.slot = slot
        self.term = term
        self.attempt = attempt
        self.late_s = (started - slot).total_seconds()
        self.done = False

    @contextlib.asynccontextmanager
    async def transaction(self, conn: object) -> AsyncIterator[int]:
        """``async with run.transaction(conn):`` a transaction on the caller's
        connection (psycopg, asyncpg or SQLAlchemy; a savepoint inside an open
        transaction) that is fenced with this run's term and marks the slot ``done``
        when it commits: the job's writes in it happen exactly once per slot, even when
        its leader dies mid-run and the next one runs the slot again
        (``interrupted="rerun"``). Yields the term.

        Raises:
            FencedError: a newer leadership has begun, or took the slot over: the
                transaction rolls back.
        """
        scheduler = self._scheduler
        async with transaction(conn):
            await scheduler._fence(conn, self.term)
            yield self.term
            row = await fetch_row(
                conn, scheduler._ledger.done, (self.schedule, self.slot, self.term)
            )
            if row is None:
                raise FencedError(
                    f"{self.schedule}: the slot {self.slot.isoformat()} is no longer this "
                    f"run's (term {self.term}): another leadership took it over, so this "
                    "transaction must not commit (it is rolled back)"
                )
        self.done = True

    def __repr__(self) -> str:
        return f"<Run {self.schedule} slot={self.slot.isoformat()} term={self.term}>"


def check_job_name(name: object) -> str:
    """A job's name: a name as [`check_name`][pgleaderlock.core.keys.check_name] takes
    it, of at most 200 characters."""
    return check_name(name, "a job's name", max_chars=200)
