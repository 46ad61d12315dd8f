"""Ledger mode's runs: the ledger calls of a bound scheduler (made on the lock's event
loop from the scheduler's threads or loops), and the stand-in job an executor runs,
which claims each run time's slot before the job runs and records how it ended."""

from __future__ import annotations

import asyncio
import collections
import contextlib
import contextvars
import dataclasses
import datetime as dt
import functools
import re
from collections.abc import Callable, Coroutine, Generator
from dataclasses import dataclass
from typing import Any, TypeVar

from ...lowlevel import MAX_SECONDS, ConfigurationError, FencedError, LeaderLock, get_logger
from ...schedule.policy import Policy
from ...schedule.scheduler import Job, Run, Scheduler, check_job_name
from ...threaded import ThreadedLeaderLock
from . import adapter
from .runs import _RUN, _run_context
from .timing import _slot, _TriggerTiming

__all__ = ["LEDGER_TIMEOUT_S"]

log = get_logger("pgleaderlock.integrations.apscheduler")

R = TypeVar("R")


async def _timed_by_apscheduler(run: Run) -> None:  # pragma: no cover - never called
    raise RuntimeError("an APScheduler job's ledger entry is run by APScheduler")


class _SlotLedger:
    """The ledger calls of a bound scheduler, made on the lock's event loop from the
    scheduler's threads or loops (each bounded by ``LEDGER_TIMEOUT_S``)."""

    def __init__(self, lock: LeaderLock, threaded: ThreadedLeaderLock | None, policy: Policy):
        self.lock = lock
        self.schedule = Scheduler(lock)
        self.policy = policy
        self._threaded = threaded
        self.loop: asyncio.AbstractEventLoop | None = None
        with contextlib.suppress(RuntimeError):
            self.loop = asyncio.get_running_loop()  # a LeaderLock is bound on its own loop
        self._jobs: dict[tuple[str, str], Job] = {}
        self._warned: set[str] = set()

    def lock_loop(self) -> asyncio.AbstractEventLoop | None:
        if self._threaded is not None:
            return self._threaded.loop
        return self.loop

    def job(self, job: Any) -> Job | None:
        """The ledger's view of an APScheduler job (``None``: it cannot be claimed)."""
        trigger = job.trigger
        if getattr(trigger, "jitter", None):
            if job.id not in self._warned:
                self._warned.add(job.id)
                log.error("job_refused", job=job.id, lock=self.lock.label,
                          reason="a trigger with jitter has different run times on each "
                          "replica: the ledger cannot tell its runs apart")  # fmt: skip
            return None
        if _RANDOM_ID.fullmatch(job.id) and job.id not in self._warned:
            self._warned.add(job.id)
            log.warning("job_id_random", job=job.id, lock=self.lock.label,
                        reason="give the job an explicit id= (the default is random, so "
                        "every replica names its slots differently)")  # fmt: skip
        key = (job.id, repr(trigger))
        known = self._jobs.get(key)
        if known is None:
            grace = job.misfire_grace_time  # None: however late
            grace_s = MAX_SECONDS if grace is None else min(float(grace), MAX_SECONDS)
            known = Job(
                name=check_job_name(job.id),
                fn=_timed_by_apscheduler,
                timing=_TriggerTiming(trigger),
                policy=dataclasses.replace(self.policy, misfire_grace_s=grace_s),
            )
            self._jobs[key] = known
        return known

    # Calls on the lock's loop, from anywhere.

    def call(self, make: Callable[[], Coroutine[Any, Any, R]]) -> R:
        """From a thread that is not the lock loop's: run ``make()`` there and wait."""
        loop = self.lock_loop()
        if loop is None:
            raise ConnectionError("the lock is not running")
        with contextlib.suppress(RuntimeError):
            if asyncio.get_running_loop() is loop:
                raise ConfigurationError(
                    "a sync job of a bound scheduler runs on the lock's event loop thread "
                    "(DebugExecutor?): the ledger cannot be called from there"
                )
        future = asyncio.run_coroutine_threadsafe(make(), loop)
        try:
            return future.result(LEDGER_TIMEOUT_S)
        except TimeoutError:
            future.cancel()
            raise ConnectionError(f"a ledger call took over {LEDGER_TIMEOUT_S} s") from None

    async def acall(self, make: Callable[[], Coroutine[Any, Any, R]]) -> R:
        """From a coroutine on any loop: run ``make()`` on the lock's loop."""
        loop = self.lock_loop()
        if loop is None:
            raise ConnectionError("the lock is not running")
        try:
            async with asyncio.timeout(LEDGER_TIMEOUT_S):
                if asyncio.get_running_loop() is loop:
                    return await make()
                return await asyncio.wrap_future(asyncio.run_coroutine_threadsafe(make(), loop))
        except TimeoutError:  # as `call`: a run skipped in one line, not a job's crash
            raise ConnectionError(f"a ledger call took over {LEDGER_TIMEOUT_S} s") from None


_RANDOM_ID = re.compile(r"[0-9a-f]{32}")
"""What APScheduler's default job id (``uuid4().hex``) looks like."""

LEDGER_TIMEOUT_S = 30.0
"""The bound of one ledger call from a job's thread or loop (a claim waits at most this
long, the server's clock included)."""

_NOT_CLAIMED = (ConnectionError, FencedError)
"""What a claim raises when the lock does not (or no longer) lead: the run is skipped."""


@dataclass(frozen=True)
class _Due:
    """A run time to claim, and how."""

    at: dt.datetime  # the run time as APScheduler gave it
    forced: bool = False  # chosen by the catch-up policy: run however late
    rerun: bool = False  # may take over a slot an older term left running


@dataclass(frozen=True)
class _Outcome:
    """How a job's call ended: what it returned, or the error it raised."""

    value: Any
    error: Exception | None = None

    @classmethod
    def of(cls, fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> _Outcome:
        try:
            return cls(fn(*args, **kwargs))
        except Exception as exc:
            return cls(None, exc)

    def unwrap(self) -> Any:
        if self.error is not None:
            raise self.error
        return self.value


_Step = Callable[[], Coroutine[Any, Any, Any]] | contextvars.Context | _Outcome
"""What `_SlotJob._steps` asks its driver for: a ledger call, the job run in a context,
or nothing more (the outcome to return)."""


class _SlotJob:
    """What a bound scheduler's executor runs in place of ``job``: the same job, each of
    whose run times is first claimed in the ledger. APScheduler's ``run_job`` calls
    ``func`` once per run time, in order; the misfire check is made here (against the
    job's ``misfire_grace_time``) so that each call knows its run time. A run time it
    does not run returns an ``adapter.NotRun``, which the executor reports as
    APScheduler would: ``EVENT_JOB_MISSED`` for a misfire, nothing for a slot that is
    another replica's (or leadership's)."""

    def __init__(self, job: Any, spec: Job | None, due: list[_Due], ledger: _SlotLedger) -> None:
        self._job = job
        self._spec = spec
        self._due = collections.deque(due)
        self._ledger = ledger
        self.id: str = job.id
        adapter.stand_in_for(self, job)  # misfire_grace_time None: checked in _next
        self.args: tuple[Any, ...] = ()
        self.kwargs: dict[str, Any] = {}
        self.func: Callable[[], Any] = (
            self._run_async if adapter.is_async(job.func) else self._run_sync
        )

    def __str__(self) -> str:
        return str(self._job)

    def _next(self) -> tuple[_Due, float | None]:
        """The next run time, and how late it is past the job's grace (``None``: not
        past it, or forced by the catch-up policy)."""
        due = self._due.popleft()
        grace = self._job.misfire_grace_time
        late = dt.datetime.now(dt.UTC) - due.at
        if grace is not None and not due.forced and late > dt.timedelta(seconds=grace):
            return due, late.total_seconds()
        return due, None

    def _not_claimed(self, due: _Due, exc: Exception) -> adapter.NotRun:
        log.info("job_skipped", job=self.id, run_time=due.at.isoformat(),
                 reason="not leader", detail=str(exc), lock=self._ledger.lock.label)  # fmt: skip
        return adapter.NotRun(missed=False)

    def _claim(self, due: _Due) -> Callable[[], Coroutine[Any, Any, Run | None]]:
        """The claim of ``due``'s slot, to make on the lock's loop."""
        spec, schedule = self._spec, self._ledger.schedule
        assert spec is not None  # a refused job has no run times
        return lambda: schedule.claim(spec, _slot(due.at), rerun=due.rerun)

    def _taken(self, due: _Due) -> adapter.NotRun:
        log.info("job_skipped", job=self.id, run_time=due.at.isoformat(),
                 reason="slot already claimed", lock=self._ledger.lock.label)  # fmt: skip
        return adapter.NotRun(missed=False)

    def _missed(
        self, run: Run, late_s: float
    ) -> tuple[adapter.NotRun, Callable[[], Coroutine[Any, Any, None]]]:
        """A run time later than its grace, its slot claimed: reported missed, and
        the call that records it ``missed`` in the ledger (if that fails, the slot stays
        ``running``, for the next leader's ``interrupted`` policy)."""
        log.warning("run_missed", job=self.id, lock=self._ledger.lock.label,
                    run_time=run.slot.isoformat(), late_s=round(late_s, 3))  # fmt: skip
        return adapter.NotRun(missed=True), functools.partial(
            self._ledger.schedule.finish, run, outcome="missed"
        )

    def _context(self, run: Run) -> contextvars.Context:
        """The context the claimed ``run`` runs in, bound to its leadership."""
        context = _run_context(run.term, None, self._ledger.lock.leadership(term=run.term))
        context.run(_RUN.set, run)
        return context

    def _steps(self) -> Generator[_Step, Any, None]:
        """One run time, claimed, run and recorded, as the steps its driver takes
        (`_run_sync` in a job's thread, `_run_async` in a job's coroutine): a ledger call
        (the driver sends back its result, or the error that says the lock does not
        lead), the job in its run's context (the driver sends back its `_Outcome`), and
        last the `_Outcome` of the executor's call."""
        due, late_s = self._next()
        claimed = yield self._claim(due)  # a misfire too: its slot may have run elsewhere
        if isinstance(claimed, _NOT_CLAIMED):
            yield _Outcome(self._not_claimed(due, claimed))
        elif claimed is None:
            yield _Outcome(self._taken(due))
        elif late_s is not None:  # claimed, so missed here (not run by another replica)
            missed, record = self._missed(claimed, late_s)
            yield record  # not recorded if the lock no longer leads (see _missed)
            yield _Outcome(missed)
        else:
            ran = yield self._context(claimed)
            finish = self._ledger.schedule.finish
            recorded = yield functools.partial(finish, claimed, error=ran.error)
            if isinstance(recorded, _NOT_CLAIMED):
                self._unrecorded(recorded)
            yield ran

    def _run_sync(self) -> Any:
        steps, job = self._steps(), self._job
        step = next(steps)
        while not isinstance(step, _Outcome):
            if isinstance(step, contextvars.Context):
                step = steps.send(_Outcome.of(step.run, job.func, *job.args, **job.kwargs))
                continue
            try:
                sent = self._ledger.call(step)
            except _NOT_CLAIMED as exc:
                sent = exc
            step = steps.send(sent)
        return step.unwrap()

    async def _run_async(self) -> Any:
        steps = self._steps()
        step = next(steps)
        while not isinstance(step, _Outcome):
            if isinstance(step, contextvars.Context):
                step = steps.send(await self._run_task(step))
                continue
            try:
                sent = await self._ledger.acall(step)
            except _NOT_CLAIMED as exc:
                sent = exc
            step = steps.send(sent)
        return step.unwrap()

    async def _run_task(self, context: contextvars.Context) -> _Outcome:
        """The async job, run as a task in ``context``; cancelled with its caller."""
        job = self._job
        task = asyncio.get_running_loop().create_task(
            job.func(*job.args, **job.kwargs), context=context
        )
        try:
            return _Outcome(await task)
        except asyncio.CancelledError:
            task.cancel()
            raise  # the slot stays running: the next leader's ``interrupted`` policy
        except Exception as exc:
            return _Outcome(None, exc)

    def _unrecorded(self, exc: Exception) -> None:
        log.warning("run_unrecorded", job=self.id, lock=self._ledger.lock.label,
                    reason="leadership lost before the run ended: its slot stays running, "
                    "for the next leader's interrupted policy", detail=str(exc))  # fmt: skip


# ---------------------------------------------------------------------- bind_scheduler
