"""The one place that touches APScheduler 3.x itself: its imports, and the few internals
a bound scheduler needs (its executors, an executor's own ``submit_job``, a job's job
store). Every other module of the integration goes through these functions, and
``tests/frameworks/test_apscheduler_adapter.py`` runs them against each APScheduler
version the ``apscheduler`` extra supports (``>=3.10.2,<4``)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from ..._extras import missing_extra

try:
    from apscheduler.events import EVENT_EXECUTOR_ADDED, EVENT_SCHEDULER_STARTED
    from apscheduler.schedulers import SchedulerNotRunningError
    from apscheduler.schedulers.base import STATE_PAUSED, STATE_RUNNING
    from apscheduler.util import iscoroutinefunction_partial
except ImportError as exc:  # pragma: no cover - exercised by a test that hides apscheduler
    raise missing_extra("pgleaderlock.integrations.apscheduler", "APScheduler 3.x", "apscheduler",
                        exc) from exc  # fmt: skip

__all__ = [
    "EVENT_EXECUTOR_ADDED",
    "EVENT_SCHEDULER_STARTED",
    "STATE_PAUSED",
    "STATE_RUNNING",
    "SchedulerNotRunningError",
    "executor_of",
    "executors",
    "is_async",
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


def wrap_submit(
    executor: Any, owner: object, through: Callable[[Submit, Any, list[Any]], Any]
) -> bool:
    """Have ``executor`` submit every job as ``through(submit, job, run_times)``, where
    ``submit`` is its own ``submit_job``. Idempotent per ``owner``: returns False when
    ``owner`` wrapped it already."""
    if getattr(executor, _MARK, None) is owner:
        return False
    submit = type(executor).submit_job.__get__(executor)

    def submit_job(job: Any, run_times: list[Any]) -> Any:
        return through(submit, job, run_times)

    executor.submit_job = submit_job
    setattr(executor, _MARK, owner)
    return True


def submit_unwrapped(executor: Any, job: Any, run_times: list[Any]) -> Any:
    """Submit ``job`` to ``executor`` past any wrapper of
    ``wrap_submit``.

    Raises:
        MaxInstancesReachedError: as ``submit_job`` does.
    """
    return type(executor).submit_job(executor, job, run_times)


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
