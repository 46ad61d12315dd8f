"""Patroni benchmark: how soon do locks, groups and the Scheduler follow a real failover?

One real Patroni cluster (``support.patroni``: etcd, three Patroni 3 nodes on PostgreSQL
15, HAProxy on Patroni's ``/primary``; ``ttl`` 6 s, ``loop_wait`` 1 s), and two fleets at
once (``support.ha_fleet``), one through HAProxy, one with a multi-host DSN
(``target_session_attrs=read-write``): each three fenced ``LeaderLock`` candidates with a
``Scheduler`` whose job writes its slot every second through ``run.transaction`` (failed
runs retried: ``Policy(retry=Retry(...))``), and a fenced ``Coordinator`` group of two
moving a checkpoint. The library's default retry strategy (``--before``: the locks with
the default before issue 32, ``ExponentialBackoff(error_max_s=2.0)``).

Events, in turn (default: switchover, crash, switchover, crash): a switchover through
Patroni's REST ``/switchover``; a crash: the primary's WAL senders are frozen (SIGSTOP)
for ``--freeze`` s (with ``synchronous_mode`` its commits wait), then its Patroni and
its postmaster are SIGKILLed; Patroni promotes a standby after its ``ttl``. A crashed
node stays down (a lost machine): the second crash leaves one node of three.

Measured per event and fleet (this process's ``time.monotonic()``): when the new primary
first answered ``pg_is_in_recovery() = false`` (a session to each node, polled every
10 ms), when HAProxy first routed a new connection to it (polled every 20 ms), and the
first ``on_acquired`` of the fleet's candidates after the event. Checked at the end, on
the final primary: overlapping leadership beliefs, terms strictly increasing, every slot
of the schedule once (0 missing, 0 written twice), checkpoint positions 1, 2, 3...

Usage::

    python benchmarks/patroni.py                       # synchronous_mode on
    python benchmarks/patroni.py --asynchronous        # off: a lagged crash may lose rows
    python benchmarks/patroni.py --events switchover,crash --json /tmp/patroni.json
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import psycopg
from _common import describe_machine, interrupt_on_signals, machine_info, markdown_table

from pgleaderlock import ExponentialBackoff
from support.ha_fleet import Fleet
from support.patroni import PatroniCluster, patroni_unavailable_reason

WAIT_S = 60.0


class Watch:
    """When each node is first seen writable, and HAProxy first routes to a node."""

    def __init__(self, cluster: PatroniCluster) -> None:
        self.cluster = cluster
        self.writable: dict[str, list[float]] = {n.name: [] for n in cluster.nodes}
        self.routed: list[tuple[float, int]] = []  # (when, the server's port)
        self._tasks: list[asyncio.Task[None]] = []

    async def __aenter__(self) -> Watch:
        for node in self.cluster.nodes:
            self._tasks.append(asyncio.create_task(self._node(node.name, node.dsn)))
        self._tasks.append(asyncio.create_task(self._haproxy()))
        return self

    async def __aexit__(self, *exc: object) -> None:
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)

    async def _node(self, name: str, dsn: str) -> None:
        while True:
            try:
                async with await psycopg.AsyncConnection[tuple[Any, ...]].connect(
                    dsn, autocommit=True, connect_timeout=1
                ) as conn:
                    while True:
                        cur = await asyncio.wait_for(
                            conn.execute("SELECT pg_is_in_recovery()"), 1.0
                        )
                        row = await cur.fetchone()
                        if row is not None and row[0] is False:
                            self.writable[name].append(time.monotonic())
                        await asyncio.sleep(0.01)
            except (psycopg.Error, OSError, TimeoutError):
                await asyncio.sleep(0.01)

    async def _haproxy(self) -> None:
        sql = "SELECT inet_server_port() WHERE NOT pg_is_in_recovery()"
        while True:
            with contextlib.suppress(psycopg.Error, OSError, TimeoutError):
                async with await psycopg.AsyncConnection[tuple[Any, ...]].connect(
                    self.cluster.haproxy_dsn, autocommit=True, connect_timeout=1
                ) as conn:
                    cur = await asyncio.wait_for(conn.execute(sql), 1.0)
                    row = await cur.fetchone()
                    if row is not None:
                        self.routed.append((time.monotonic(), int(row[0])))
            await asyncio.sleep(0.02)

    def first_writable(self, name: str, after: float) -> float | None:
        return min((t for t in self.writable[name] if t > after), default=None)

    def first_routed(self, port: int, after: float) -> float | None:
        return min((t for t, p in self.routed if t > after and p == port), default=None)


async def event(
    kind: str, cluster: PatroniCluster, fleets: list[Fleet], watch: Watch, freeze_s: float
) -> dict[str, float]:
    """One switchover or crash; the figures (seconds)."""
    old = cluster.leader()
    assert old is not None
    for fleet in fleets:
        fleet.server_going_down()
    if kind == "crash":
        frozen = await asyncio.to_thread(cluster.freeze_replication)
        await asyncio.sleep(freeze_s)
        began = time.monotonic()
        await asyncio.to_thread(cluster.crash_primary)
        cluster.thaw(frozen)
        deadline = time.monotonic() + WAIT_S
        while (new := cluster.leader()) in (None, old):
            assert time.monotonic() < deadline, "no new leader after the crash"
            await asyncio.sleep(0.05)
    else:
        began = time.monotonic()
        new = await asyncio.to_thread(cluster.switchover)
    assert new is not None
    values: dict[str, float] = {}
    for fleet in fleets:
        deadline = time.monotonic() + WAIT_S
        while fleet.acquired_after(began) is None:
            assert time.monotonic() < deadline, f"{fleet.kind}: no new leader"
            await asyncio.sleep(0.01)
    writable = watch.first_writable(new, began)
    routed = watch.first_routed(cluster.node(new).pg_port, began)
    assert writable is not None
    values["event -> new primary writable"] = writable - began
    if routed is not None:
        values["new primary writable -> HAProxy routes to it"] = routed - writable
    for fleet in fleets:
        leader = fleet.acquired_after(began)
        assert leader is not None
        values[f"{fleet.kind}: event -> new leader"] = leader - began
        values[f"{fleet.kind}: new primary writable -> new leader"] = leader - writable
    await asyncio.sleep(2.0)  # a few slots and positions under the new leader
    await asyncio.to_thread(cluster.wait_healthy)  # the crashed node stays down
    await asyncio.sleep(1.0)
    return values


async def run(args: argparse.Namespace) -> tuple[list[tuple[str, dict[str, float]]], list[str]]:
    results: list[tuple[str, dict[str, float]]] = []
    cluster = PatroniCluster(synchronous=not args.asynchronous)
    await asyncio.to_thread(cluster.start)
    print(f"cluster up in {cluster.setup_s:.1f} s")
    strategy = ExponentialBackoff(error_max_s=2.0) if args.before else None
    fleets = [
        Fleet("haproxy", cluster.haproxy_dsn, (33, 1), retry_strategy=strategy),
        Fleet("multihost", cluster.multi_host_dsn, (33, 2), retry_strategy=strategy),
    ]
    try:
        async with Watch(cluster) as watch:
            for fleet in fleets:
                await fleet.setup()
                await fleet.start()
            await asyncio.sleep(3.0)
            for i, kind in enumerate(args.events):
                values = await event(kind, cluster, fleets, watch, args.freeze)
                results.append((kind, values))
                shown = ", ".join(f"{k} {v * 1000:.0f} ms" for k, v in values.items())
                print(f"[{i + 1}/{len(args.events)}] {kind}: {shown}", flush=True)
            for fleet in fleets:
                await fleet.stop()
            problems = [p for fleet in fleets for p in await fleet.check()]
            for fleet in fleets:
                slots = len({s for s, *_ in await _ledger(fleet)})
                print(f"{fleet.kind}: {len(fleet.acquired)} leaderships, {slots} slots, "
                      f"{fleet.positions} checkpoint positions")  # fmt: skip
    finally:
        for fleet in fleets:
            await fleet.stop()
        await asyncio.to_thread(cluster.close)
    return results, problems


async def _ledger(fleet: Fleet) -> list[tuple[Any, ...]]:
    from support.ha_fleet import execute

    name = fleet.scheds[0].schedule_name("tick")
    return await execute(
        fleet.dsn, "SELECT slot FROM public.pgleaderlock_runs WHERE schedule = %s", (name,)
    )


def report(results: list[tuple[str, dict[str, float]]]) -> list[dict[str, Any]]:
    groups: dict[tuple[str, str], list[float]] = {}
    for kind, values in results:
        for metric, value in values.items():
            groups.setdefault((kind, metric), []).append(value)
    rows, out = [], []
    for (kind, metric), values in sorted(groups.items()):
        median, worst = statistics.median(values), max(values)
        rows.append(
            [kind, metric, len(values), f"{median * 1000:.0f} ms", f"{worst * 1000:.0f} ms"]
        )
        out.append({"event": kind, "metric": metric, "values": values})
    print()
    print(markdown_table(["Event", "Metric", "n", "Median", "Max"], rows))
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("--events", default="switchover,crash,switchover,crash",
                        help="comma-separated: switchover, crash")  # fmt: skip
    parser.add_argument("--freeze", type=float, default=1.0,
                        help="seconds the WAL senders are frozen before a crash (1)")  # fmt: skip
    parser.add_argument("--asynchronous", action="store_true", help="synchronous_mode off")
    parser.add_argument("--before", action="store_true",
                        help="the locks with the default strategy before issue 32: "
                        "ExponentialBackoff(error_max_s=2.0), no down_s")  # fmt: skip
    parser.add_argument("--json", type=Path, help="also write every figure here")
    args = parser.parse_args(argv)
    args.events = [e.strip() for e in args.events.split(",") if e.strip()]
    if bad := [e for e in args.events if e not in ("switchover", "crash")]:
        parser.error(f"unknown events: {bad}")
    reason = patroni_unavailable_reason()
    if reason is not None:
        print(f"cannot run: {reason}", file=sys.stderr)
        return 2
    interrupt_on_signals()
    logging.getLogger("pgleaderlock").addHandler(logging.NullHandler())
    logging.getLogger("pgleaderlock").propagate = False
    info = {**machine_info(), "server_version": "15 (Patroni 3, Debian's packages)"}
    print(describe_machine(info))
    began = time.monotonic()
    try:
        results, problems = asyncio.run(run(args))
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    rows = report(results)
    print("\nproblems: " + ("none" if not problems else "\n  " + "\n  ".join(problems)))
    print(f"{len(results)} events in {time.monotonic() - began:.0f} s")
    if args.json:
        args.json.write_text(json.dumps({"machine": info, "results": rows}, indent=2))
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
