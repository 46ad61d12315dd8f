"""Who leads: how soon every follower is told of a new leader (``on_leader_changed``).

Two candidate locks in this process hand leadership to each other (``step_down()``,
the other one waits on the server) ``--changes`` times. ``--followers`` follower
processes each run a candidate (polling, once an hour: it finds the lock held and
stays a follower) and an observer (``eligible=False``), each with an ``on_leader_changed``
callback that prints ``time.monotonic()`` and the identity it was told (Linux's
monotonic clock is one clock for every process of the machine). For each change the
time is the new leader's ``on_acquired`` (in this process) to each follower's callback
(negative when a follower was told before the leader's ``on_acquired`` ran: the new
leader's ``NOTIFY`` goes out just before its ``on_acquired`` callbacks).

Printed: the median, p95 and max over all (change, follower) pairs, the median of the
slowest follower per change, and how many changes some follower missed (must be 0).

Two more measurements (``--only``):

- ``handover``: ``hand_over(to=X)`` among four candidates in this process, all queued on
  the server, to a random one of the three waiting, ``--changes`` times: the time from
  the call to X's ``on_acquired``, and whether it landed on X (and nobody else
  announced leadership meanwhile).
- ``preferred``: a leader of priority 1; a candidate of priority 5 starts: the time from
  its ``start()`` to its ``on_acquired`` (``handover_delay_s`` 0.5 s, the default,
  included), ``--trials`` times.

Usage::

    python benchmarks/leader_changes.py                    # 20 changes, 3 follower processes
    python benchmarks/leader_changes.py --dsn postgresql://postgres@127.0.0.1/test

Without ``--dsn`` a throwaway cluster is started and removed afterwards. Every wait is
bounded, and every process started here is killed on every exit path.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import functools
import json
import random
import subprocess
import sys
import time
import uuid
from collections.abc import Sequence
from typing import Any

import _common

from pgleaderlock import FixedInterval, LeaderInfo, LeaderLock, LockOptions, Participation, Session

TIMINGS: dict[str, Any] = {
    # A lock that stepped down waits one delay before it queues again (on the server,
    # for one delay at a time): the pause between changes is longer.
    "retry_strategy": FixedInterval(0.5),
    "health_interval_s": 1.0,
}


def published(identity: str, *, session: Session | None = None, **more: Any) -> LockOptions:
    """The options of a lock that publishes ``identity`` (and ``more`` of
    ``Participation``'s fields), without plugins."""
    participation = Participation(identity=identity, **more)
    return LockOptions(
        participation=participation, session=session or Session(), load_plugins=False
    )


async def follower(dsn: str, name: str, tag: str) -> None:
    """A follower process: a candidate and an observer, each printing what it is told."""
    _common.exit_with_parent()
    locks = [
        # A candidate that polls: it finds the lock held and tries again only an hour
        # later, so that the changes stay between this process's two (a waiting one
        # would be queued before them).
        LeaderLock.from_name(
            name,
            dsn,
            options=published(f"{tag}-candidate", session=Session(follower_mode="poll")),
            **{**TIMINGS, "retry_strategy": FixedInterval(3600.0)},
        ),
        LeaderLock.from_name(
            name, dsn, options=published(f"{tag}-observer", eligible=False), **TIMINGS
        ),
    ]
    for lock in locks:

        def told(info: LeaderInfo | None, who: str = lock.identity) -> None:
            print(json.dumps([who, time.monotonic(), info and info.identity]), flush=True)

        lock.on_leader_changed(told)
    for lock in locks:
        await lock.start()
    print(json.dumps(["ready", time.monotonic(), None]), flush=True)
    await asyncio.Event().wait()  # until killed


async def measure(dsn: str, args: argparse.Namespace) -> dict[str, Any]:
    name = f"bench-leader-{uuid.uuid4().hex[:8]}"
    acquired: list[tuple[str, float]] = []
    a, b = (
        LeaderLock.from_name(name, dsn, options=published(f"main-{x}"), **TIMINGS) for x in "ab"
    )
    for lock in (a, b):
        lock.on_acquired(lambda lock=lock: acquired.append((lock.identity, time.monotonic())))
    procs: list[subprocess.Popen[str]] = []
    try:
        await a.start()
        assert await a.wait_for_leadership(10)
        await b.start()
        for i in range(args.followers):
            procs.append(
                subprocess.Popen(
                    [sys.executable, __file__, "--follower", name, f"f{i}", "--dsn", dsn],
                    stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                )
            )  # fmt: skip
        lines: list[list[Any]] = []

        async def read(proc: subprocess.Popen[str]) -> None:
            assert proc.stdout is not None
            while line := await asyncio.to_thread(proc.stdout.readline):
                lines.append(json.loads(line))

        readers = [asyncio.create_task(read(p)) for p in procs]
        async with asyncio.timeout(30):
            while sum(1 for entry in lines if entry[0] == "ready") < len(procs):
                await asyncio.sleep(0.05)
        await asyncio.sleep(1.0)  # every follower queued on the server
        first = len(acquired)
        for _ in range(args.changes):
            leader = a if a.is_leader else b
            await leader.step_down()
            other = b if leader is a else a
            assert await other.wait_for_leadership(10)
            await asyncio.sleep(args.pause)
        await asyncio.sleep(0.5)
        for proc in procs:
            proc.kill()
        for task in readers:
            task.cancel()
        await asyncio.gather(*readers, return_exceptions=True)
        watchers = sorted({e[0] for e in lines if e[0] != "ready"})
        delays: list[float] = []
        slowest: list[float] = []
        missed = 0
        changes = acquired[first:]
        for k, (identity, at) in enumerate(changes):
            # The first time each watcher was told of this leader after the change
            # before it: a follower may be told before the leader's own on_acquired
            # callbacks ran (the NOTIFY goes out just before them): a negative delay.
            after = changes[k - 1][1] if k else acquired[first - 1][1]
            per: list[float] = []
            for who in watchers:
                told = [t for w, t, i in lines if w == who and i == identity and t > after]
                if told:
                    per.append(min(told) - at)
                else:
                    missed += 1
            delays.extend(per)
            if args.verbose:
                print(identity, [f"{d * 1000:.1f}" for d in per])
            if per:
                slowest.append(max(per))
        return {"delays": delays, "slowest": slowest, "missed": missed, "watchers": watchers}
    finally:
        for proc in procs:
            with contextlib.suppress(Exception):
                proc.kill()
                proc.wait(5)
        await b.shutdown()
        await a.shutdown()


async def measure_handover(dsn: str, args: argparse.Namespace) -> dict[str, Any]:
    name = f"bench-handover-{uuid.uuid4().hex[:8]}"
    acquired: list[tuple[str, float]] = []
    locks = {
        x: LeaderLock.from_name(
            name, dsn, options=published(x), **{**TIMINGS, "retry_strategy": FixedInterval(1.0)}
        )
        for x in "abcd"
    }
    for who, lock in locks.items():
        lock.on_acquired(lambda who=who: acquired.append((who, time.monotonic())))
    rng = random.Random(1)
    delays: list[float] = []
    landed = 0
    try:
        for lock in locks.values():
            await lock.start()
            await asyncio.sleep(0.05)
        for _ in range(args.changes):
            leader = next(lock for lock in locks.values() if lock.is_leader)
            others = sorted(w for w in locks if w != leader.identity)
            async with asyncio.timeout(30):
                while {p.info.identity for p in await leader.participants() if p.waiting} < set(
                    others
                ):
                    await asyncio.sleep(0.05)
            target = rng.choice(others)
            before = len(acquired)
            started = time.monotonic()
            await leader.hand_over(to=target)
            assert await locks[target].wait_for_leadership(10)
            who, at = acquired[before]
            landed += who == target and len(acquired) == before + 1
            delays.append(at - started)
    finally:
        for lock in locks.values():
            await lock.shutdown()
    return {"delays": delays, "landed": landed}


async def measure_preferred(dsn: str, args: argparse.Namespace) -> dict[str, Any]:
    delays: list[float] = []
    moves: list[int] = []
    for _ in range(args.trials):
        name = f"bench-preferred-{uuid.uuid4().hex[:8]}"
        acquired: list[str] = []
        low = LeaderLock.from_name(name, dsn, options=published("low", priority=1), **TIMINGS)
        high = LeaderLock.from_name(name, dsn, options=published("high", priority=5), **TIMINGS)
        low.on_acquired(functools.partial(acquired.append, "low"))
        done = asyncio.get_running_loop().create_future()
        high.on_acquired(lambda done=done: done.done() or done.set_result(time.monotonic()))
        high.on_acquired(functools.partial(acquired.append, "high"))
        try:
            await low.start()
            assert await low.wait_for_leadership(10)
            started = time.monotonic()
            await high.start()
            async with asyncio.timeout(30):
                delays.append(await done - started)
            await asyncio.sleep(0.3)
            moves.append(len(acquired) - 1)
        finally:
            await high.shutdown()
            await low.shutdown()
    return {"delays": delays, "moves": moves}


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--dsn", help="server to use (default: a throwaway cluster)")
    parser.add_argument("--changes", type=int, default=20)
    parser.add_argument("--followers", type=int, default=3)
    parser.add_argument("--pause", type=float, default=0.8, help="seconds between changes")
    parser.add_argument("--verbose", action="store_true", help="print every change")
    parser.add_argument("--trials", type=int, default=10, help="preferred: trials")
    parser.add_argument(
        "--only", choices=["changes", "handover", "preferred"], action="append",
        help="run only these measurements (repeatable; default all)",
    )  # fmt: skip
    parser.add_argument("--follower", nargs=2, metavar=("NAME", "TAG"), help=argparse.SUPPRESS)
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> None:
    args = parse_args(argv)
    if args.follower:
        asyncio.run(follower(args.dsn, *args.follower))
        return
    _common.interrupt_on_signals()
    only = set(args.only or ["changes", "handover", "preferred"])
    with _common.database(args.dsn) as dsn:
        print(_common.describe_machine({**_common.machine_info(), **_common.server_info(dsn)}))
        if "changes" in only:
            report_changes(asyncio.run(measure(dsn, args)), args)
        if "handover" in only:
            result = asyncio.run(measure_handover(dsn, args))
            print(f"\nhand_over(to=X), {len(result['delays'])} trials, four candidates\n")
            print(_table("call -> X's on_acquired", result["delays"]))
            print(f"\nlanded on X (nobody else announced): {result['landed']} of "
                  f"{len(result['delays'])}")  # fmt: skip
        if "preferred" in only:
            result = asyncio.run(measure_preferred(dsn, args))
            print(f"\na preferred candidate joins (priority 5 over 1), {args.trials} trials\n")
            print(_table("start() -> its on_acquired", result["delays"]))
            print(f"\nmoves per trial: {sorted(set(result['moves']))}")


def _table(what: str, values: list[float]) -> str:
    summary = _common.summarize(values)
    cells = map(_common.fmt_ms, (summary.median, summary.p95, summary.max))
    return _common.markdown_table([what, "n", "median", "p95", "max"], [[what, summary.n, *cells]])


def report_changes(result: dict[str, Any], args: argparse.Namespace) -> None:
    every = _common.summarize(result["delays"])
    worst = _common.summarize(result["slowest"])
    print(
        f"\n{args.changes} changes, {len(result['watchers'])} watchers in "
        f"{args.followers} processes (a candidate and an observer each)\n"
    )
    print(
        _common.markdown_table(
            ["on_acquired -> on_leader_changed", "n", "median", "p95", "max"],
            [
                ["every follower", every.n,
                 *map(_common.fmt_ms, (every.median, every.p95, every.max))],
                ["slowest follower per change", worst.n,
                 *map(_common.fmt_ms, (worst.median, worst.p95, worst.max))],
            ],
        )
    )  # fmt: skip
    print(f"\nchanges some follower missed: {result['missed']}")


if __name__ == "__main__":
    main()
