"""``owned_only`` on a real PostgreSQL server: singleton jobs spread over replicas, each
replica an ``AsyncIOScheduler`` with its own ``Coordinator`` in one group (in one process,
on one loop). A job runs only on the replica that leads its name; the names spread
evenly; a replica's shutdown moves its jobs; a coroutine run in progress is cancelled
before its name is released; ``current_term``/``current_context`` inside a run."""

from __future__ import annotations

import asyncio
import datetime as dt
import logging
import threading
import uuid
from collections.abc import AsyncIterator, Callable
from typing import Any

import psycopg
import pytest
from apscheduler.schedulers.asyncio import AsyncIOScheduler

from pgleaderlock import ConfigurationError, Coordinator, LeaderLock, WorkerContext
from pgleaderlock.integrations.apscheduler import current_context, current_term, owned_only
from support.poll import eventually
from support.timings import lock_args, timings

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]

BOUND_S = 20.0
EPOCH = dt.datetime(2024, 1, 1, tzinfo=dt.UTC)  # every replica computes the same run times
FAST = timings(retry_s=0.05, health_interval_s=0.5)


@pytest.fixture
def group() -> str:
    return f"s{uuid.uuid4().hex[:12]}"


@pytest.fixture
async def schedulers() -> AsyncIterator[Callable[[], AsyncIOScheduler]]:
    made: list[AsyncIOScheduler] = []

    def make() -> AsyncIOScheduler:
        made.append(AsyncIOScheduler())
        return made[-1]

    yield make
    for sched in made:
        if sched.running:
            sched.shutdown(wait=False)
    await asyncio.sleep(0.05)  # their shutdown runs on the loop


@pytest.fixture
async def coordinators(pg_dsn: str, group: str) -> AsyncIterator[Callable[..., Coordinator]]:
    made: list[Coordinator] = []

    def make(**kwargs: Any) -> Coordinator:
        made.append(Coordinator(pg_dsn, **lock_args({**FAST, **kwargs}, group=group)))
        return made[-1]

    yield make
    for coord in made:
        await coord.shutdown()


class Runs:
    """Every run of every job, and any run on a replica that did not lead the job's
    name at that moment."""

    def __init__(self) -> None:
        self.by: dict[str, list[str]] = {}
        self.violations: list[str] = []

    def record(self, label: str, name: str, coords: dict[str, Coordinator]) -> None:
        while True:
            try:  # a sync job reads the coordinators from a worker thread
                leads = [other for other, coord in coords.items() if name in coord.owned]
                break
            except RuntimeError:  # changed size during iteration: read again
                continue
        if leads != [label]:
            self.violations.append(f"{name} ran on {label} while led by {leads}")
        self.by.setdefault(name, []).append(label)

    def runners(self, name: str, since: int = 0) -> set[str]:
        return set(self.by.get(name, [])[since:])


@pytest.mark.parametrize("sessions", ["shared", "dedicated"])
async def test_jobs_spread_over_replicas_and_move_when_one_stops(
    coordinators: Callable[..., Coordinator],
    schedulers: Callable[[], AsyncIOScheduler],
    group: str,
    sessions: str,
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.DEBUG, logger="pgleaderlock.integrations.apscheduler")
    names = [f"{group}:job{i}" for i in range(4)]
    runs = Runs()
    coords = {label: coordinators(sessions=sessions) for label in ("a", "b")}
    for label, coord in coords.items():
        scheduler = schedulers()
        for i, name in enumerate(names):
            if i % 2:

                async def async_job(label: str = label, name: str = name) -> None:
                    runs.record(label, name, coords)

                job: Callable[[], object] = owned_only(coord, name)(async_job)
            else:

                def sync_job(label: str = label, name: str = name) -> None:
                    assert threading.current_thread() is not threading.main_thread()
                    runs.record(label, name, coords)

                job = owned_only(coord, name)(sync_job)
            scheduler.add_job(job, "interval", seconds=0.05, start_date=EPOCH, id=name)
        scheduler.start()
        await coord.start()

    def split() -> bool:
        owned = [coord.owned for coord in coords.values()]
        return sorted(len(o) for o in owned) == [2, 2] and set().union(*owned) == set(names)

    await eventually(split, BOUND_S, "four names split 2/2")
    marks = {name: len(runs.by.get(name, [])) for name in names}
    owner = {name: next(lb for lb, c in coords.items() if name in c.owned) for name in names}
    await eventually(
        lambda: all(len(runs.by.get(n, [])) >= marks[n] + 3 for n in names),
        BOUND_S,
        "every job ran three more times",
    )
    for name in names:
        assert runs.runners(name, marks[name]) == {owner[name]}, name
    skipped = [r for r in caplog.records if r.getMessage().startswith("job_skipped")]
    assert skipped, "the replicas that do not lead a name skip its runs"
    assert {r.levelno for r in skipped} == {logging.DEBUG}
    assert all('reason="name led elsewhere"' in r.getMessage() for r in skipped)

    assert runs.violations == []

    # Replica "a" stops: its jobs run on "b" from then on.
    await coords["a"].shutdown()
    await eventually(lambda: coords["b"].owned == set(names), BOUND_S, "b leads every name")
    marks = {name: len(runs.by[name]) for name in names}
    await eventually(
        lambda: all(len(runs.by[n]) >= marks[n] + 3 for n in names),
        BOUND_S,
        "every job ran three more times on b",
    )
    for name in names:
        assert runs.runners(name, marks[name]) == {"b"}, name


async def test_a_run_in_progress_is_cancelled_before_its_name_is_released(
    coordinators: Callable[..., Coordinator], group: str, pg_dsn: str
) -> None:
    name = f"{group}:long"
    coord = coordinators(sessions="shared")
    started = asyncio.Event()
    held_at_cancel: list[bool] = []

    @owned_only(coord, name)
    async def long_job() -> None:
        started.set()
        try:
            await asyncio.Event().wait()
        finally:
            held_at_cancel.append(name in coord.owned)

    await coord.start()
    await eventually(lambda: name in coord.owned, BOUND_S, "the name is led")
    run = asyncio.create_task(long_job())
    async with asyncio.timeout(BOUND_S):
        await started.wait()
    await coord.remove(name)  # the replica unsubscribes: the run stops, then the unlock
    assert await asyncio.wait_for(run, BOUND_S) is None  # type: ignore[func-returns-value]
    assert held_at_cancel == [True]
    lock = LeaderLock.from_name(name, pg_dsn, **lock_args(FAST))
    async with lock:
        assert await lock.wait_for_leadership(BOUND_S), "released at once"
    assert await long_job() is None  # type: ignore[func-returns-value]  # skipped: not registered


async def test_term_and_context_inside_runs(
    coordinators: Callable[..., Coordinator], group: str, pg_dsn: str
) -> None:
    name = f"{group}:fenced"
    table = f"ckpt_{group}"
    coord = coordinators(sessions="dedicated", fencing=True, checkpoint_table=table)
    seen: dict[str, Any] = {}

    @owned_only(coord, name)
    async def fenced_job(step: int) -> int:
        ctx = current_context()
        seen["term"], seen["ctx"] = current_term(), ctx
        async with await psycopg.AsyncConnection.connect(pg_dsn) as conn, conn.transaction():
            position = await ctx.load_checkpoint(conn) or 0
            await ctx.save_checkpoint(conn, position + step)
        return position + step

    @owned_only(coord, f"{group}:sync")
    def sync_job() -> tuple[int | None, str]:
        return current_term(), current_context().name

    with pytest.raises(RuntimeError, match="outside a run"):
        current_context()
    await coord.start()
    await eventually(lambda: len(coord.owned) == 2, BOUND_S, "both names led")

    # A run is admitted once the name's worker has started, a moment after the lock
    # leads: until then it is skipped (None), as on a replica that does not lead.
    async def admitted() -> bool:
        return await fenced_job(0) is not None  # 0: the checkpoint stays as it is

    await eventually(admitted, BOUND_S, "the name's worker runs")
    assert await fenced_job(5) == 5
    assert await fenced_job(2) == 7
    ctx = seen["ctx"]
    assert isinstance(ctx, WorkerContext)
    assert ctx.name == name
    assert isinstance(seen["term"], int)
    assert seen["term"] == ctx.term
    ran = await asyncio.to_thread(sync_job)
    assert ran is not None
    term, sync_name = ran
    assert isinstance(term, int)
    assert sync_name == f"{group}:sync"
    async with await psycopg.AsyncConnection.connect(pg_dsn, autocommit=True) as admin:
        await admin.execute(f'DROP TABLE IF EXISTS "{table}"')


async def test_bad_arguments(coordinators: Callable[..., Coordinator], group: str) -> None:
    coord = coordinators()
    with pytest.raises(ConfigurationError, match="needs a Coordinator"):
        owned_only(object(), "x")  # type: ignore[arg-type]
    owned_only(coord, f"{group}:once")
    with pytest.raises(ConfigurationError, match="already registered"):
        owned_only(coord, f"{group}:once")
    with pytest.raises(ConfigurationError, match=r"^owned_only needs a callable"):
        owned_only(coord, f"{group}:other")(42)  # type: ignore[call-overload]
