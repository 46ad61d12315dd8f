"""The one place that touches APScheduler 3.x itself: its imports, and the few internals
a bound scheduler needs (its executors and ``add_executor``, an executor's own
``submit_job`` and its report of a run's events, a job's job store). Every other module
of the integration goes through these functions, and
``tests/frameworks/test_apscheduler_adapter.py`` runs them against each APScheduler
version the ``apscheduler`` extra supports (``>=3.10.2,<4``)."""

from __future__ import annotations

import concurrent.futures
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ..._extras import needs_extra

with needs_extra("pgleaderlock.integrations.apscheduler", "APScheduler 3.x", "apscheduler"):
    from apscheduler.events import (
        EVENT_EXECUTOR_ADDED,
        EVENT_JOB_EXECUTED,
        EVENT_JOB_MAX_INSTANCES,
        EVENT_JOB_MISSED,
        EVENT_JOB_SUBMITTED,
        EVENT_SCHEDULER_STARTED,
        JobExecutionEvent,
        JobSubmissionEvent,
    )
    from apscheduler.executors.base import MaxInstancesReachedError
    from apscheduler.executors.pool import ProcessPoolExecutor
    from apscheduler.schedulers import SchedulerNotRunningError
    from apscheduler.schedulers.base import STATE_PAUSED, STATE_RUNNING
    from apscheduler.util import iscoroutinefunction_partial

__all__ = [
    "EVENT_EXECUTOR_ADDED",
    "EVENT_SCHEDULER_STARTED",
    "STATE_PAUSED",
    "STATE_RUNNING",
    "NotRun",
    "SchedulerNotRunningError",
    "executor_of",
    "executors",
    "guard_add_executor",
    "is_async",
    "out_of_process",
    "stand_in_for",
    "submit_unwrapped",
    "wrap_submit",
]

Submit = Callable[[Any, list[Any]], Any]
"""An executor's ``submit_job(job, run_times)``."""

_MARK = "_pgleaderlock_binding"
"""The attribute by which an executor names the owner that wrapped its ``submit_job``."""


def is_async(func: Any) -> bool:
    """Whether APScheduler runs ``func`` as a coroutine (a partial of one included)."""
    return bool(iscoroutinefunction_partial(func))


def executors(scheduler: Any) -> list[Any]:
    """The executors ``scheduler`` has now (added at start-up or later)."""
    with scheduler._executors_lock:
        return list(scheduler._executors.values())


def executor_of(scheduler: Any, job: Any) -> Any:
    """The executor that runs ``job``.

    Raises:
        KeyError: the scheduler has no such executor (any more).
    """
    return scheduler._lookup_executor(job.executor)


@dataclass(frozen=True)
class NotRun:
    """What a stand-in's ``func`` returns for a run time it did not run. Its executor
    (wrapped by `wrap_submit`) reports it as APScheduler would: ``missed`` (later than
    the job's ``misfire_grace_time``) as ``EVENT_JOB_MISSED``; otherwise (its slot ran,
    or is left, to another replica or leadership) as nothing, not as executed."""

    missed: bool


def _as_reported(events: list[Any]) -> list[Any]:
    """``events`` of one submission, each run time a stand-in did not run as
    `NotRun` says."""
    reported = []
    for event in events:
        retval = getattr(event, "retval", None)
        if event.code != EVENT_JOB_EXECUTED or not isinstance(retval, NotRun):
            reported.append(event)
        elif retval.missed:  # the event APScheduler's ``run_job`` sends for a misfire
            reported.append(JobExecutionEvent(EVENT_JOB_MISSED, event.job_id, event.jobstore,
                                              event.scheduled_run_time))  # fmt: skip
    return reported


def wrap_submit(
    executor: Any, owner: object, through: Callable[[Submit, Any, list[Any]], Any]
) -> bool:
    """Have ``executor`` submit every job as ``through(submit, job, run_times)``, where
    ``submit`` is its own ``submit_job``, and report the run times a stand-in returned
    `NotRun` for as that says. Idempotent per ``owner``: returns False when ``owner``
    wrapped it already."""
    if getattr(executor, _MARK, None) is owner:
        return False
    submit = type(executor).submit_job.__get__(executor)
    succeeded = type(executor)._run_job_success.__get__(executor)

    def submit_job(job: Any, run_times: list[Any]) -> Any:
        return through(submit, job, run_times)

    def run_job_success(job_id: str, events: list[Any]) -> None:
        succeeded(job_id, _as_reported(events))

    executor.submit_job = submit_job
    executor._run_job_success = run_job_success
    setattr(executor, _MARK, owner)
    return True


def out_of_process(executor: Any) -> bool:
    """Whether ``executor`` runs jobs in other processes (it pickles them)."""
    pool = getattr(executor, "_pool", None)
    return isinstance(executor, ProcessPoolExecutor) or isinstance(
        pool, concurrent.futures.ProcessPoolExecutor
    )


def guard_add_executor(scheduler: Any, check: Callable[[Any, str], None]) -> None:
    """Have ``scheduler.add_executor`` (also what ``configure`` calls) call
    ``check(executor, alias)`` first, on the executor instance (one named by its
    plugin is made first): ``check`` raises to refuse it."""
    add = type(scheduler).add_executor.__get__(scheduler)

    def add_executor(executor: Any, alias: str = "default", **executor_opts: Any) -> None:
        if isinstance(executor, str):
            executor = scheduler._create_plugin_instance("executor", executor, executor_opts)
        check(executor, alias)
        add(executor, alias)

    scheduler.add_executor = add_executor


def submit_unwrapped(scheduler: Any, executor: Any, job: Any, run_times: list[Any]) -> None:
    """Submit ``job`` to ``executor`` past any wrapper of `wrap_submit`, and tell
    ``scheduler``'s listeners as its own loop does: ``EVENT_JOB_SUBMITTED``, or
    ``EVENT_JOB_MAX_INSTANCES`` (then raise).

    Raises:
        MaxInstancesReachedError: as ``submit_job`` does.
    """
    alias = getattr(job, "_jobstore_alias", None)
    try:
        type(executor).submit_job(executor, job, run_times)
    except MaxInstancesReachedError:
        scheduler._dispatch_event(
            JobSubmissionEvent(EVENT_JOB_MAX_INSTANCES, job.id, alias, run_times)
        )
        raise
    scheduler._dispatch_event(JobSubmissionEvent(EVENT_JOB_SUBMITTED, job.id, alias, run_times))


def stand_in_for(stand_in: Any, job: Any) -> None:
    """Make ``stand_in`` (an object with its own ``func``, ``args``, ``kwargs``) one an
    executor runs in place of ``job``: the identity APScheduler's executors read (its
    events name the job and its job store). Its ``misfire_grace_time`` is ``None``: the
    stand-in checks lateness itself, per run time."""
    stand_in.id = job.id
    stand_in.name = job.name
    stand_in.max_instances = job.max_instances
    stand_in.misfire_grace_time = None
    stand_in._jobstore_alias = getattr(job, "_jobstore_alias", None)
