"""``coordinator.py --only balance``: a group balancing its names, and a joiner taking
its share.
"""

from __future__ import annotations

import argparse
import os
import time
from dataclasses import dataclass, field

from _common import fmt_ms
from _coordinator_bench import Bench, Tracker, TrialError, load, settle_wait


@dataclass
class BalanceTrial:
    settled_s: float | None = None
    counts: list[int] = field(default_factory=list)
    join_share_s: float | None = None
    join_settled_s: float | None = None
    join_counts: list[int] = field(default_factory=list)
    join_moves: int = 0
    join_acquisitions: int = 0
    steady_s: float = 0.0
    steady_moves: int | None = None
    steady_changes: int | None = None
    error: str | None = None


def balance_trial(
    bench: Bench, args: argparse.Namespace, number: int, steady_s: float
) -> BalanceTrial:
    result = BalanceTrial()
    n, count = args.balance_names, args.replicas
    group = f"bb{os.getpid()}t{number}"
    cfg = {
        "kind": "coord",
        "sessions": "shared",
        "group": group,
        "prefix": f"bench-bal-{os.getpid()}-{number}:",
        "n": n,
    }
    bench.tracker = Tracker(n)
    try:
        replicas = [bench.spawn(cfg) for _ in range(count)]
        bench.wait_ready(replicas)
        go = time.monotonic()
        for replica in replicas:
            replica.send("go")
        rids = [r.rid for r in replicas]
        bench.wait(lambda: settle_wait(bench, rids), 120.0, "balanced")
        at = bench.tracker.last_change_at(go)
        result.settled_s = None if at is None else at - go
        result.counts = sorted(bench.tracker.counts(rids))
        moves_before = sum(s["moves"] for s in bench.stats(replicas))
        # A replica joins.
        joiner = bench.spawn(cfg)
        bench.wait_ready([joiner])
        joined = time.monotonic()
        joiner.send("go")
        everyone = [*replicas, joiner]
        rids = [r.rid for r in everyone]
        bench.wait(lambda: settle_wait(bench, rids), 120.0, "balanced after the join")
        share = n // len(everyone)
        at = bench.tracker.first_count(joiner.rid, share)
        result.join_share_s = None if at is None else at - joined
        at = bench.tracker.last_change_at(joined)
        result.join_settled_s = None if at is None else at - joined
        result.join_counts = sorted(bench.tracker.counts(rids))
        result.join_moves = sum(s["moves"] for s in bench.stats(everyone)) - moves_before
        result.join_acquisitions = bench.tracker.acquisitions(joined)
        if steady_s > 0:
            moves_before = sum(s["moves"] for s in bench.stats(everyone))
            changes = len(bench.tracker.log)
            started = time.monotonic()
            bench.pump(None, steady_s)
            result.steady_s = time.monotonic() - started
            result.steady_moves = sum(s["moves"] for s in bench.stats(everyone)) - moves_before
            result.steady_changes = len(bench.tracker.log) - changes
    except TrialError as exc:
        result.error = str(exc)
    finally:
        bench.stop_all()
        bench.wait_clean(f"pgl:{group}:")
    return result


def run_balance(bench: Bench, args: argparse.Namespace) -> list[BalanceTrial]:
    print(
        f"\n== balance: {args.balance_names} names, {args.replicas} replicas then one more"
        f" (shared sessions), {args.trials_balance} trials; {args.steady_s:g} s steady"
        f" state in the first; {load()}"
    )
    trials = []
    for number in range(1, args.trials_balance + 1):
        t = balance_trial(bench, args, number, args.steady_s if number == 1 else 0.0)
        trials.append(t)
        if t.error:
            print(f"  trial {number}: FAILED: {t.error}")
            continue
        steady = ""
        if t.steady_moves is not None:
            steady = (
                f"; {t.steady_s:.0f} s steady: {t.steady_moves} moves, {t.steady_changes} changes"
            )
        print(
            f"  trial {number}: settled {t.counts} after {fmt_ms(t.settled_s)}; joiner's share"
            f" after {fmt_ms(t.join_share_s)}, settled {t.join_counts} after"
            f" {fmt_ms(t.join_settled_s)}, {t.join_moves} moves"
            f" ({t.join_acquisitions} acquisitions){steady}"
        )
    return trials
