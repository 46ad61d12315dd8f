"""``coordinator.py --only shared``: 10,000 names over 3 replicas on shared sessions
(sessions, start, SIGKILL failover per name, idle CPU), and the floor of one batch.
"""

from __future__ import annotations

import argparse
import os
import random
import time
from dataclasses import dataclass, field

from _common import fmt_ms
from _coordinator_bench import Bench, Tracker, TrialError, load, mp, pct, settle_wait


@dataclass
class SharedTrial:
    all_led_s: float | None = None
    balanced_s: float | None = None
    sessions: dict[str, int] = field(default_factory=dict)  # max seen per member
    locks_held: int = 0
    locks_waiting: int = 0
    idle_cpu: list[float] = field(default_factory=list)  # % of one core, per replica
    idle_changes: int = 0
    victim_names: int = 0
    relead: list[float] = field(default_factory=list)  # per name, seconds
    relead_all_s: float | None = None
    rebalanced_s: float | None = None
    floor_all_s: float | None = None
    error: str | None = None


def shared_trial(bench: Bench, args: argparse.Namespace, number: int) -> SharedTrial:
    result = SharedTrial()
    n, count = args.names, args.replicas
    group = f"bs{os.getpid()}t{number}"
    prefix = f"bench-shared-{os.getpid()}-{number}:"
    bench.tracker = Tracker(n)
    bench.sessions_max = {}
    cfg = {"kind": "coord", "sessions": "shared", "group": group, "prefix": prefix, "n": n}
    replicas = [bench.spawn(cfg) for _ in range(count)]
    try:
        bench.wait_ready(replicas)
        bench.sample_group = group
        go = time.monotonic()
        for replica in replicas:
            replica.send("go")
        rids = [r.rid for r in replicas]
        bench.wait(lambda: settle_wait(bench, rids), 120.0, "all names led and balanced")
        led = bench.tracker.first_all_led(go)
        settled = bench.tracker.last_change_at(go)
        result.all_led_s = None if led is None else led - go
        result.balanced_s = None if settled is None else settled - go
        # Steady state: the ring of watchers in place, then the idle window.
        bench.wait(
            lambda: True if bench.advisory(f"pgl:{group}:", ":watch")[1] == count else None,
            30.0,
            "every replica's watch session waiting",
        )
        result.locks_held, result.locks_waiting = bench.advisory(f"pgl:{group}:")
        bench.sample_group = None
        bench.sample_sessions(group)
        before = {r.rid: r.cpu_s() for r in replicas}
        changes = len(bench.tracker.log)
        window = time.monotonic()
        bench.pump(None, args.idle_s)
        elapsed = time.monotonic() - window
        result.idle_cpu = [100 * (r.cpu_s() - before[r.rid]) / elapsed for r in replicas]
        result.idle_changes = len(bench.tracker.log) - changes
        result.sessions = {m: bench.sessions_max.get(m, 0) for m in (r.member for r in replicas)}
        # SIGKILL of one replica.
        bench.wait(
            lambda: True if bench.advisory(f"pgl:{group}:", ":watch")[1] == count else None,
            30.0,
            "every replica's watch session waiting",
        )
        victim = random.choice(replicas)
        names = set(bench.tracker.owned.get(victim.rid, set()))
        result.victim_names = len(names)
        killed = time.monotonic()
        bench.kill(victim)

        def relead() -> bool | None:
            if not victim.dead:
                return None
            return True if all(bench.tracker.led_by[i] for i in names) else None

        bench.wait(relead, args.failover_timeout, "the killed replica's names led again")
        found = bench.tracker.releads(names, victim.rid, killed)
        result.relead = [t - killed for t in found.values()]
        result.relead_all_s = max(result.relead) if result.relead else None
        survivors = [r.rid for r in replicas if r is not victim]
        bench.wait(lambda: settle_wait(bench, survivors), 120.0, "survivors balanced")
        settled = bench.tracker.last_change_at(killed)
        result.rebalanced_s = None if settled is None else settled - killed
    except TrialError as exc:
        result.error = str(exc)
    finally:
        bench.sample_group = None
        bench.stop_all()
        bench.wait_clean(f"pgl:{group}:")
    if result.victim_names:
        result.floor_all_s = batch_floor(bench, args, number, result.victim_names)
    return result


def batch_floor(bench: Bench, args: argparse.Namespace, number: int, count: int) -> float | None:
    """The floor of a shared-session failover: one raw session holds ``count`` names,
    another waits for all of them in one statement; SIGKILL the holder; the time until
    the statement returns."""
    prefix = f"bench-floor-{os.getpid()}-{number}:"
    app = f"bench-rawone-{os.getpid()}-{number}"
    bench.tracker = Tracker(count)
    base = {"kind": "raw", "prefix": prefix, "indexes": list(range(count))}
    try:
        holder = bench.spawn({**base, "mode": "hold-one", "app": f"{app}-h"})
        bench.wait_ready([holder])
        waiter = bench.spawn({**base, "mode": "wait-one", "app": f"{app}-w"})
        bench.wait_ready([waiter])
        bench.wait(lambda: True if bench.advisory(f"{app}-w")[1] == 1 else None, 10.0, "queued")
        killed = time.monotonic()
        bench.kill(holder)
        bench.wait(
            lambda: True if len(bench.tracker.owned.get(waiter.rid, ())) == count else None,
            args.failover_timeout,
            "floor re-granted",
        )
        found = bench.tracker.releads(set(range(count)), holder.rid, killed)
        return max(found.values()) - killed
    except TrialError as exc:
        print(f"  floor trial failed: {exc}")
        return None
    finally:
        bench.stop_all()
        bench.wait_clean(app)


def run_shared(bench: Bench, args: argparse.Namespace) -> list[SharedTrial]:
    print(
        f"\n== shared: {args.names:,} names over {args.replicas} replicas, {args.trials_shared}"
        f" trials ({args.idle_s:g} s idle window each); {load()}"
    )
    trials = []
    for number in range(1, args.trials_shared + 1):
        t = shared_trial(bench, args, number)
        trials.append(t)
        if t.error:
            print(f"  trial {number}: FAILED: {t.error}")
            continue
        print(
            f"  trial {number}: all led {fmt_ms(t.all_led_s)}, balanced {fmt_ms(t.balanced_s)};"
            f" sessions {sorted(t.sessions.values())}; locks {t.locks_held} held"
            f" + {t.locks_waiting} waiting; idle CPU"
            f" {', '.join(pct(c) for c in t.idle_cpu)} ({t.idle_changes} changes);"
            f" kill ({t.victim_names} names): per name {mp(t.relead)}, all"
            f" {fmt_ms(t.relead_all_s)} (floor {fmt_ms(t.floor_all_s)}),"
            f" rebalanced {fmt_ms(t.rebalanced_s)}"
        )
    return trials
