"""[`bind_scheduler`][pgleaderlock.integrations.apscheduler.bind_scheduler]: a whole
scheduler paused on followers and resumed on the leader, every run claimed in the
ledger first (ledger mode)."""

from __future__ import annotations

import asyncio
import concurrent.futures
import datetime as dt
import threading
from typing import Any, Unpack

from ...lowlevel import ConfigurationError, LockState, get_logger, lock_settings, not_negative
from ...schedule.policy import Policy, PolicyKeywords, policy_from
from ...schedule.scheduler import Job, Scheduler
from ...tasks import follow_state
from ...threaded import ThreadedLeaderLock
from . import adapter
from .ledger import _NOT_CLAIMED, _Due, _SlotJob, _SlotLedger
from .runs import Leadership, _leadership, _lock_of
from .timing import _slot

__all__ = ["SchedulerBinding", "bind_scheduler"]

log = get_logger("pgleaderlock.integrations.apscheduler")


class SchedulerBinding:
    """Run ``scheduler``'s jobs only on the leader, each run time at most once across
    the replicas: paused on followers, resumed on the leader, and every run's slot
    claimed in the ledger before it runs.

    ``bind_scheduler(scheduler, lock, ...)`` is this class: keep what it returns to
    [`close`][pgleaderlock.integrations.apscheduler.SchedulerBinding.close] the binding.
    [`sync`][pgleaderlock.integrations.apscheduler.SchedulerBinding.sync] is safe from
    any thread.

    Call it before or after ``scheduler.start()``: a scheduler that starts while the lock
    is not LEADER is paused before it processes any job (and a lock that is never
    started keeps it paused). The binding owns ``pause()``/``resume()`` from then on.

    **Ledger mode** (the default; needs a lock with ``Fencing(enabled=True)``): each
    run time APScheduler submits is a slot of the job (keyed ``<lock>:<job id>``, the run
    time rounded to the millisecond) in the ledger of
    [`pgleaderlock.schedule`][pgleaderlock.schedule], claimed under the lock's fencing
    term on the session that holds the lock before the job runs, so no slot runs twice
    across the fleet, whatever the timing of a fail-over. When the lock becomes LEADER,
    the slots that fell due while nobody ran them are settled: those within the job's
    ``misfire_grace_time`` run now (late); older ones follow the policy's ``catch_up``; a
    slot whose leader died mid-run follows its ``interrupted``. Give every job an
    explicit ``id`` and fixed run times (cron, date, or interval with a fixed
    ``start_date``): every replica must name the same slots. Triggers with ``jitter``
    are refused (``job_refused``). Jobs must run in this process (the asyncio and thread
    pool executors): a process pool is refused, here and by the scheduler's
    ``add_executor``.

    Listeners hear what APScheduler sends: a run time later than the job's
    ``misfire_grace_time`` is ``EVENT_JOB_MISSED`` (and ``missed`` in the ledger). A run
    time this replica does not run because its slot is another's (claimed already, or
    the lock no longer leads) has no outcome event here (``job_skipped`` in the log). A
    run-once or ``date`` job whose run time passed before the lock led is submitted when
    it leads, and its claim decides (so one added before ``start()`` runs once). The
    guide's table lists where a bound scheduler differs from a plain one, and why.

    When the lock leaves LEADER the scheduler is paused at once: no new run starts. A run
    already in progress is not interrupted (APScheduler cannot cancel one); decorate
    coroutine jobs with [`leader_only`][pgleaderlock.integrations.apscheduler.leader_only]
    too if they must stop at once. In ledger mode its slot stays ``running``, for the
    next leader's ``interrupted`` policy.

    **``ledger=False``** keeps the earlier behaviour: when the lock becomes LEADER, every
    job whose next run time has already passed (minus ``catch_up_s``) is moved to its
    first fire time at or after now, so a run time that falls due during the hand-over
    is missed (or, with ``catch_up_s``, may run on both the old and the new leader).

    Args:
        scheduler: an APScheduler 3.x scheduler (``AsyncIOScheduler`` with a lock on the
            same loop, ``BackgroundScheduler`` with a
            [`ThreadedLeaderLock`][pgleaderlock.ThreadedLeaderLock], ...).
        lock: the lock, or a [`ThreadedLeaderLock`][pgleaderlock.ThreadedLeaderLock].
        ledger: claim every run in the ledger (default). ``False``: the earlier
            behaviour, without the ledger (and without the need for fencing).
        policy: ledger mode, what a leader does with the slots nobody ran (see
            [`Policy`][pgleaderlock.schedule.Policy]): ``catch_up`` for the slots that
            fell due while nobody led, later than the job's ``misfire_grace_time`` when a
            leader looks (default ``"latest"``: the newest of them runs), with at most
            ``max_catch_up`` of them for ``"all"``; ``interrupted`` for a slot whose
            leader ended mid-run (default ``"lost"``). Its ``misfire_grace_s`` is not
            used: each job's ``misfire_grace_time`` is its grace (a policy that sets it
            is refused), nor is its ``retry``: a policy with more than one attempt is
            refused (a run that raises is recorded ``failed``, not retried).
        catch_up_s: with ``ledger=False`` only: run times up to this many seconds before
            the hand-over are left to APScheduler's misfire handling instead of being
            skipped, at the price that such a run may execute on both the old and the new
            leader.
        **deprecated: ``catch_up``, ``max_catch_up`` and ``interrupted``, the fields of
            ``policy``: still taken for this release, with a ``DeprecationWarning``.

    Raises:
        ConfigurationError: ledger mode on a lock without fencing, bad arguments, a
            ``policy`` with ``ledger=False`` or with retries, or both ``policy`` and a
            deprecated keyword; ledger mode on a scheduler with a process pool executor.

    """

    def __init__(
        self,
        scheduler: Any,
        lock: Leadership,
        *,
        ledger: bool = True,
        policy: Policy | None = None,
        catch_up_s: float = 0.0,
        **deprecated: Unpack[PolicyKeywords],
    ) -> None:
        chosen = policy_from(policy, deprecated, where="bind_scheduler")
        catch_up_s = not_negative("catch_up_s", catch_up_s)
        if not callable(getattr(scheduler, "pause", None)) or not hasattr(scheduler, "state"):
            raise ConfigurationError(f"expected an APScheduler 3.x scheduler, got {scheduler!r}")
        self._scheduler = scheduler
        self._lock = _lock_of(lock)
        self._ledger: _SlotLedger | None = None
        if ledger:
            if catch_up_s:
                raise ConfigurationError(
                    "catch_up_s belongs to bind_scheduler(..., ledger=False); the ledger "
                    "mode catches up by its policy= and each job's misfire_grace_time"
                )
            if chosen.misfire_grace_s != Policy().misfire_grace_s:
                raise ConfigurationError(
                    "bind_scheduler: each APScheduler job's misfire_grace_time is its grace; "
                    "leave Policy.misfire_grace_s unset (give the job misfire_grace_time=)"
                )
            if chosen.retry.max_attempts > 1:
                raise ConfigurationError(
                    "bind_scheduler: Policy.retry is not supported: APScheduler's executor "
                    "runs the job, and a failed run's slot is recorded failed; retry inside "
                    "the job, or schedule it with pgleaderlock.schedule.Scheduler"
                )
            if lock_settings(self._lock).term_table is None:
                raise ConfigurationError(
                    "bind_scheduler claims every run in the ledger under the lock's fencing "
                    "term: it needs LeaderLock(..., fencing=True). To bind without the "
                    "ledger (a run time that falls due during a fail-over may be missed), "
                    "pass ledger=False"
                )
            for executor in adapter.executors(scheduler):
                self._refuse_out_of_process(executor)
            threaded = lock if isinstance(lock, ThreadedLeaderLock) else None
            self._ledger = _SlotLedger(self._lock, threaded, chosen)
        elif chosen != Policy():
            raise ConfigurationError(
                "bind_scheduler: policy= belongs to the ledger mode; with ledger=False the "
                "hand-over is tuned by catch_up_s"
            )
        self._catch_up = dt.timedelta(seconds=catch_up_s)
        self._mutex = threading.RLock()  # scheduler listeners may call sync() again
        self._closed = False
        self._term: int | None = None
        self._settling: set[concurrent.futures.Future[None]] = set()
        self._plugin = follow_state(self._lock, self._on_state_change)
        scheduler.add_listener(self._on_scheduler_event, _BINDING_EVENTS)
        self._wrap_executors()
        if self._ledger is not None:
            adapter.guard_add_executor(scheduler, self._check_executor)
        self.sync()

    @property
    def scheduler(self) -> Any:
        """The bound scheduler."""
        return self._scheduler

    @property
    def ledger(self) -> bool:
        """True in ledger mode: every run's slot is claimed in the ledger first."""
        return self._ledger is not None

    @property
    def schedule(self) -> Scheduler | None:
        """In ledger mode: the [`Scheduler`][pgleaderlock.schedule.Scheduler] whose
        ledger the runs are claimed in (a job's rows are named ``<lock>:<job id>``);
        ``None`` with ``ledger=False``."""
        return None if self._ledger is None else self._ledger.schedule

    @property
    def active(self) -> bool:
        """True while the scheduler is running (not paused) under this binding."""
        return bool(self._scheduler.state == adapter.STATE_RUNNING)

    @property
    def term(self) -> int | None:
        """With ``fencing=True``: the fencing term of the leadership the scheduler was
        resumed under; ``None`` while it is not running under this binding, and always
        without fencing.

        Every run of a bound scheduler is submitted while the lock leads, so a job that
        reads this first thing learns the term it runs under. A run that outlives the
        leadership (the scheduler is paused, the run goes on) and reads it later gets
        ``None``, or a newer term after a re-acquisition: read it once at the start, or
        (ledger mode) call [`current_run`][pgleaderlock.integrations.apscheduler.current_run]
        or [`current_term`][pgleaderlock.integrations.apscheduler.current_term], which
        are fixed per run.
        """
        return self._term if self.active else None

    def close(self) -> None:
        """Stop following the lock; the scheduler stays as it is (its runs are no longer
        claimed in the ledger)."""
        with self._mutex:
            if self._closed:
                return
            self._closed = True
        if self._lock.plugins.is_registered(self._plugin):
            self._lock.plugins.unregister(self._plugin)
        self._scheduler.remove_listener(self._on_scheduler_event)
        for future in list(self._settling):
            future.cancel()

    def _on_state_change(self, old: LockState, new: LockState) -> None:
        if self._ledger is not None:
            self._ledger.loop = asyncio.get_running_loop()
        if LockState.LEADER in (old, new):
            self.sync()

    def _on_scheduler_event(self, event: Any) -> None:
        self._wrap_executors()
        if event.code == adapter.EVENT_SCHEDULER_STARTED:
            self.sync(started=True)

    @staticmethod
    def _refuse_out_of_process(executor: Any) -> None:
        if adapter.out_of_process(executor):
            raise ConfigurationError(
                f"bind_scheduler: {type(executor).__name__} runs jobs in other processes, "
                "where the ledger's claim of each run cannot go (the job would never run). "
                "Run the job on a ThreadPoolExecutor (BackgroundScheduler's default) or an "
                "AsyncIOExecutor and hand its CPU-bound work to a process pool from inside "
                "the job (concurrent.futures.ProcessPoolExecutor), or bind with ledger=False"
            )

    def _check_executor(self, executor: Any, alias: str) -> None:
        """Ledger mode: what the bound scheduler's ``add_executor`` refuses."""
        if not self._closed:
            self._refuse_out_of_process(executor)

    def _wrap_executors(self) -> None:
        """In ledger mode, have each of the scheduler's executors submit every job
        through the ledger (idempotent; executors are added at start-up or later)."""
        if self._ledger is None:
            return
        for executor in adapter.executors(self._scheduler):
            adapter.wrap_submit(executor, self, self._submit_through_ledger)

    def _submit_through_ledger(
        self, submit: adapter.Submit, job: Any, run_times: list[dt.datetime]
    ) -> Any:
        return submit(*self._through_ledger(job, run_times))

    def _through_ledger(self, job: Any, run_times: list[dt.datetime]) -> tuple[Any, Any]:
        ledger = self._ledger
        if ledger is None or self._closed:
            return job, run_times
        spec = ledger.job(job)
        if spec is None:  # refused (logged): nothing runs
            return _SlotJob(job, None, [], ledger), []
        due = [_Due(at) for at in run_times]
        return _SlotJob(job, spec, due, ledger), run_times

    def sync(self, *, started: bool = False) -> None:
        """Pause or resume the scheduler to match the lock's state now."""
        with self._mutex:
            if self._closed:
                return
            scheduler = self._scheduler
            leads, term = _leadership(self._lock)
            self._term = term
            try:
                if leads:
                    if scheduler.state == adapter.STATE_PAUSED:
                        jobs = scheduler.get_jobs()
                        cutoff, last = self._skip_followers_runs(jobs)
                        scheduler.resume()
                        log.info("scheduler_resumed", lock=self._lock.label)
                        if self._ledger is not None and term is not None:
                            self._settle_later(jobs, cutoff, last)
                    elif started and self._ledger is not None and term is not None:
                        # The lock led before the scheduler started: settle the past
                        # now; APScheduler submits each job's run times from its next.
                        jobs = scheduler.get_jobs()
                        own = {j.id: _slot(j.next_run_time) for j in jobs if j.next_run_time}
                        self._settle_later(jobs, dt.datetime.now(dt.UTC), own)
                elif scheduler.state == adapter.STATE_RUNNING:
                    scheduler.pause()
                    log.info("scheduler_paused", lock=self._lock.label)
            except adapter.SchedulerNotRunningError:
                pass  # shut down meanwhile: nothing to pause or resume

    def _skip_followers_runs(self, jobs: list[Any]) -> tuple[dt.datetime, dict[str, dt.datetime]]:
        """Move every job whose next run time lies before the hand-over to its first
        fire time at or after it (or remove it if it has none, like a past date job).
        In ledger mode a job whose next run time is its last one (a run-once or ``date``
        job) is left as it is: APScheduler submits that run time now, and its claim
        says whether it is this replica's to run (or report missed), or ran elsewhere.
        Returns the hand-over time (the cutoff), and those jobs' last run times."""
        now = dt.datetime.now(getattr(self._scheduler, "timezone", None) or dt.UTC)
        cutoff = now - self._catch_up
        last: dict[str, dt.datetime] = {}
        for job in jobs:
            next_run = job.next_run_time
            if next_run is None or next_run >= cutoff:
                continue  # paused by the user, or not due yet
            if (
                self._ledger is not None
                and job.trigger.get_next_fire_time(next_run, next_run) is None
            ):
                last[job.id] = _slot(next_run)
                continue
            upcoming = job.trigger.get_next_fire_time(None, cutoff)
            if upcoming is None or upcoming < cutoff:
                log.info(
                    "job_expired",
                    job=job.id,
                    lock=self._lock.label,
                    reason="its only run time passed earlier",
                )
                job.remove()
                continue
            log.debug(
                "job_fast_forwarded", job=job.id, lock=self._lock.label, was=next_run, now=upcoming
            )
            job.modify(next_run_time=upcoming)
        return cutoff, last

    def _settle_later(
        self, jobs: list[Any], cutoff: dt.datetime, own: dict[str, dt.datetime]
    ) -> None:
        """On the lock's loop: settle each job's past in the ledger (interrupted and
        missed slots), then submit the run times to run now (but not those from a job's
        ``own`` run time on: APScheduler submits them)."""
        assert self._ledger is not None
        loop = self._ledger.lock_loop()
        if loop is None:
            return
        future = asyncio.run_coroutine_threadsafe(self._settle(jobs, cutoff, own), loop)
        self._settling.add(future)
        future.add_done_callback(self._settling.discard)

    async def _settle(
        self, jobs: list[Any], cutoff: dt.datetime, own: dict[str, dt.datetime]
    ) -> None:
        ledger = self._ledger
        assert ledger is not None
        for job in jobs:
            spec = ledger.job(job)
            if spec is None:
                continue
            try:
                todo = await ledger.schedule.settle(spec, cutoff)
            except _NOT_CLAIMED as exc:
                log.info("catch_up_stopped", job=job.id, lock=self._lock.label,
                         reason="leadership lost", detail=str(exc))  # fmt: skip
                return
            except Exception as exc:  # a refused table, ...: this job's catch-up only
                log.error("catch_up_failed", job=job.id, lock=self._lock.label, exc=exc)
                continue
            if job.id in own:
                todo = [(slot, rerun) for slot, rerun in todo if slot < own[job.id]]
            if not todo:
                continue
            grace = dt.timedelta(seconds=spec.policy.misfire_grace_s)
            now = dt.datetime.now(dt.UTC)
            due = [
                _Due(slot, forced=rerun or now - slot > grace, rerun=rerun) for slot, rerun in todo
            ]
            if job.coalesce:  # as APScheduler rolls missed run times into one
                fresh = [d for d in due if not d.forced]
                due = [d for d in due if d.forced] + fresh[-1:]
            self._submit(job, spec, due)

    def _submit(self, job: Any, spec: Job, due: list[_Due]) -> None:
        assert self._ledger is not None
        try:
            executor = adapter.executor_of(self._scheduler, job)
            stand_in = _SlotJob(job, spec, due, self._ledger)
            adapter.submit_unwrapped(self._scheduler, executor, stand_in, [d.at for d in due])
        except Exception as exc:  # MaxInstancesReachedError, a removed executor, ...
            log.warning("catch_up_skipped", job=job.id, lock=self._lock.label,
                        run_times=[d.at.isoformat() for d in due],
                        reason=f"{type(exc).__name__}: {exc}")  # fmt: skip
        else:
            log.info("catch_up_submitted", job=job.id, lock=self._lock.label,
                     run_times=[d.at.isoformat() for d in due])  # fmt: skip


_BINDING_EVENTS = adapter.EVENT_SCHEDULER_STARTED | adapter.EVENT_EXECUTOR_ADDED


bind_scheduler = SchedulerBinding
"""Bind ``scheduler`` to ``lock``: ``bind_scheduler(scheduler, lock, ...)`` makes a
[`SchedulerBinding`][pgleaderlock.integrations.apscheduler.SchedulerBinding] (see there
for what it does and its arguments)."""
