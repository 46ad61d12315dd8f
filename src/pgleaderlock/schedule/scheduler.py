"""[`Scheduler`][pgleaderlock.schedule.Scheduler]: jobs that run once per slot across a
fleet, on whichever replica leads a lock, with every slot claimed in the ledger first.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime as dt
import time
from collections.abc import Callable
from typing import Any, Literal, TypeVar, Unpack

from ..lowlevel import (
    ConfigurationError,
    Event,
    FencedError,
    LeaderLock,
    PgLeaderLockError,
    RetryContext,
    Service,
    callback_plugin,
    check_identifier,
    delay_or_give_up,
    fence_transaction,
    get_logger,
    is_permanent,
    lock_settings,
    not_negative,
    positive,
)
from ..tasks import LeaderTasks
from .book import MAX_RECORDED_MISSES, SlotBook
from .job import Job, JobFunction, Run, check_job_name
from .ledger import Ledger, RunTable, ScheduleTable
from .policy import CatchUp, Interrupted, Policy, PolicyKeywords, policy_from
from .retries import Owed
from .timing import Cron, Every, ServerClock, Timing, utc

__all__ = [
    "CatchUp",
    "Interrupted",
    "Job",
    "JobFunction",
    "Run",
    "RunFailed",
    "Scheduler",
    "check_job_name",
]

log = get_logger("pgleaderlock.schedule")

F = TypeVar("F", bound=JobFunction)


class RunFailed(PgLeaderLockError):
    """Raise it from a job to record the run as ``failed`` with this message as its
    detail, and no traceback in the log (a command's exit status, say).

    A [`PgLeaderLockError`][pgleaderlock.PgLeaderLockError] like every error of the
    library; the scheduler catches it (and any other error of the job) around the job."""


class Scheduler(Service):
    """Jobs that run once per slot across every replica that shares ``lock``: only the
    leader runs them, and it claims each slot in the ledger (under its fencing term, on
    the session that holds the lock) before it starts the job. A slot is claimed at most
    once, ever; slot times come from the database server's clock.

    Make it before the lock starts or while it runs, and start it next to the lock (a
    scheduler made while the lock leads runs its jobs at once; one never started logs
    ``scheduler_not_started`` once, when its lock leads):

    ```python
    lock = LeaderLock.from_name(
        "reports", dsn=DSN, options=LockOptions(fencing=Fencing(enabled=True))
    )
    sched = Scheduler(lock)

    @sched.cron("*/5 * * * *")
    async def report(run: Run) -> None:
        async with await psycopg.AsyncConnection.connect(DSN) as conn:
            async with run.transaction(conn):  # fenced; marks the slot done
                await conn.execute("INSERT INTO reports ...")

    async with lock, sched:
        await serve_forever()
    ```

    A job runs bound to the leadership that claimed its slot (``run.term``):
    ``lock.fence(conn)`` in it (and in the tasks and threads it starts) fences with that
    term, and is refused once that leadership has ended, even if the lock leads again.

    Runs of one job never overlap: a slot that falls due while the previous run is still
    going waits for it (and is then late, see ``misfire_grace_s``). A job that raises is
    recorded as ``failed`` and the next slot runs as usual; with the policy's
    [`Retry`][pgleaderlock.schedule.Retry] the slot is tried again after a back-off (the
    job's slots that fall due meanwhile run first), up to its ``max_attempts``. When
    leadership is lost the running jobs are cancelled; with the lock's ``drain_s`` a
    graceful stop lets the current run finish.

    The ledger's statements run on the lock's session. One that fails for a reason that
    retrying may mend (the session lost, a statement past its bound, the leadership
    gone, a job whose fenced transaction found its term ended) is one log line, no
    traceback: the leadership goes with a lost session (the jobs start again at the next
    one), else the job's loop starts again after the lock's retry strategy's delay. A
    slot it claimed stays ``running``, for the ``interrupted`` policy of the next
    leadership. An error that retrying cannot mend (a ledger table of an untrusted role,
    a missing privilege) stops every job of the scheduler for good: logged as an error,
    and kept in [`stop_error`][pgleaderlock.schedule.Scheduler.stop_error] (which
    [`health.check(scheduler)`][pgleaderlock.health.check] reports).

    Args:
        lock: a [`LeaderLock`][pgleaderlock.LeaderLock] with ``Fencing(enabled=True)``.
        runs_table: the ledger's table of runs (created if missing and allowed; see
            ``pgleaderlock sql``).
        schedules_table: the table of schedules.
        schema: the schema of both (default: the lock's ``fencing_schema``).
        keep_runs_s: how long the rows of past slots are kept (pruned when a leader
            begins); the newest row of a schedule is always kept.
        call_timeout_s: the bound of each ledger statement (default: the lock's
            ``command_timeout_s``).

    Raises:
        ConfigurationError: the lock has no fencing, or bad arguments.
    """

    def __init__(
        self,
        lock: LeaderLock,
        *,
        runs_table: str = RunTable.name,
        schedules_table: str = ScheduleTable.name,
        schema: str | None = None,
        keep_runs_s: float = 7 * 86_400.0,
        call_timeout_s: float | None = None,
    ) -> None:
        if not isinstance(lock, LeaderLock):
            raise ConfigurationError(f"Scheduler needs a LeaderLock, got {lock!r}")
        config = lock_settings(lock)
        terms = config.term_table
        if terms is None:
            raise ConfigurationError(
                "Scheduler needs a lock with fencing (LeaderLock(..., "
                "options=LockOptions(fencing=Fencing(enabled=True)))): every slot is "
                "claimed under the lock's fencing term"
            )
        where = terms.schema if schema is None else check_identifier("schema", schema)
        self._ledger = Ledger(
            RunTable(runs_table, where, terms.trusted_roles),
            ScheduleTable(schedules_table, where, terms.trusted_roles),
            terms,
        )
        self._lock = lock
        self.clock = ServerClock()
        """The server's time as this process estimates it."""
        self._book = SlotBook(
            lock,
            self._ledger,
            self.clock,
            dt.timedelta(seconds=positive("keep_runs_s", keep_runs_s)),
            (
                config.command_timeout_s
                if call_timeout_s is None
                else positive("call_timeout_s", call_timeout_s)
            ),
        )
        self._jobs: dict[str, Job] = {}
        self._drained = asyncio.Event()  # set when the lock drains: no new slot starts
        self._drain_plugin: object | None = callback_plugin(Event.DRAINING, self._drained.set)
        # Registered before the tasks' own drain hook, which waits for the jobs' loops to
        # return: a loop waiting for its next slot (or a retry) must hear of the drain
        # first, or the stop waits for all of drain_s.
        lock.plugins.register(self._drain_plugin)
        self._tasks = LeaderTasks(lock)
        self._idle_plugin: object | None = callback_plugin(Event.ACQUIRED, self._never_started)
        lock.plugins.register(self._idle_plugin)
        self._warned = False  # that the jobs wait for start() while the lock leads
        self._started = False
        self._stop_error: PgLeaderLockError | None = None

    # ------------------------------------------------------------------ registration

    @property
    def lock(self) -> LeaderLock:
        """The lock whose leader runs the jobs."""
        return self._lock

    @property
    def stop_error(self) -> PgLeaderLockError | None:
        """The error that stopped every job for good (one that retrying cannot mend: a
        ledger table another role owns, a missing privilege), or ``None``."""
        return self._stop_error

    @property
    def jobs(self) -> list[Job]:
        """The registered jobs."""
        return list(self._jobs.values())

    @property
    def ledger(self) -> Ledger:
        """The ledger's statements and tables."""
        return self._ledger

    def schedule_name(self, job: str) -> str:
        """How the ledger names ``job`` of this scheduler: ``<lock>:<job>``."""
        return f"{self._lock.label}:{job}"

    def add(
        self,
        fn: JobFunction,
        timing: Timing,
        *,
        name: str | None = None,
        policy: Policy | None = None,
        outcome: Literal["done", "sent"] = "done",
        **deprecated: Unpack[PolicyKeywords],
    ) -> Job:
        """Register ``fn`` to run once per slot of ``timing``.

        Args:
            fn: ``async def job(run: Run)``.
            timing: an [`Every`][pgleaderlock.schedule.Every] or a
                [`Cron`][pgleaderlock.schedule.Cron].
            name: the job's name (default: the function's ``__name__``), unique in this
                scheduler; with the lock's name it keys the ledger's rows, so keep it
                stable across deployments.
            policy: what a leader does with the slots nobody ran (see
                [`Policy`][pgleaderlock.schedule.Policy]; default ``Policy()``).
            outcome: what the ledger records when the job returns: ``"done"``, or
                ``"sent"`` for a job that hands the work to another system (Celery
                beat's integration sends a task).
            **deprecated: ``catch_up``, ``max_catch_up``, ``misfire_grace_s`` and
                ``interrupted``, the fields of ``policy``: still taken for this release,
                with a ``DeprecationWarning``.

        Raises:
            ConfigurationError: bad arguments (both ``policy`` and a deprecated
                keyword, say), or the name is taken.
        """
        policy = policy_from(policy, deprecated, where="Scheduler.add")
        if not asyncio.iscoroutinefunction(fn):
            raise ConfigurationError(f"a scheduled job must be an async function, got {fn!r}")
        job_name = check_job_name(name if name is not None else getattr(fn, "__name__", ""))
        if job_name in self._jobs:
            raise ConfigurationError(f"a job named {job_name!r} is already scheduled")
        job = Job(name=job_name, fn=fn, timing=timing, policy=policy, outcome=outcome)
        if outcome not in ("done", "sent"):
            raise ConfigurationError(f"outcome must be 'done' or 'sent', got {outcome!r}")
        self._jobs[job_name] = job
        if self._started:
            self._start(job)
        return job

    def every(
        self,
        seconds: float = 0,
        *,
        minutes: float = 0,
        hours: float = 0,
        offset_s: float = 0,
        name: str | None = None,
        policy: Policy | None = None,
        **deprecated: Unpack[PolicyKeywords],
    ) -> Callable[[F], F]:
        """Decorator: run the job every ``hours + minutes + seconds``, counted from the
        UNIX epoch plus ``offset_s`` (so every 5 minutes falls at :00, :05, ...). The
        other arguments are [`add`][pgleaderlock.schedule.Scheduler.add]'s.

        Raises:
            ConfigurationError: a part that is not a finite number >= 0, an interval
                under 1 ms or over `MAX_SECONDS` (about 31.7 years).
        """
        parts = [
            not_negative(what, value) * scale
            for what, value, scale in (("seconds", seconds, 1), ("minutes", minutes, 60),
                                       ("hours", hours, 3600))
        ]  # fmt: skip
        where = "Scheduler.every"
        interval = positive("every(...)'s interval (hours + minutes + seconds)", sum(parts))
        timing = Every(
            dt.timedelta(seconds=interval),
            dt.timedelta(seconds=not_negative("offset_s", offset_s)),
        )
        return self._decorator(timing, name, policy_from(policy, deprecated, where=where))

    def cron(
        self,
        expression: str,
        *,
        timezone: str = "UTC",
        name: str | None = None,
        policy: Policy | None = None,
        **deprecated: Unpack[PolicyKeywords],
    ) -> Callable[[F], F]:
        """Decorator: run the job at the times of a five-field cron expression in
        ``timezone`` (needs ``pip install 'pgleaderlock[cron]'``). The other arguments
        are [`add`][pgleaderlock.schedule.Scheduler.add]'s."""
        where = "Scheduler.cron"
        timing = Cron(expression, timezone)
        return self._decorator(timing, name, policy_from(policy, deprecated, where=where))

    def _decorator(self, timing: Timing, name: str | None, policy: Policy) -> Callable[[F], F]:
        def register(fn: F) -> F:
            self.add(fn, timing, name=name, policy=policy)
            return fn

        return register

    # ------------------------------------------------------------------ lifecycle

    async def start(self) -> None:
        """Begin: the jobs run whenever the lock leads (from its next LEADER state on,
        or now if it leads already)."""
        if self._started:
            return
        self._started = True
        for job in self._jobs.values():
            self._start(job)

    async def shutdown(self) -> None:
        """Stop: cancel and await every running job (its slot stays ``running`` in the
        ledger; the next leader applies the job's ``interrupted`` policy). To let the
        current runs finish, shut the lock down first with its ``drain_s``."""
        self._started = False
        plugins = (self._drain_plugin, self._idle_plugin)
        self._drain_plugin = self._idle_plugin = None
        for plugin in plugins:
            if plugin is not None and self._lock.plugins.is_registered(plugin):
                self._lock.plugins.unregister(plugin)
        await self._tasks.close()

    async def remove(self, name: str) -> None:
        """Unschedule the job called ``name``: a run in progress is cancelled (its slot
        stays ``running``, for the ``interrupted`` policy of a job of that name added
        later); its ledger rows stay."""
        if self._jobs.pop(name, None) is not None:
            await self._tasks.remove(name)

    def _never_started(self) -> None:
        """The lock leads, and this scheduler's jobs wait for a ``start()`` that has not
        come: say so, once (they would not run, without a word)."""
        if not self._started and self._jobs and not self._warned:
            self._warned = True
            hint = "enter `async with scheduler:` or await scheduler.start()"
            log.warning("scheduler_not_started", lock=self._lock.label,
                        jobs=",".join(self._jobs), hint=hint)  # fmt: skip

    def _start(self, job: Job) -> None:
        async def drive() -> None:
            await self._drive(job)

        self._tasks.add(drive, name=job.name)

    # ------------------------------------------------------------------ slots timed elsewhere

    async def settle(self, job: Job, through: dt.datetime) -> list[tuple[dt.datetime, bool]]:
        """For an integration whose own scheduler times the slots (APScheduler): what a
        leader does for ``job`` when its leadership begins, without running anything.

        Registers the schedule (``job`` need not be added to this scheduler; its ``fn``
        is not called), applies its policy's ``interrupted`` to slots left ``running`` by
        an older term, and its ``catch_up`` to the slots after the schedule's newest row
        that are older than its ``misfire_grace_s``. Slots the policies skip are recorded (``lost``,
        ``missed``). Returns the slots to run now, oldest first, up to ``through`` (those
        within the grace included), each with whether it is a rerun: the caller claims
        each with [`claim`][pgleaderlock.schedule.Scheduler.claim] before running it.
        Returns ``[]`` when the lock does not lead.

        Raises:
            FencedError: the leadership ended meanwhile.
            ConnectionError: the lock lost its session (or does not lead).
        """
        term = self._lock.term
        if term is None:
            return []
        name = self.schedule_name(job.name)
        cursor, reruns, _ = await self._book.begin(job, name, term)  # (no retries: refused)
        todo = [(slot, True) for slot in reruns]
        grace = dt.timedelta(seconds=job.policy.misfire_grace_s)
        stale = min(utc(through), self.clock.now() - grace)
        if stale > cursor:
            ran, cursor = await self._book.choose(job, name, cursor, stale, term)
            todo.extend((slot, False) for slot in ran)
        fresh, _ = job.timing.newest(cursor, utc(through), MAX_RECORDED_MISSES)
        todo.extend((slot, False) for slot in fresh)
        return todo

    async def claim(self, job: Job, slot: dt.datetime, *, rerun: bool = False) -> Run | None:
        """For an integration whose own scheduler times the slots (APScheduler): claim
        ``slot`` of ``job`` under the lock's current term, on the session that holds the
        lock, as the scheduler's own loop does before it runs a slot (waiting while the
        server's clock has not reached it). ``rerun`` may take over a slot left
        ``running`` by an older term. Record how the run ended with
        [`finish`][pgleaderlock.schedule.Scheduler.finish].

        Returns:
            The run, or ``None`` when the slot has a row already (it ran, or was
            recorded) or the lock does not lead.

        Raises:
            FencedError: the leadership ended meanwhile.
            ConnectionError: the lock lost its session (or does not lead).
        """
        term = self._lock.term
        if term is None:
            return None
        name = self.schedule_name(job.name)
        claimed = await self._book.claim(job, name, utc(slot), term, rerun)
        if claimed is None:
            return None
        return Run(self, name, utc(slot), term, *claimed)

    async def finish(
        self, run: Run, *, error: BaseException | None = None, outcome: str = "done"
    ) -> None:
        """Record how a run from [`claim`][pgleaderlock.schedule.Scheduler.claim] ended:
        ``outcome`` (``"done"`` or ``"sent"``; ``"missed"`` for a slot claimed too late
        to run), or ``failed`` with ``error``. Nothing to do when its
        ``run.transaction`` recorded it already.

        Raises:
            ConnectionError: the lock lost its session (the slot stays ``running``: the
                next leader applies the job's ``interrupted`` policy).
        """
        await self._record(run, error, outcome)

    async def _record(
        self, run: Run, error: BaseException | None, outcome: str, retry: bool = False
    ) -> bool:
        """`finish`; ``retry``: a retry of the slot is due (its row has no
        ``finished_at``). Returns whether this recorded it (not a ``run.transaction``,
        say)."""
        if run.done and error is None:
            return False
        detail = None
        if error is not None:
            shown = (
                str(error) if isinstance(error, RunFailed) else f"{type(error).__name__}: {error}"
            )
            detail = shown[:1000]
        values = (run.schedule, run.slot, run.term, "failed" if error else outcome, detail, retry)
        return bool(await self._book.query(self._ledger.finish, values))

    # ------------------------------------------------------------------ the leader's loop

    async def _drive(self, job: Job) -> None:
        """`_lead` ``job`` while the lock leads, through the ledger's transient errors
        (see the class docstring): each is one log line."""
        schedule = self.schedule_name(job.name)
        attempt, since = 0, time.monotonic()
        while self._stop_error is None:
            try:
                await self._lead(job)
                return
            except PgLeaderLockError as exc:
                error = f"{type(exc).__name__}: {exc}"
                if is_permanent(exc, lock_settings(self._lock)):
                    if self._stop_error is None:  # the first job to meet it says so
                        self._stop_error = exc
                        why = "an error that retrying cannot mend: every job stops"
                        self._log("error", "scheduler_stopped", schedule=schedule,
                                  error=error, reason=why)  # fmt: skip
                    return
                if not self._lock.is_leader:  # the leadership went: the next one starts it
                    self._log("warning", "schedule_interrupted", schedule=schedule, error=error,
                              state=self._lock.state.value)  # fmt: skip
                    return
                attempt += 1
                ctx = RetryContext(attempt, time.monotonic() - since, exc)
                delay = delay_or_give_up(self._lock.retry_strategy, ctx, self._lock.label)
                retry_in = None if delay is None else round(delay, 3)
                self._log("warning", "schedule_retry", schedule=schedule, error=error,
                          attempt=attempt, retry_in_s=retry_in)  # fmt: skip
                if delay is None:
                    return  # given up for this leadership
                await asyncio.sleep(delay)

    async def _lead(self, job: Job) -> None:
        """While the lock leads: settle the past (interrupted runs, missed slots), then
        claim and run every slot as it falls due."""
        lock = self._lock
        term = lock.term
        if term is None:
            return  # the leadership ended before this task ran
        self._drained.clear()
        name = self.schedule_name(job.name)
        cursor, reruns, retries = await self._book.begin(job, name, term)
        owed = Owed()
        now = self.clock.now()
        for slot, attempt in retries:  # a back-off from now: never sooner than after the failure
            owed.add(slot, now + dt.timedelta(seconds=job.policy.retry.backoff_after(attempt)))
        for slot in reruns:
            await self._run(job, name, slot, term, owed, rerun=True)
        while not lock.draining:
            due = job.timing.after(cursor)
            retry = owed.first(before=due)
            if retry is not None:  # due before the next slot: it runs first
                if not await self._until(retry.at):
                    return
                owed.pop(retry)
                await self._run(job, name, retry.slot, term, owed, retry=True)
                continue
            now = self.clock.now()
            late_by = (now - due).total_seconds()
            if late_by > job.policy.misfire_grace_s:
                through = now - dt.timedelta(seconds=job.policy.misfire_grace_s)
                ran, cursor = await self._book.choose(job, name, cursor, through, term)
                for slot in ran:
                    await self._run(job, name, slot, term, owed)
                continue
            if late_by < 0 and not await self._until(due):
                return
            await self._run(job, name, due, term, owed)
            cursor = due

    async def _until(self, when: dt.datetime) -> bool:
        """Wait until the server's clock shows ``when``, or the lock drains (then
        ``False``: no new run starts)."""
        wait = self.clock.until(when)
        if wait > 0:
            with contextlib.suppress(TimeoutError):  # a drain ends the wait
                await asyncio.wait_for(self._drained.wait(), wait)
        return not self._lock.draining

    async def _run(
        self,
        job: Job,
        name: str,
        slot: dt.datetime,
        term: int,
        owed: Owed,
        *,
        rerun: bool = False,
        retry: bool = False,
    ) -> None:
        """Claim ``slot`` (``retry``: again, after a failed attempt), then run the job
        for it and record how it ended; a failure the policy retries is added to
        ``owed``."""
        claimed = await self._book.claim(job, name, slot, term, rerun, retry)
        if claimed is None:
            return
        attempt, started = claimed
        run = Run(self, name, slot, term, attempt, started)
        error: Exception | None = None
        delay: float | None = None
        try:
            with self._lock.leadership(term=term):  # its fences: this term's, even if led again
                await job.fn(run)
        except FencedError as exc:
            # Its leadership ended (a fenced transaction found a newer term): not the
            # job's failure. The slot stays running, for the interrupted policy.
            self._log("warning", "run_interrupted", schedule=name, slot=slot.isoformat(),
                      term=term, error=str(exc))  # fmt: skip
            return
        except Exception as exc:
            error = exc
            delay = None if run.done else job.policy.retry.delay_s(attempt, exc)
            fields: dict[str, Any] = {
                "schedule": name, "slot": slot.isoformat(), "term": term, "attempt": attempt,
                "error": f"{type(exc).__name__}: {exc}",
                "exc": None if isinstance(exc, RunFailed) else exc,
            }  # fmt: skip
            if delay is None:
                self._log("error", "job_failed", **fields)
            else:
                self._log("warning", "job_retry", retry_in_s=round(delay, 3), **fields)
        recorded = await self._record(run, error, job.outcome, retry=delay is not None)
        if delay is not None and recorded:
            owed.add(slot, self.clock.now() + dt.timedelta(seconds=delay))

    def _log(self, level: str, event: str, **fields: Any) -> None:
        getattr(log, level)(event, lock=self._lock.label, **fields)

    async def _fence(self, conn: object, term: int) -> None:
        config = lock_settings(self._lock)
        assert config.term_table is not None
        await fence_transaction(conn, config.term_table, self._lock.keys, term, self._lock.label)
