"""``coordinator.py --only dedicated``: per-name failover on dedicated sessions, against
a ``LeaderLock`` per name and raw sessions.
"""

from __future__ import annotations

import argparse
import os
import random
import time
from dataclasses import dataclass, field

from _common import fmt_ms
from _coordinator_bench import Bench, Replica, Tracker, TrialError, load, mp, settle_wait


@dataclass
class KillTrial:
    variant: str
    names: int = 0
    per_name: list[float] = field(default_factory=list)
    all_s: float | None = None
    settle_s: float | None = None  # coordinator: start -> the last change of leader
    queued_s: float | None = None  # coordinator: start -> every standby queued (parent clock)
    sessions: list[int] = field(default_factory=list)
    unsettled: str | None = None  # coordinator: killed before it settled (why)
    after: list[int] = field(default_factory=list)  # coordinator: survivors' counts then
    even_s: float | None = None  # coordinator: kill -> the survivors even (±1), or None
    error: str | None = None


DEDICATED_VARIANTS = ("coordinator", "leaderlock", "raw")


def dedicated_trial(bench: Bench, args: argparse.Namespace, variant: str, number: int) -> KillTrial:
    result = KillTrial(variant)
    n, count = args.dedicated_names, args.replicas
    tag = f"{os.getpid()}-{number}"
    prefix = f"bench-ded-{variant}-{tag}:"
    bench.tracker = Tracker(n)
    replicas: list[Replica] = []
    app_prefix = ""
    try:
        if variant == "coordinator":
            group = f"bd{os.getpid()}t{number}"
            app_prefix = f"pgl:{group}:"
            cfg = {
                "kind": "coord",
                "sessions": "dedicated",
                "group": group,
                "prefix": prefix,
                "n": n,
            }
            replicas = [bench.spawn(cfg) for _ in range(count)]
            bench.wait_ready(replicas)
            go = time.monotonic()
            for replica in replicas:
                replica.send("go")
            rids = [r.rid for r in replicas]

            standbys = n  # one standby per name (rendezvous hashing picks it)
            queued: list[int] = [0]

            def settled() -> bool | None:
                if settle_wait(bench, rids) is None:
                    return None
                queued[0] = bench.advisory(app_prefix, ":lock")[1]
                if queued[0] == standbys and result.queued_s is None:
                    result.queued_s = time.monotonic() - go
                return True if queued[0] == standbys else None

            if bench.pump(settled, args.settle_timeout) is None:
                # Killed all the same (once every name is led): what a crash then costs.
                queued[0] = bench.advisory(app_prefix, ":lock")[1]
                result.unsettled = (
                    f"not settled within {args.settle_timeout:g} s: leading"
                    f" {bench.tracker.counts(rids)}, standbys queued {queued[0]}/{standbys}"
                )
                if bench.tracker.led != n:
                    raise TrialError(result.unsettled)
            else:
                at = bench.tracker.last_change_at(go)
                result.settle_s = None if at is None else at - go
            sessions = bench.sessions(group)
            result.sessions = sorted(sessions.values())
        elif variant == "leaderlock":
            app_prefix = f"bench-plain-{tag}-"
            for w in range(count):
                share = [i for i in range(n) if i % count == w]
                replicas.append(
                    bench.spawn(
                        {
                            "kind": "plain",
                            "prefix": prefix,
                            "n": n,
                            "preferred": share,
                            "app": f"{app_prefix}{w}",
                        }
                    )
                )
            bench.wait_ready(replicas)
            for replica in replicas:
                replica.send("go")
            bench.wait(lambda: True if all(r.phase1 for r in replicas) else None, 60.0, "phase 1")
            for replica in replicas:
                replica.send("go2")
            bench.wait(
                lambda: True if bench.advisory(app_prefix)[1] == n * (count - 1) else None,
                60.0,
                "every other process queued for each name",
            )
        else:
            app_prefix = f"bench-raw-{tag}-"
            share = [i for i in range(n) if i % count == 0]
            base = {"kind": "raw", "prefix": prefix, "indexes": share}
            replicas.append(bench.spawn({**base, "mode": "hold", "app": f"{app_prefix}h"}))
            bench.wait_ready(replicas)
            replicas.append(bench.spawn({**base, "mode": "wait", "app": f"{app_prefix}w"}))
            bench.wait_ready(replicas)
            bench.wait(
                lambda: True if bench.advisory(app_prefix)[1] == len(share) else None,
                30.0,
                "every name queued",
            )
        bench.pump(None, 0.2 + random.uniform(0.0, 0.3))
        victim = random.choice(replicas) if variant != "raw" else replicas[0]
        names = set(bench.tracker.owned.get(victim.rid, set()))
        result.names = len(names)
        killed = time.monotonic()
        bench.kill(victim)
        bench.wait(
            lambda: True if victim.dead and all(bench.tracker.led_by[i] for i in names) else None,
            args.failover_timeout,
            "the killed process's names led again",
        )
        found = bench.tracker.releads(names, victim.rid, killed)
        result.per_name = [t - killed for t in found.values()]
        result.all_s = max(result.per_name) if result.per_name else None
        if variant == "coordinator":
            survivors = [r.rid for r in replicas if r is not victim]
            result.after = bench.tracker.counts(survivors)
            if bench.pump(
                lambda: True if bench.tracker.balanced(survivors) else None, args.even_timeout
            ):
                result.even_s = time.monotonic() - killed
    except TrialError as exc:
        result.error = str(exc)
    finally:
        bench.stop_all()
        if app_prefix:
            bench.wait_clean(app_prefix)
    return result


def run_dedicated(bench: Bench, args: argparse.Namespace) -> dict[str, list[KillTrial]]:
    print(
        f"\n== dedicated: {args.dedicated_names} names over {args.replicas} processes,"
        f" {args.trials_dedicated} trials per variant, interleaved; {load()}"
    )
    results: dict[str, list[KillTrial]] = {v: [] for v in DEDICATED_VARIANTS}
    variants = args.variants or list(DEDICATED_VARIANTS)
    for number in range(1, args.trials_dedicated + 1):
        for variant in random.sample(variants, len(variants)):
            t = dedicated_trial(bench, args, variant, number)
            results[variant].append(t)
            if t.error:
                print(f"  [{variant}] trial {number}: FAILED: {t.error}")
                continue
            extra = ""
            if t.settle_s is not None:
                extra = (
                    f"; balanced after {fmt_ms(t.settle_s)}, every standby queued after"
                    f" {fmt_ms(t.queued_s)}; sessions {t.sessions}"
                )
            if t.unsettled:
                extra = f"; killed {t.unsettled}"
            if variant == "coordinator":
                extra += f"; survivors {t.after} after the failover, even after {fmt_ms(t.even_s)}"
            print(
                f"  [{variant}] trial {number}: {t.names} names, per name {mp(t.per_name)},"
                f" all {fmt_ms(t.all_s)}{extra}"
            )
    return results
