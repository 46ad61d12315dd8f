"""Faults in user code: callbacks that raise, and a callback that never returns."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

import pytest

from pgleaderlock import FixedInterval, LockState, ShutdownError
from pgleaderlock.testing.beliefs import BeliefLog
from support.fixture_types import Figures
from support.server import Admin

if TYPE_CHECKING:
    from faults.conftest import Candidates

S = LockState
pytestmark = pytest.mark.timeout(60)


class Boom(Exception):
    pass


async def test_raising_callbacks_are_never_fatal(
    candidates: Candidates,
    admin: Admin,
    beliefs: BeliefLog,
) -> None:
    """Every callback raises, sync and async, on_error included. The exceptions reach
    on_error (except on_error's own, which is only logged), and the lock behaves exactly
    as without them: it leads, notices the loss of its backend, follows, leads again."""
    a, rec_a = candidates.recorded("a")
    b, rec_b = candidates.recorded("b", retry_strategy=FixedInterval(1.0))  # 1 s server waits
    raised: list[str] = []

    def boom(what: str) -> Callable[..., None]:
        def callback(*args: object) -> None:
            raised.append(what)
            raise Boom(what)

        return callback

    async def async_boom(*args: object) -> None:
        raised.append("async acquired")
        raise Boom("async acquired")

    a.on_acquired(boom("acquired"))
    a.on_acquired(async_boom)
    a.on_lost(boom("lost"))
    a.on_state_change(boom("state_change"))
    a.on_acquire_failed(boom("acquire_failed"))
    a.on_error(boom("error"))
    await a.start()
    assert await a.wait_for_leadership(10)
    assert {"acquired", "async acquired", "state_change"} <= set(raised)
    boom_errors = [e for e in rec_a.errors() if isinstance(e, Boom)]
    assert {str(e) for e in boom_errors} >= {"acquired", "async acquired", "state_change"}
    assert "error" not in {str(e) for e in boom_errors}  # no recursion through on_error
    await asyncio.sleep(0.6)  # a health probe runs after the failing callbacks
    assert a.is_leader
    assert await candidates.holders() == [a.backend_pid]

    await b.start()
    await rec_b.wait_event("acquire_failed", timeout=10)  # b is queued: it gets the lock first
    beliefs.fault("terminate", "a")
    await admin.execute("SELECT pg_terminate_backend(%s)", (a.backend_pid,))
    await rec_a.wait_event("lost", timeout=5)
    assert await b.wait_for_leadership(5)
    assert "lost" in raised
    await rec_a.wait_event("acquire_failed", timeout=5)  # a follows, despite it all
    assert "acquire_failed" in raised
    assert a.state in (S.FOLLOWER, S.ACQUIRING)
    await b.shutdown()
    await candidates.assert_leads(a)
    beliefs.report().assert_safe()


async def test_blocking_callback_blocks_the_lifecycle_but_shutdown_is_bounded(
    candidates: Candidates,
    admin: Admin,
    beliefs: BeliefLog,
    figures: Figures,
) -> None:
    """An async on_acquired that never returns blocks the lock's lifecycle task: the
    state stays LEADER, wait_for_leadership() does not return True (it waits for
    on_acquired), and no health probe runs. shutdown(timeout_s) still returns in time:
    it raises ShutdownError, cancels the task and closes the session, which frees the
    lock on the server; the waiting follower takes over."""
    a = candidates.lock("a")
    b, rec_b = candidates.recorded("b")
    entered = asyncio.Event()
    cancelled = asyncio.Event()

    @a.on_acquired
    async def stuck() -> None:
        entered.set()
        try:
            await asyncio.Event().wait()  # forever
        except asyncio.CancelledError:
            cancelled.set()
            raise

    await a.start()
    await asyncio.wait_for(entered.wait(), 10)
    assert a.state is S.LEADER
    assert not await a.wait_for_leadership(0.3)
    pid = a.backend_pid
    app = a.application_name
    await b.start()
    await rec_b.wait_event("acquire_failed", timeout=5)
    assert await candidates.holders() == [pid]

    stopping = time.monotonic()
    with pytest.raises(ShutdownError):
        await a.shutdown(timeout_s=1.0)
    took = time.monotonic() - stopping
    beliefs.end("a", "stop")  # a cancelled task emits no event
    figures("shutdown(timeout_s=1) with a stuck callback", took, "s")
    assert 0.9 < took < 3.0
    assert cancelled.is_set()
    assert a.state is S.STOPPED  # type: ignore[comparison-overlap]
    assert not a.is_leader
    assert a.backend_pid is None
    await candidates.assert_leads(b)
    cur = await admin.execute(
        "SELECT count(*) FROM pg_stat_activity WHERE application_name = %s", (app,)
    )
    assert (await cur.fetchone())[0] == 0, "the stuck lock's session stayed open"
    await a.shutdown()  # idempotent once stopped
    beliefs.report().assert_safe()


async def test_blocked_lifecycle_does_not_notice_loss(
    candidates: Candidates,
    admin: Admin,
    beliefs: BeliefLog,
) -> None:
    """The hazard of a blocking callback, documented: while on_acquired blocks, nothing
    probes the session, so a lost lock goes unnoticed and is_leader stays True for as
    long as the callback blocks. Long work belongs in a task the callback starts."""
    a = candidates.lock("a")
    entered = asyncio.Event()

    @a.on_acquired
    async def stuck() -> None:
        entered.set()
        await asyncio.sleep(3600)

    await a.start()
    await asyncio.wait_for(entered.wait(), 10)
    await admin.execute("SELECT pg_terminate_backend(%s)", (a.backend_pid,))
    await asyncio.sleep(1.5)  # more than health_interval_s + health_timeout_s = 1 s
    assert a.is_leader  # stale: the backend is gone, nobody noticed
    with pytest.raises(ShutdownError):
        await a.shutdown(timeout_s=0.5)
    beliefs.end("a", "stop")
    assert a.state is S.STOPPED
