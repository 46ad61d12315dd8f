"""The APScheduler adapter: the one module of the integration that touches APScheduler's
internals, run against the installed APScheduler. The extra supports
``apscheduler>=3.10.2,<4``: run this file under each version that matters (the floor
and the newest 3.x) when the floor or APScheduler changes."""

from __future__ import annotations

import ast
import datetime as dt
import functools
import importlib.metadata
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from apscheduler.events import (
    EVENT_JOB_ERROR,
    EVENT_JOB_EXECUTED,
    EVENT_JOB_MAX_INSTANCES,
    EVENT_JOB_MISSED,
    EVENT_JOB_SUBMITTED,
    JobExecutionEvent,
    JobSubmissionEvent,
)
from apscheduler.executors.base import MaxInstancesReachedError
from apscheduler.executors.pool import ProcessPoolExecutor, ThreadPoolExecutor
from apscheduler.schedulers.background import BackgroundScheduler

from pgleaderlock.integrations.apscheduler import adapter
from support.poll import eventually_sync

pytestmark = pytest.mark.timeout(30)


def version(text: str) -> tuple[int, ...]:
    return tuple(int(part) for part in text.split(".")[:3])


def test_the_installed_apscheduler_is_one_the_extra_supports() -> None:
    installed = version(importlib.metadata.version("apscheduler"))
    assert version("3.10.2") <= installed < (4,), installed


@pytest.fixture
def scheduler() -> Iterator[BackgroundScheduler]:
    sched = BackgroundScheduler(executors={"extra": ThreadPoolExecutor(2)}, timezone="UTC")
    try:
        yield sched
    finally:
        if sched.running:
            sched.shutdown(wait=True)


def executed(sched: BackgroundScheduler) -> list[JobExecutionEvent]:
    events: list[JobExecutionEvent] = []
    sched.add_listener(events.append, EVENT_JOB_EXECUTED)
    return events


def test_executors_are_those_configured_started_and_added_later(
    scheduler: BackgroundScheduler,
) -> None:
    before = adapter.executors(scheduler)
    assert len(before) == 1
    scheduler.start(paused=True)
    started = adapter.executors(scheduler)
    assert before[0] in started
    assert len(started) == 2  # the default executor comes at start
    later = ThreadPoolExecutor(1)
    scheduler.add_executor(later, "later")
    assert later in adapter.executors(scheduler)
    assert len(adapter.executors(scheduler)) == 3


def test_executor_of_is_the_executor_a_job_names(scheduler: BackgroundScheduler) -> None:
    scheduler.start(paused=True)
    job = scheduler.add_job(print, "interval", seconds=60, id="j", executor="extra")
    extra = [e for e in adapter.executors(scheduler) if e is adapter.executor_of(scheduler, job)]
    assert len(extra) == 1
    default = scheduler.add_job(print, "interval", seconds=60, id="d")
    assert adapter.executor_of(scheduler, default) is not extra[0]

    class Stray:
        executor = "nowhere"

    with pytest.raises(KeyError):
        adapter.executor_of(scheduler, Stray())


def test_a_wrapped_executor_submits_every_run_through_the_wrapper_once(
    scheduler: BackgroundScheduler,
) -> None:
    seen: list[tuple[str, int]] = []
    ran = threading.Event()
    owner = object()

    def through(submit: adapter.Submit, job: Any, run_times: list[Any]) -> Any:
        seen.append((job.id, len(run_times)))
        return submit(job, run_times)

    scheduler.start(paused=True)
    executor = adapter.executor_of(scheduler, scheduler.add_job(ran.set, id="once"))
    assert adapter.wrap_submit(executor, owner, through)
    assert not adapter.wrap_submit(executor, owner, through)  # once per owner
    events = executed(scheduler)
    scheduler.resume()
    assert ran.wait(10)
    eventually_sync(lambda: events, 10, "EVENT_JOB_EXECUTED")
    assert seen == [("once", 1)]
    assert adapter.wrap_submit(executor, object(), through)  # another owner wraps anew


def test_submit_unwrapped_goes_past_the_wrapper_and_tells_the_listeners(
    scheduler: BackgroundScheduler,
) -> None:
    """As the scheduler's loop: ``EVENT_JOB_SUBMITTED``; ``EVENT_JOB_MAX_INSTANCES`` and
    ``MaxInstancesReachedError`` while a run of a ``max_instances=1`` job goes on."""
    seen: list[str] = []
    ran, release = threading.Event(), threading.Event()
    heard: list[JobSubmissionEvent] = []
    scheduler.add_listener(heard.append, EVENT_JOB_SUBMITTED | EVENT_JOB_MAX_INSTANCES)
    scheduler.start(paused=True)

    def blocks() -> None:
        ran.set()
        release.wait(10)

    job = scheduler.add_job(blocks, "interval", seconds=3600, id="hourly")
    executor = adapter.executor_of(scheduler, job)
    adapter.wrap_submit(executor, object(), lambda submit, j, times: seen.append(j.id))
    now = [dt.datetime.now(dt.UTC)]
    adapter.submit_unwrapped(scheduler, executor, job, now)
    assert ran.wait(10)
    with pytest.raises(MaxInstancesReachedError):
        adapter.submit_unwrapped(scheduler, executor, job, now)
    release.set()
    assert seen == []
    assert [(e.code, e.job_id, e.scheduled_run_times) for e in heard] == [
        (EVENT_JOB_SUBMITTED, "hourly", now),
        (EVENT_JOB_MAX_INSTANCES, "hourly", now),
    ]


class StandIn:
    """What the integration hands an executor in place of a job: its own function."""

    def __init__(self, result: str) -> None:
        self.func: Callable[[], object] = functools.partial(str, result)
        self.args: tuple[Any, ...] = ()
        self.kwargs: dict[str, Any] = {}


def test_a_stand_in_runs_and_is_reported_as_the_job_however_late(
    scheduler: BackgroundScheduler,
) -> None:
    scheduler.add_jobstore("memory", "store")
    scheduler.start(paused=True)
    job = scheduler.add_job(print, "interval", seconds=3600, id="hourly", jobstore="store",
                            misfire_grace_time=1)  # fmt: skip
    events = executed(scheduler)
    stand_in = StandIn("from the stand-in")
    adapter.stand_in_for(stand_in, job)
    assert getattr(stand_in, "misfire_grace_time", 0) is None
    a_day_ago = dt.datetime.now(dt.UTC) - dt.timedelta(days=1)  # far past the job's grace
    adapter.submit_unwrapped(scheduler, adapter.executor_of(scheduler, job), stand_in, [a_day_ago])
    eventually_sync(lambda: events, 10, "EVENT_JOB_EXECUTED")
    (event,) = events
    assert (event.job_id, event.jobstore, event.retval) == ("hourly", "store", "from the stand-in")
    assert event.scheduled_run_time == a_day_ago


def test_a_wrapped_executor_reports_what_a_stand_in_did_not_run_as_apscheduler_would(
    scheduler: BackgroundScheduler,
) -> None:
    """``NotRun(missed=True)``: ``EVENT_JOB_MISSED``, as ``run_job`` sends for a misfire;
    ``NotRun(missed=False)``: nothing; any other result: ``EVENT_JOB_EXECUTED``."""
    scheduler.start(paused=True)
    job = scheduler.add_job(print, "interval", seconds=3600, id="hourly")
    executor = adapter.executor_of(scheduler, job)
    adapter.wrap_submit(executor, object(), lambda submit, j, times: submit(j, times))
    heard: list[JobExecutionEvent] = []
    scheduler.add_listener(heard.append, EVENT_JOB_EXECUTED | EVENT_JOB_ERROR | EVENT_JOB_MISSED)
    results = iter([adapter.NotRun(missed=True), adapter.NotRun(missed=False), "ran"])
    stand_in = StandIn("")
    stand_in.func = lambda: next(results)
    adapter.stand_in_for(stand_in, job)
    now = dt.datetime.now(dt.UTC)
    times = [now - dt.timedelta(seconds=s) for s in (3, 2, 1)]
    adapter.submit_unwrapped(scheduler, executor, stand_in, times)
    eventually_sync(lambda: len(heard) >= 2, 10, "two events")
    assert [(e.code, e.job_id, e.scheduled_run_time) for e in heard] == [
        (EVENT_JOB_MISSED, "hourly", times[0]),
        (EVENT_JOB_EXECUTED, "hourly", times[2]),
    ]
    assert heard[1].retval == "ran"


def test_out_of_process_executors_and_a_guarded_add_executor() -> None:
    pool = ProcessPoolExecutor(1)
    try:
        assert adapter.out_of_process(pool)
        assert not adapter.out_of_process(ThreadPoolExecutor(1))
        sched = BackgroundScheduler()
        checked: list[tuple[type, str]] = []

        def check(executor: Any, alias: str) -> None:
            checked.append((type(executor), alias))
            if adapter.out_of_process(executor):
                raise ValueError(alias)

        adapter.guard_add_executor(sched, check)
        with pytest.raises(ValueError, match="cpu"):
            sched.add_executor("processpool", "cpu")
        with pytest.raises(ValueError, match="cpu"):
            sched.configure(executors={"cpu": pool})
        sched.add_executor("threadpool", "io", max_workers=2)
        assert [e for e in adapter.executors(sched) if not adapter.out_of_process(e)]
        assert not [e for e in adapter.executors(sched) if adapter.out_of_process(e)]
        sched.start(paused=True)  # its default executor goes through the check too
        sched.shutdown()
        assert checked[-1] == (ThreadPoolExecutor, "default")
        assert (ThreadPoolExecutor, "io") in checked
    finally:
        pool.shutdown(wait=True)


def test_is_async_as_apscheduler_decides_it() -> None:
    async def coroutine_job(x: int) -> None: ...

    def plain_job(x: int) -> None: ...

    assert adapter.is_async(coroutine_job)
    assert adapter.is_async(functools.partial(coroutine_job, 1))
    assert not adapter.is_async(plain_job)
    assert not adapter.is_async(functools.partial(plain_job, 1))


def test_the_states_and_events_the_binding_reads() -> None:
    sched = BackgroundScheduler()
    assert sched.state not in (adapter.STATE_RUNNING, adapter.STATE_PAUSED)
    sched.start(paused=True)
    try:
        assert sched.state == adapter.STATE_PAUSED
        sched.resume()
        assert sched.state == adapter.STATE_RUNNING
    finally:
        sched.shutdown()
    with pytest.raises(adapter.SchedulerNotRunningError):
        sched.pause()
    assert adapter.EVENT_SCHEDULER_STARTED & adapter.EVENT_EXECUTOR_ADDED == 0


def test_no_other_module_of_the_integration_touches_apscheduler() -> None:
    """The adapter is the one place: the integration's other modules neither import
    APScheduler nor read the internals the adapter wraps."""
    package = Path(adapter.__file__).parent
    internals = {
        *("_executors", "_executors_lock", "_lookup_executor", "_jobstore_alias"),
        *("_run_job_success", "_create_plugin_instance", "_pool", "_dispatch_event"),
    }
    others = [path for path in sorted(package.glob("*.py")) if path.name != "adapter.py"]
    assert len(others) >= 5
    for path in others:
        tree = ast.parse(path.read_text(), str(path))
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                names = [node.module or ""] if node.level == 0 else []
            else:
                names = []
            assert not [n for n in names if n.split(".")[0] == "apscheduler"], path.name
            if isinstance(node, ast.Attribute):
                assert node.attr not in internals, f"{path.name}:{node.lineno}"
            if isinstance(node, ast.Constant) and isinstance(node.value, str):
                assert node.value not in internals, f"{path.name}:{node.lineno}"
    touched = ast.dump(ast.parse((package / "adapter.py").read_text()))
    assert all(name in touched for name in internals)  # the scan looks for real names
