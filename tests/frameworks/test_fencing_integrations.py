"""The integrations expose the fencing term, on the in-memory server: FastAPI's status
(``term``), APScheduler's ``current_term()`` inside ``leader_only`` runs (fixed per run,
carried into tasks and threads the run starts, never leaking out of it) and a bound
scheduler's ``term``.

The fake server has no table: ``TermSession`` wraps a fake session and keeps the terms
in memory, bumped like the real statement (first term ``1 << 32 | 1``, timeline 1)."""

from __future__ import annotations

import asyncio
import concurrent.futures
from collections.abc import AsyncIterator, Callable

import httpx
import pytest
from apscheduler.schedulers.asyncio import AsyncIOScheduler
from asgi_lifespan import LifespanManager
from fastapi import FastAPI

from pgleaderlock import LeaderLock, LockState
from pgleaderlock.core.config import TermTable
from pgleaderlock.core.session import FencedSessions
from pgleaderlock.integrations.apscheduler import bind_scheduler, current_term, leader_only
from pgleaderlock.integrations.fastapi import LeaderLifespan
from pgleaderlock.testing import FakeServer
from pgleaderlock.testing.fake import FakeSession
from support.fixture_types import MakeLock
from support.locks import fake_locks
from support.poll import eventually

S = LockState
pytestmark = pytest.mark.timeout(60)

FIRST_TERM = 1 << 32 | 1


class TermSession:
    """A [`FakeSession`] that can also bump a fencing term (``FencingSession``)."""

    def __init__(self, inner: FakeSession, terms: dict[tuple[int, int], int]) -> None:
        self._inner = inner
        self._terms = terms

    @property
    def backend_pid(self) -> int | None:
        return self._inner.backend_pid

    async def try_lock(self, key1: int, key2: int) -> bool:
        return await self._inner.try_lock(key1, key2)

    async def wait_lock(self, key1: int, key2: int, timeout_s: float) -> bool:
        return await self._inner.wait_lock(key1, key2, timeout_s)

    async def unlock(self, key1: int, key2: int) -> bool:
        return await self._inner.unlock(key1, key2)

    async def holds(self, key1: int, key2: int) -> bool:
        return await self._inner.holds(key1, key2)

    def watch(self, callback: Callable[[], None] | None) -> None:
        self._inner.watch(callback)

    async def close(self) -> None:
        await self._inner.close()

    async def bump_term(self, table: TermTable, key1: int, key2: int, wait_s: float) -> int:
        assert await self._inner.holds(key1, key2), "the term is bumped by the lock's holder"
        term = self._terms[key1, key2] = max(self._terms.get((key1, key2), 0) + 1, FIRST_TERM)
        return term

    async def end_fenced(self, table: TermTable, keys: list[tuple[int, int]]) -> FencedSessions:
        return FencedSessions()  # nothing blocks a bump here


@pytest.fixture
async def term_lock(server: FakeServer) -> AsyncIterator[MakeLock]:
    """``term_lock(fencing=True, **kwargs)``: a lock on the in-memory server whose
    sessions keep terms; all shut down after the test, no session left open."""
    terms: dict[tuple[int, int], int] = {}

    async def connect() -> TermSession:
        return TermSession(await server.connect(), terms)

    async with fake_locks(server, connect, fencing=True, load_plugins=False) as make:
        yield make


async def leads(lock: LeaderLock) -> int:
    await lock.start()
    assert await lock.wait_for_leadership(5)
    assert lock.term is not None
    return lock.term


# ---------------------------------------------------------------------- FastAPI


def status_client(app: FastAPI) -> httpx.AsyncClient:
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://replica")


async def test_fastapi_status_reports_the_term(term_lock: MakeLock, server: FakeServer) -> None:
    """The leader's status carries its term, the follower's None; after a takeover the
    new leader reports the next term and the old one None. Without fencing: None."""
    a, b = term_lock(), term_lock()
    apps = {}
    for lock in (a, b):
        leader = LeaderLifespan(lock)
        app = FastAPI(lifespan=leader)
        app.include_router(leader.router())
        apps[lock] = app
    async with (
        LifespanManager(apps[a]) as ma,
        status_client(ma.app) as http_a,  # type: ignore[arg-type]
    ):
        assert await a.wait_for_leadership(5)
        async with (
            LifespanManager(apps[b]) as mb,
            status_client(mb.app) as http_b,  # type: ignore[arg-type]
        ):
            await eventually(lambda: b.state in (S.FOLLOWER, S.ACQUIRING))
            assert (await http_a.get("/leader")).json()["term"] == FIRST_TERM == a.term
            assert (await http_b.get("/leader")).json()["term"] is None
            server.terminate()
            assert await b.wait_for_leadership(5)
            assert (await http_b.get("/leader")).json()["term"] == FIRST_TERM + 1
            await eventually(lambda: not a.is_leader)
            assert (await http_a.get("/leader")).json()["term"] is None

    plain = term_lock(fencing=False)
    leader = LeaderLifespan(plain)
    async with leader.run():
        assert await plain.wait_for_leadership(5)
        status = leader.status()
        assert status.is_leader
        assert status.term is None


# ---------------------------------------------------------------------- APScheduler


async def test_current_term_inside_leader_only_runs(
    term_lock: MakeLock,
) -> None:
    """Sync and async runs see the lock's term; the tasks and threads an async run
    starts see it too; outside any run, and in the thread a sync run used once it has
    returned, current_term() raises."""
    lock = term_lock()
    term = await leads(lock)

    @leader_only(lock)
    def sync_job() -> int | None:
        return current_term()

    async def read() -> int | None:
        return current_term()

    @leader_only(lock)
    async def async_job() -> tuple[int | None, int | None, int | None]:
        in_task = await asyncio.create_task(read())
        in_thread = await asyncio.to_thread(current_term)
        return current_term(), in_task, in_thread

    assert sync_job() == term
    assert await async_job() == (term, term, term)
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        assert pool.submit(sync_job).result() == term
        with pytest.raises(RuntimeError, match="outside a run"):
            pool.submit(current_term).result()
    with pytest.raises(RuntimeError, match="outside a run"):
        current_term()


async def test_current_term_is_none_without_fencing(
    term_lock: MakeLock,
) -> None:
    lock = term_lock(fencing=False)
    await lock.start()
    assert await lock.wait_for_leadership(5)

    @leader_only(lock)
    async def job() -> int | None:
        return current_term()

    assert await job() is None


async def test_current_term_stays_the_runs_term_after_a_new_leadership(
    term_lock: MakeLock, server: FakeServer
) -> None:
    """A sync run cannot be interrupted: it goes on while its lock loses the lock and
    leads again under the next term. Inside it, current_term() still says the term the
    run started under, while lock.term has moved on: the run can tell."""
    lock = term_lock()
    term = await leads(lock)
    started, resume = asyncio.Event(), asyncio.Event()
    loop = asyncio.get_running_loop()

    @leader_only(lock)
    def long_job() -> tuple[int | None, int | None]:
        before = current_term()
        loop.call_soon_threadsafe(started.set)
        asyncio.run_coroutine_threadsafe(resume.wait(), loop).result(timeout=10)
        return before, current_term()

    run = asyncio.create_task(asyncio.to_thread(long_job))
    await started.wait()
    server.terminate()
    await eventually(lambda: lock.term == term + 1)
    resume.set()
    assert await run == (term, term)
    assert lock.term == term + 1


async def test_leader_only_skips_a_follower_without_a_term(
    term_lock: MakeLock,
) -> None:
    a, b = term_lock(), term_lock()
    await leads(a)
    await b.start()
    await eventually(lambda: b.state in (S.FOLLOWER, S.ACQUIRING))
    ran: list[int | None] = []

    @leader_only(b)
    def job() -> None:
        ran.append(current_term())

    assert job() is None
    assert ran == []


async def test_bound_scheduler_term_follows_the_leadership(
    term_lock: MakeLock, server: FakeServer
) -> None:
    """A bound scheduler's term: None while paused, the lock's term while it runs, the
    next term after a takeover and a new leadership."""
    a, b = term_lock(), term_lock()
    scheduler_a, scheduler_b = AsyncIOScheduler(), AsyncIOScheduler()
    binding_a = bind_scheduler(scheduler_a, a)
    binding_b = bind_scheduler(scheduler_b, b)
    scheduler_a.start()
    scheduler_b.start()
    try:
        assert binding_a.term is None
        term = await leads(a)
        await eventually(lambda: binding_a.active)
        assert binding_a.term == term
        await b.start()
        await eventually(lambda: b.state in (S.FOLLOWER, S.ACQUIRING))
        assert binding_b.term is None
        server.terminate()
        assert await b.wait_for_leadership(5)
        await eventually(lambda: binding_b.active)
        assert binding_b.term == term + 1
        await eventually(lambda: not binding_a.active)
        assert binding_a.term is None
    finally:
        binding_a.close()
        binding_b.close()
        scheduler_a.shutdown(wait=False)
        scheduler_b.shutdown(wait=False)
        await asyncio.sleep(0.01)  # their shutdown runs on the loop
