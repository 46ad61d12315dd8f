"""The library through a real PgBouncer 1.18 (``tests/support/pgbouncer.py``) in session
mode, with the leader's link to the pooler cut silently (a network namespace,
``netns_link``): the leader demotes itself within D, and the follower leads only after
that, with PgBouncer's own TCP timeouts and with its stock settings.

Every check of the server (``pg_locks``, settings) goes to PostgreSQL directly, never
through the pooler. Times are printed and recorded as JUnit properties
(``record_property``); the only bounds are generous ones that catch hangs. Each test runs
its own PgBouncer (``make_pgbouncer``), so that no other test's clients share its pool.
The helpers they share: ``support/pooled.py``.
"""

from __future__ import annotations

import time
from typing import Any, Final

import pytest

from pgleaderlock import FixedInterval, LeaderLock
from pgleaderlock.testing.beliefs import BeliefLog
from pgleaderlock.testing.candidate import CandidateOptions, CandidateProcess
from support.fixture_types import LockPids, MakeRecorder
from support.netns import NetnsLink
from support.pgbouncer import PgBouncer
from support.poll import eventually
from support.pooled import FAST, TAKEOVER_BOUND_S, Record, assert_freed, show
from support.timings import lock_args

pytestmark = [pytest.mark.integration, pytest.mark.timeout(180)]


class PgBouncerOn(PgBouncer):
    """A PgBouncer that listens on ``addr`` (a local address other than 127.0.0.1), so
    that a client in a network namespace can reach it over a link that can be cut."""

    def __init__(self, addr: str, backend_dsn: str, *args: Any, **kwargs: Any) -> None:
        super().__init__(backend_dsn, *args, **kwargs)
        self._addr = addr

    @property
    def host(self) -> str:
        return self._addr


PARTITION_CHILD: Final = CandidateOptions(
    health_interval_s=1.0,
    health_timeout_s=0.5,
    connect_timeout_s=1.0,
    command_timeout_s=1.0,
    retry_s=0.2,
)
"""D = 1.5 s (U = 2.5 s by default, which only guards PgBouncer's hop to the server)."""
CLIENT_SIDE_TIMEOUTS: Final = {
    "tcp_keepidle": "2",
    "tcp_keepintvl": "1",
    "tcp_keepcnt": "1",
    "tcp_user_timeout": "2500",
}
"""PgBouncer's own TCP settings, longer than D = 1.5 s: a silent client is dropped (and
its server connection reset) after about 3 s."""


@pytest.mark.parametrize(
    "client_side", ["pgbouncer_timeouts_above_D", "stock"], ids=["timeouts", "stock"]
)
async def test_session_mode_partition_between_client_and_pooler(
    client_side: str,
    netns_link: NetnsLink,
    pg_dsn: str,
    keys: tuple[int, int],
    recorder: MakeRecorder,
    holders: LockPids,
    record_property: Record,
) -> None:
    """The leader's link to PgBouncer is cut silently (no FIN, no RST). The leader
    demotes itself within D either way. The server's TCP settings that the lock applies
    guard only PgBouncer's connection to the server, which stays fine; what frees the
    lock is:

    - with PgBouncer's ``tcp_keep*``/``tcp_user_timeout`` above D, PgBouncer: it drops
      the silent client and resets its server connection (``DISCARD ALL``);
    - with the stock settings (OS keepalive: 2 h idle, so PgBouncer would keep the
      client for hours), the lock's lease: the server ends the idle server connection
      ``lease_s`` after the last probe (2.5 s here).

    Either way the follower leads, after the old leader's demotion.
    """
    link = netns_link
    settings = CLIENT_SIDE_TIMEOUTS if client_side != "stock" else {}
    demotion_bound = 1.5
    with PgBouncerOn(link.host_addr, pg_dsn, "session", settings=settings) as bouncer:
        beliefs = BeliefLog()
        follower = LeaderLock(
            bouncer.dsn(),
            *keys,
            **lock_args(
                {**FAST, "health_interval_s": 1.0, "retry_strategy": FixedInterval(0.2)},
                name="follower",
            ),
        )
        beliefs.attach(follower, "follower")
        rec = recorder(follower)
        inside = CandidateProcess(
            "inside",
            bouncer.dsn(),
            *keys,
            options=PARTITION_CHILD,
            beliefs=beliefs,
            prefix=link.exec_prefix(),
        )
        try:
            await inside.start()
            await inside.wait_event("acquired", timeout_s=TAKEOVER_BOUND_S)
            await follower.start()
            await rec.wait(lambda: "acquire_failed" in rec.names(), TAKEOVER_BOUND_S)
            server = inside.backend_pid
            assert await holders(*keys) == [server]

            cut_at = time.monotonic()
            link.cut()
            lost = await inside.wait_event("lost", since=cut_at, timeout_s=TAKEOVER_BOUND_S)
            show(record_property, f"partition ({client_side}): demotion after cut", lost.t - cut_at)
            assert lost.t - cut_at <= demotion_bound + 1.0
            await eventually(lambda: follower.is_leader, TAKEOVER_BOUND_S, "a new leader")
            took = next(i.start for i in beliefs.intervals_of("follower") if i.start > cut_at)
            show(record_property, f"partition ({client_side}): takeover after cut", took - cut_at)
            assert lost.t < took, "the lock was freed before the old leader demoted"
            assert await holders(*keys) == [follower.backend_pid]
            assert server not in await holders(*keys)
        finally:
            link.heal()
            await inside.kill()
            await follower.shutdown(timeout_s=10)
        beliefs.report().assert_safe()
    # Closing PgBouncer closed its server connections, which freed anything left.
    await assert_freed(holders, keys)
