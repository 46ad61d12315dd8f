"""psycopg: what a leader reports when the server ends its session (issue 23).

The periodic probe is a bare protocol ``Sync`` read by the backend's own callbacks
(``PsycopgSession._on_readable``). When the server ends the session, the error the lock
reports must be the server's own (``AdminShutdown: terminating connection due to
administrator command``), also when its ErrorResponse came in the same read as the
answer to the previous ``Sync`` and libpq finds the end of the connection first; and a
probe that finds the connection closed must leave nothing on the event loop under the
old socket's fd number, which the next connection usually gets.
"""

from __future__ import annotations

import asyncio
import logging

import pytest

from pgleaderlock import LeaderLock
from support.poll import eventually
from support.proxy import proxied
from support.server import Admin
from support.timings import lock_args, timings

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]

# Probes every 20 ms, so a terminate often lands while a Sync is in flight.
FAST = timings(retry_s=0.01, health_interval_s=0.02)
TERMINATES = 300
BOUND_S = 10.0
SERVER_SAID = "AdminShutdown: terminating connection due to administrator command"
# The kernel may drop the server's last message when the server's socket closes with our
# Sync unread (a TCP reset): then libpq has nothing but the closed connection.
NOTHING_SAID = "server closed the connection unexpectedly"


def _health_check_failures(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [
        r.getMessage() for r in caplog.records if r.getMessage().startswith("health_check_failed")
    ]


async def test_a_terminated_leader_reports_the_servers_message(
    pg_dsn: str, keys: tuple[int, int], admin: Admin, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="pgleaderlock")
    lock = LeaderLock(pg_dsn, *keys, **lock_args(FAST))
    errors: list[BaseException] = []
    lock.on_error(errors.append)
    async with lock:
        for i in range(TERMINATES):
            await eventually(lambda: lock.is_leader, BOUND_S, "leadership")
            pid = lock.backend_pid
            reported = len(_health_check_failures(caplog))
            await asyncio.sleep((i % 10) * 0.002)  # at every phase of the probe cycle
            await admin.execute("SELECT pg_terminate_backend(%s)", (pid,))
            await eventually(
                lambda: len(_health_check_failures(caplog)) > reported,  # noqa: B023
                BOUND_S,
                "the health check failure",
            )
        await eventually(lambda: lock.is_leader, BOUND_S, "leadership")

    failures = _health_check_failures(caplog)
    assert len(failures) == TERMINATES
    wrong = [f for f in failures if SERVER_SAID not in f and NOTHING_SAID not in f]
    assert not wrong, wrong
    assert not any("unexpected answer to a Sync" in f for f in failures)
    # Most of the time the message is there to be read.
    assert sum(SERVER_SAID in f for f in failures) > TERMINATES // 2
    # Every reconnection worked at once: no error on the way back to LEADER.
    assert errors == []


async def test_a_probe_on_a_cut_connection_leaves_nothing_on_the_event_loop(
    pg_dsn: str, keys: tuple[int, int]
) -> None:
    """The proxy closes the connection with no message: the probe's read finds the end
    of the connection, and libpq closes the socket. The reconnection (whose socket
    usually gets the same fd number) must work: before the fix, the probe's reader
    stayed registered under the old fd and psycopg's connect failed with
    "connection socket closed"."""
    async with proxied(pg_dsn) as (proxy, dsn):
        lock = LeaderLock(dsn, *keys, **lock_args(FAST))
        errors: list[BaseException] = []
        lock.on_error(errors.append)
        async with lock:
            for _ in range(50):
                await eventually(lambda: lock.is_leader, BOUND_S, "leadership")
                pid = lock.backend_pid
                await proxy.cut()
                await eventually(
                    lambda: lock.is_leader and lock.backend_pid != pid,  # noqa: B023
                    BOUND_S,
                    "leadership on a new session",
                )
    assert [str(e) for e in errors] == []
