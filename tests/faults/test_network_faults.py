"""Network faults: a proxy that stops forwarding, and a real silent partition (a
candidate in its own network namespace whose link is cut)."""

from __future__ import annotations

import asyncio
import time
from typing import TYPE_CHECKING

import pytest

from pgleaderlock import FixedInterval, LockState
from pgleaderlock.testing.beliefs import BeliefLog
from pgleaderlock.testing.candidate import CandidateOptions, CandidateProcess
from pgleaderlock.testing.postgres import ThrowawayPostgres
from support.fixture_types import Figures, MakeRecorder
from support.netns import NetnsLink
from support.poll import eventually
from support.proxy import proxied

if TYPE_CHECKING:
    from faults.conftest import Candidates
    from fix_locks import PgLock

S = LockState


@pytest.mark.timeout(60)
@pytest.mark.parametrize("shutdown_when", ["after_demotion", "while_leader"])
async def test_stalled_proxy(
    pg_dsn: str,
    candidates: Candidates,
    beliefs: BeliefLog,
    figures: Figures,
    shutdown_when: str,
) -> None:
    """The leader's connection goes through a proxy that stops forwarding both ways.

    The leader leaves LEADER within health_interval_s + health_timeout_s (its probe is
    late: the proxy's kernel acknowledges it), and reports on_lost when that probe fails.
    The server still sees a live TCP connection (to the proxy), so the partition
    bound's server-side TCP timeouts do not fire (they govern the proxy's connection,
    not the client's); the lease does: the server ends the idle session lease_s (2 s)
    after the leader's last probe, and the follower leads then, after the old leader's
    demotion. shutdown() stays bounded either way."""
    demotion_bound = 0.5 + 0.5
    async with proxied(pg_dsn) as (proxy, dsn):
        a, b, rec_a, _ = await candidates.leader_and_follower(
            dsn, leader={"connect_timeout_s": 1.0, "command_timeout_s": 1.0}
        )
        old_pid = a.backend_pid
        stalled_at = time.monotonic()
        proxy.stall()
        if shutdown_when == "after_demotion":
            await rec_a.wait_event("lost", timeout=10)
            demotion = time.monotonic() - stalled_at
            figures("demotion after stall", demotion, "ms")
            assert demotion < demotion_bound + 1.5  # bound from the last good probe
            assert not a.is_leader
            assert await b.wait_for_leadership(10)  # the lease freed the lock
            figures("takeover after stall (the lease)", time.monotonic() - stalled_at, "ms")
            assert await candidates.holders() == [b.backend_pid]
            assert old_pid not in await candidates.holders()
        stopping = time.monotonic()
        async with asyncio.timeout(10):
            await a.shutdown()
        took = time.monotonic() - stopping
        figures(f"shutdown() {shutdown_when.replace('_', ' ')}", took, "ms")
        assert took < 3.0  # connect or unlock timeout (1 s) plus slack
        assert a.state is S.STOPPED
        await proxy.cut()
        proxy.resume()
        await candidates.assert_leads(b, 10)
    beliefs.report().assert_safe()


@pytest.mark.timeout(150)
@pytest.mark.throwaway
async def test_partitioned_leader_demotes_before_anyone_else_leads(
    netns_link: NetnsLink,
    keys: tuple[int, int],
    pg_lock: PgLock,
    beliefs: BeliefLog,
    recorder: MakeRecorder,
    figures: Figures,
) -> None:
    """A leader in its own network namespace; its link is cut silently (no FIN, no RST).

    Three trials. Each time: the partitioned leader reports on_lost strictly before the
    host-side candidate becomes leader; the takeover comes within the partition bound
    (the server drops the silent session after tcp_user_timeout, rounded up to the next
    keepalive probe); after the link returns, the old leader rejoins as a follower.
    """
    link = netns_link
    health_interval_s, health_timeout_s, user_timeout_s = 1.0, 0.5, 2.5
    demotion_bound = health_interval_s + health_timeout_s
    print(f"D = {demotion_bound} s, U = tcp_user_timeout = {user_timeout_s} s, link {link}")
    pg = ThrowawayPostgres(
        listen_addresses=f"127.0.0.1,{link.host_addr}",
        hba_extra=[f"host all all {link.subnet} trust"],
    )
    await asyncio.to_thread(pg.start)
    inside: CandidateProcess | None = None
    host = pg_lock(
        dsn=pg.dsn,
        keys=keys,
        name="host",
        health_interval_s=health_interval_s,
        health_timeout_s=health_timeout_s,
        retry_strategy=FixedInterval(0.2),
    )
    rec_host = recorder(host)
    try:
        inside = CandidateProcess(
            "inside",
            f"postgresql://postgres@{link.host_addr}:{pg.port}/postgres",
            *keys,
            options=CandidateOptions(
                health_interval_s=health_interval_s,
                health_timeout_s=health_timeout_s,
                tcp_user_timeout_s=user_timeout_s,
                connect_timeout_s=1.0,
                command_timeout_s=1.0,
                retry_s=0.2,
            ),
            beliefs=beliefs,
            prefix=link.exec_prefix(),
        )
        await inside.start()
        await inside.wait_event("acquired", timeout_s=15)
        await host.start()
        for trial in (1, 2, 3):
            if trial > 1:  # hand leadership back to the candidate inside
                handing = time.monotonic()
                await host.step_down()
                await inside.wait_event("acquired", since=handing, timeout_s=10)
            settled = len(rec_host.names())

            def queued(n: int = settled) -> bool:
                return "acquire_failed" in rec_host.names()[n:]

            await rec_host.wait(queued, 10)  # the host candidate is queued on the server
            await asyncio.sleep(0.3)
            assert inside.is_leader
            assert not host.is_leader

            cut_at = time.monotonic()
            link.cut()
            lost = await inside.wait_event("lost", since=cut_at, timeout_s=10)
            await eventually(lambda: host.is_leader, 15, "the host candidate leads")
            took_over = next(i.start for i in beliefs.intervals_of("host") if i.start > cut_at)
            demotion, takeover = lost.t - cut_at, took_over - cut_at
            figures(f"trial {trial}: demotion after cut", demotion, "s")
            figures(f"trial {trial}: takeover after cut", takeover, "s")
            figures(f"trial {trial}: gap (takeover - demotion)", takeover - demotion, "s")
            assert lost.t < took_over, "the partitioned leader demoted itself too late"
            assert demotion <= demotion_bound + 1.0
            # The server gives up at the first keepalive probe after U s of silence
            # (probes every 1 s), so allow one probe interval plus slack.
            assert takeover <= user_timeout_s + 1.0 + 1.5

            healed_at = time.monotonic()
            link.heal()
            rejoin = await inside.wait_event("acquire_failed", since=healed_at, timeout_s=15)
            figures(f"trial {trial}: rejoined as follower after heal", rejoin.t - healed_at, "s")
            assert not inside.is_leader
            assert inside.find("acquired", since=cut_at) is None
            assert host.is_leader
        report = beliefs.report()
        print(report.format())
        report.assert_safe()
        assert not report.terminate_overlaps
    finally:
        link.heal()
        if inside is not None:
            await inside.stop(timeout_s=5)
        await host.shutdown(timeout_s=10)
        await asyncio.to_thread(pg.close)
