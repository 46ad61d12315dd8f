"""A crashed server is tried again at the short "down" cadence, on a real server (issue
32): with the default retry strategy, once the lock's server is gone (SIGKILL; every
host of a multi-host DSN then refuses the connection) each attempt is told how long the
server has looked down and the next comes 0.1 s later, not 1-2 s; once the server is
back, the lock leads again. (Fails on the code before: no ``down_for_s``, and delays of
1 s, then 2 s.)"""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from pgleaderlock import LeaderLock, LockOptions, RetryContext, Session
from pgleaderlock.core.retry import default_retry_strategy
from pgleaderlock.testing import ThrowawayPostgres
from pgleaderlock.testing.pg_process import free_port
from support.poll import eventually
from support.replication import multi_host_dsn

pytestmark = [pytest.mark.timeout(60), pytest.mark.throwaway]


class Recording:
    """The default strategy, noting each context and the delay it gave."""

    def __init__(self) -> None:
        self.inner = default_retry_strategy()
        self.seen: list[tuple[RetryContext, float]] = []

    def next_delay_s(self, ctx: RetryContext) -> float:
        delay = self.inner.next_delay_s(ctx)
        self.seen.append((ctx, delay))
        return delay


@pytest.mark.parametrize("backend", ["psycopg", "asyncpg"])
async def test_a_crashed_server_is_tried_every_tenth_of_a_second(
    throwaway_pg: ThrowawayPostgres, backend: str
) -> None:
    pg = throwaway_pg
    dsn = multi_host_dsn(pg, ("127.0.0.1", free_port()))  # the second host: nobody
    retry = Recording()
    options = LockOptions(session=Session(backend=backend), load_plugins=False)
    lock = LeaderLock(dsn, 32, 7, name="down", retry_strategy=retry, options=options)
    try:
        await lock.start()
        assert await lock.wait_for_leadership(timeout_s=15)
        await asyncio.to_thread(pg.kill)
        await eventually(lambda: len(retry.seen) >= 6, 30, "six attempts on a dead server")
        after: list[tuple[Any, float]] = retry.seen[:6]
        assert all(ctx.last_error is not None for ctx, _ in after)
        assert all(ctx.down_for_s is not None for ctx, _ in after), after
        assert [delay for _, delay in after] == [0.1] * 6
        downs = [ctx.down_for_s for ctx, _ in after]
        assert downs == sorted(downs)  # one run of failures, counted from its first
        await asyncio.to_thread(pg.start_again)
        assert await lock.wait_for_leadership(timeout_s=15)
    finally:
        await lock.shutdown(timeout_s=15)
