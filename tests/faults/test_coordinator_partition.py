"""A shared-session Coordinator cut off from the server stops its work before the server
can free its names.

The member reaches the server through a TCP proxy that stops forwarding (a silent
network: nothing is closed, nothing answers). The server would end the member's
sessions, and free its names, ``tcp_user_timeout_s`` after the cut; the proxy closes
them at that moment. Every worker of the member must have ended before then, and the
other member, which reaches the server directly, leads every name afterwards: no name
is ever run twice.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from typing import Any

import psycopg
import pytest

from pgleaderlock import Coordinator, FixedInterval, WorkerContext
from support.poll import eventually
from support.proxy import TcpProxy, tcp_target
from support.timings import lock_args

pytestmark = pytest.mark.timeout(60)

TIMINGS: dict[str, Any] = {
    "sessions": "shared",
    "retry_strategy": FixedInterval(0.2),
    "health_interval_s": 0.5,
    "health_timeout_s": 0.5,
    "tcp_user_timeout_s": 2.0,
    "connect_timeout_s": 2.0,
    "command_timeout_s": 1.0,
    "balance_interval_s": 0.1,
    "load_plugins": False,
}
"""The detection bound is ``health_interval_s + health_timeout_s`` = 1 s; the server
gives a silent member's sessions up after ``tcp_user_timeout_s`` = 2 s."""


class Beliefs:
    """When each worker began and ended, per member."""

    def __init__(self) -> None:
        self.spans: list[tuple[str, str, float, float | None]] = []

    def worker(self, member: str) -> Any:
        async def run(ctx: WorkerContext) -> None:
            index = len(self.spans)
            self.spans.append((member, ctx.name, time.monotonic(), None))
            try:
                await asyncio.Event().wait()
            finally:
                self.spans[index] = (member, ctx.name, self.spans[index][2], time.monotonic())

        return run

    def running(self, member: str) -> set[str]:
        return {name for who, name, _, end in self.spans if who == member and end is None}


async def test_a_cut_off_shared_member_stops_before_its_names_are_freed(pg_dsn: str) -> None:
    host, port = tcp_target(pg_dsn)
    group = f"part_{uuid.uuid4().hex[:10]}"
    names = [f"{group}:{i}" for i in range(12)]
    beliefs = Beliefs()
    async with TcpProxy(host, port) as proxy:
        cut_dsn = psycopg.conninfo.make_conninfo(pg_dsn, host="127.0.0.1", port=proxy.port)
        cut_off = Coordinator(cut_dsn, **lock_args(TIMINGS, group=group))
        other = Coordinator(pg_dsn, **lock_args(TIMINGS, group=group))
        for name in names:
            cut_off.add(name, beliefs.worker("cut_off"))
        try:
            await cut_off.start()
            await eventually(lambda: cut_off.owned == set(names), 10, "the first member leads")
            for name in names:
                other.add(name, beliefs.worker("other"))
            await other.start()
            await eventually(
                lambda: len(cut_off.owned) == 6 and len(other.owned) == 6, 10, "balanced"
            )
            led_by_cut_off = set(cut_off.owned)

            proxy.stall()  # a silent network: the member's sessions get no answer
            stalled = time.monotonic()
            await asyncio.sleep(TIMINGS["tcp_user_timeout_s"])
            freed = time.monotonic()
            await proxy.cut()  # the server gives the sessions up: the names are free

            await eventually(lambda: other.owned == set(names), 10, "the other member leads all")
            # (a name is owned a moment before its worker's first step runs)
            await eventually(
                lambda: beliefs.running("other") == set(names), 10, "its workers all run"
            )
            stopped = [end for who, _, _, end in beliefs.spans if who == "cut_off"]
            assert None not in stopped, "a worker of the cut-off member still runs"
            last_stop = max(end for end in stopped if end is not None)
            print(f"cut-off member stopped its workers {last_stop - stalled:.3f} s after the cut")
            assert last_stop < freed, "the cut-off member still worked when its names were freed"
            began = {
                name: start
                for who, name, start, _ in beliefs.spans
                if who == "other" and name in led_by_cut_off and start > stalled
            }
            assert set(began) == led_by_cut_off
            assert min(began.values()) > last_stop  # no name was run twice at once
        finally:
            await asyncio.gather(cut_off.shutdown(), other.shutdown())
