"""The library through a real PgBouncer 1.18 (``tests/support/pgbouncer.py``) in session
mode, both drivers.

Session mode with PgBouncer's stock configuration gives each client its own server
connection for as long as it stays connected: the lock leads there, a second candidate
follows, the death of the leader's process, the termination of its server backend and a
shutdown all free the lock, because PgBouncer's ``server_reset_query`` (``DISCARD ALL``)
releases the advisory locks of a client that goes away. A killed pooler ends the
leadership and frees the lock. With the leader's link to the pooler cut silently (a
network namespace, ``netns_link``), the leader demotes itself within D, and the follower
leads only after that, with PgBouncer's own TCP timeouts and with its stock settings.

How the server is checked and times are recorded: see test_poolers_refused.py.
"""

from __future__ import annotations

import asyncio
import statistics
import time
from collections.abc import Callable
from typing import Any, Final

import pytest

from pgleaderlock import FixedInterval, LeaderLock, LockState
from pgleaderlock.testing.beliefs import BeliefLog
from pgleaderlock.testing.candidate import CandidateOptions, CandidateProcess
from support.fixture_types import LockPids, MakeRecorder, Terminate
from support.netns import NetnsLink
from support.pgbouncer import PgBouncer
from support.poll import eventually
from support.pooled import (
    FAST,
    TAKEOVER_BOUND_S,
    MakeThrough,
    Record,
    assert_freed,
    assert_no_settings_left,
    fetch,
    lock_dsn,
    plain_client,
    raw_lock_left_behind,
    show,
    watched_settings,
)
from support.timings import lock_args

pytestmark = [pytest.mark.integration, pytest.mark.timeout(180)]


CHILD: Final = CandidateOptions(health_interval_s=0.5, health_timeout_s=0.5, retry_s=0.1)


async def test_session_mode_leads_a_second_candidate_follows_and_shutdown_frees_the_lock(
    session_bouncer: PgBouncer, through: MakeThrough, pg_dsn: str
) -> None:
    pooler = through(session_bouncer)
    async with pooler.pair(("first", "second")) as (beliefs, first, second, rec1, rec2):
        names = watched_settings(first)
        began = time.monotonic()
        await first.start()
        assert await first.wait_for_leadership(timeout_s=TAKEOVER_BOUND_S)
        pooler.show(f"session mode: start to leader ({pooler.backend})", time.monotonic() - began)
        assert first.backend_pid is not None
        assert await pooler.held() == [first.backend_pid]
        await second.start()
        await rec2.wait_event("acquire_failed", timeout=TAKEOVER_BOUND_S)
        assert second.state in (LockState.FOLLOWER, LockState.ACQUIRING)  # queued
        assert second.backend_pid not in (None, first.backend_pid)
        # Still leading after a few health probes (each one runs on its own backend; on
        # psycopg a bare Sync, which PgBouncer passes to the server and back).
        probes = first.statistics().probes
        await asyncio.sleep(1.5)
        assert first.statistics().probes - probes >= 2
        assert first.is_leader
        assert not second.is_leader
        assert rec1.errors() == []
        assert rec2.errors() == []

        released = time.monotonic()
        await first.shutdown(timeout_s=10)
        assert await second.wait_for_leadership(timeout_s=TAKEOVER_BOUND_S)
        [interval] = beliefs.intervals_of("second")
        pooler.show(
            f"session mode: hand-off on shutdown ({pooler.backend})", interval.start - released
        )
        assert await pooler.held() == [second.backend_pid]
    # DISCARD ALL reset the lock's settings on the server connections it used.
    await assert_no_settings_left(session_bouncer, pg_dsn, names)


async def test_session_mode_a_killed_leader_process_hands_over(
    session_bouncer: PgBouncer, through: MakeThrough
) -> None:
    """SIGKILL of the leader's process: its kernel closes the socket to PgBouncer, which
    resets the server connection (DISCARD ALL frees the lock), and the follower, queued
    on the server, is granted the lock."""
    pooler = through(session_bouncer)
    beliefs = BeliefLog()
    follower = pooler.lock("follower")
    beliefs.attach(follower, "follower")
    rec = pooler.recorder(follower)
    takeovers = []
    try:
        for round_ in range(3):
            child = CandidateProcess(
                f"child{round_}",
                lock_dsn(session_bouncer, pooler.backend),
                *pooler.keys,
                options=CHILD,
                beliefs=beliefs,
            )
            try:
                await child.start()
                if round_ == 0:
                    await child.wait_event("acquired", timeout_s=TAKEOVER_BOUND_S)
                    await follower.start()
                else:  # the follower leads: hand over to the new child first
                    await child.wait_event("acquire_failed", timeout_s=TAKEOVER_BOUND_S)
                    await follower.step_down(timeout_s=10)
                    await child.wait_event("acquired", timeout_s=TAKEOVER_BOUND_S)
                await rec.wait(lambda: rec.names()[-1:] == ["acquire_failed"], TAKEOVER_BOUND_S)
                assert await pooler.held() == [child.backend_pid]
                killed_at = await child.kill()
                assert await follower.wait_for_leadership(timeout_s=TAKEOVER_BOUND_S)
                started = [i.start for i in beliefs.intervals_of("follower") if i.start > killed_at]
                takeovers.append(started[0] - killed_at)
                assert await pooler.held() == [follower.backend_pid]
            finally:
                await child.kill()
    finally:
        await follower.shutdown(timeout_s=10)
    pooler.show(f"session mode: take-over after SIGKILL, median of 3 ({pooler.backend})",
                statistics.median(takeovers))  # fmt: skip
    assert await pooler.held() == []
    assert rec.errors() == []
    beliefs.report().assert_safe()


async def test_session_mode_a_terminated_leader_backend_is_noticed(
    session_bouncer: PgBouncer, through: MakeThrough, terminate: Terminate
) -> None:
    """``pg_terminate_backend`` of the leader's *server* backend: PgBouncer closes the
    client whose server went away, the leader reports ``on_lost`` and the follower,
    queued on its own server backend, is granted the lock."""
    pooler = through(session_bouncer)
    async with pooler.pair() as (beliefs, leader, follower, rec_leader, rec_follower):
        await rec_follower.follow(leader, TAKEOVER_BOUND_S, TAKEOVER_BOUND_S)
        server = leader.backend_pid
        assert await pooler.held() == [server]
        fault = beliefs.fault("terminate", "leader")
        await terminate(server)
        await rec_leader.wait_event("lost", timeout=TAKEOVER_BOUND_S)
        assert await follower.wait_for_leadership(timeout_s=TAKEOVER_BOUND_S)
        [lost] = beliefs.intervals_of("leader")
        [took] = beliefs.intervals_of("follower")
        assert lost.end_reason in ("lost", "state:follower", "state:acquiring")
        assert lost.end is not None
        pooler.show(f"session mode: terminate to on_lost ({pooler.backend})", lost.end - fault.t)
        pooler.show(
            f"session mode: terminate to new leader ({pooler.backend})", took.start - fault.t
        )
        assert await pooler.held() == [follower.backend_pid]
        # The old leader lines up again behind the new one, on a new server backend.
        await rec_leader.wait(
            lambda: rec_leader.names()[-1:] == ["acquire_failed"], TAKEOVER_BOUND_S
        )
        assert leader.backend_pid not in (None, server)


async def test_session_mode_disconnect_releases_a_raw_advisory_lock(
    session_bouncer: PgBouncer,
    keys: tuple[int, int],
    holders: LockPids,
    record_property: Record,
) -> None:
    """What the session-mode guarantees rest on, with raw SQL and the stock config: a
    client that disconnects gets its server connection reset with ``server_reset_query``
    (``DISCARD ALL``), which releases its advisory locks, right away."""
    bouncer = session_bouncer
    assert "server_reset_query" not in bouncer.config_path.read_text()  # the default
    async with plain_client(bouncer.dsn()) as conn:
        taken, server = await fetch(
            conn, "SELECT pg_try_advisory_lock(%s, %s), pg_backend_pid()", keys
        )
        assert taken is True
        assert await holders(*keys) == [server]
    closed = time.monotonic()
    while await holders(*keys):
        assert time.monotonic() - closed < 5, "the lock outlived its client by 5 s"
        await asyncio.sleep(0.001)
    show(
        record_property,
        "session mode: raw lock freed after client disconnect",
        time.monotonic() - closed,
    )
    # The server connection itself lives on, reset, for the next client.
    async with plain_client(bouncer.dsn()) as conn:
        assert (await fetch(conn, "SELECT pg_backend_pid()"))[0] == server


async def test_session_mode_a_reset_query_without_discard_keeps_a_disconnected_clients_lock(
    make_pgbouncer: Callable[..., PgBouncer],
    keys: tuple[int, int],
    holders: LockPids,
    terminate: Terminate,
) -> None:
    """Why the docs say to keep ``server_reset_query = DISCARD ALL``: with a lighter reset
    (``DEALLOCATE ALL``) a client that disconnects leaves its lock on the server
    connection, and the next client gets that connection, lock included."""
    bouncer = await asyncio.to_thread(
        make_pgbouncer, "session", settings={"server_reset_query": "DEALLOCATE ALL"}
    )
    async with (
        raw_lock_left_behind(bouncer, keys, holders, terminate) as server,
        plain_client(bouncer.dsn()) as other,
    ):
        same, held = await fetch(
            other,
            "SELECT pg_backend_pid(), count(*) FROM pg_locks"
            " WHERE locktype = 'advisory' AND pid = pg_backend_pid()",
        )
        assert (same, held) == (server, 1)


async def test_session_mode_a_killed_pooler_ends_leadership_and_frees_the_lock(
    session_bouncer: PgBouncer, through: MakeThrough
) -> None:
    """SIGKILL of PgBouncer itself: its sockets close on both sides, so the server ends
    the leader's backend (freeing the lock) and the leader sees its connection closed.
    Once the pooler is back, a candidate leads again."""
    pooler = through(session_bouncer)
    async with pooler.pair() as (beliefs, leader, follower, rec_leader, rec_follower):
        await rec_follower.follow(leader, TAKEOVER_BOUND_S, TAKEOVER_BOUND_S)
        killed = time.monotonic()
        await asyncio.to_thread(session_bouncer.kill)
        await rec_leader.wait_event("lost", timeout=TAKEOVER_BOUND_S)
        [lost] = beliefs.intervals_of("leader")
        assert lost.end is not None
        pooler.show(
            f"session mode: pooler SIGKILL to on_lost ({pooler.backend})", lost.end - killed
        )
        freed = time.monotonic()
        while await pooler.held():
            assert time.monotonic() - freed < TAKEOVER_BOUND_S, "the lock outlived the pooler"
            await asyncio.sleep(0.005)
        assert not follower.is_leader  # nobody can reach the server
        await asyncio.to_thread(session_bouncer.start)
        await eventually(
            lambda: leader.is_leader or follower.is_leader, TAKEOVER_BOUND_S, "a new leader"
        )
        assert sorted(await pooler.held()) == [
            lock.backend_pid for lock in (leader, follower) if lock.is_leader
        ]


# ---------------------------------------------------------------- session mode: partitions


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
