"""The report of ``coordinator.py``: a table per section."""

from __future__ import annotations

import argparse
from typing import Any

from _common import fmt_ms, markdown_table
from _coordinator_balance import BalanceTrial
from _coordinator_bench import med, mp, p99, pct
from _coordinator_dedicated import KillTrial
from _coordinator_shared import SharedTrial


def status(ok: bool) -> str:
    return "met" if ok else "MISSED"


def report_shared(trials: list[SharedTrial], args: argparse.Namespace) -> list[list[str]]:
    """Print the shared section's table; return its rows of the targets table."""
    sessions = [c for t in trials for c in t.sessions.values()]
    led = [t.all_led_s for t in trials if t.all_led_s is not None]
    per_name = [v for t in trials for v in t.relead]
    alls = [t.relead_all_s for t in trials if t.relead_all_s is not None]
    floors = [t.floor_all_s for t in trials if t.floor_all_s is not None]
    cpu = [c for t in trials for c in t.idle_cpu]
    headers = [
        "trial",
        "all led",
        "balanced",
        "sessions",
        "locks held + waiting",
        "idle CPU",
        "killed replica's names",
        "led again: per name, median / p99",
        "all",
        "floor: all",
        "rebalanced",
    ]
    rows = [
        [
            str(i + 1),
            fmt_ms(t.all_led_s),
            fmt_ms(t.balanced_s),
            ", ".join(str(c) for c in sorted(t.sessions.values())),
            f"{t.locks_held} + {t.locks_waiting}",
            ", ".join(pct(c) for c in t.idle_cpu),
            str(t.victim_names),
            mp(t.relead),
            fmt_ms(t.relead_all_s),
            fmt_ms(t.floor_all_s),
            fmt_ms(t.rebalanced_s),
        ]
        for i, t in enumerate(trials)
    ]
    print("\n### Shared sessions, per trial\n")
    print(markdown_table(headers, rows))
    title = f"Shared, {args.names:,} names / {args.replicas} replicas:"
    return [
        [
            f"{title} server sessions per replica ≤ 3",
            f"max {max(sessions)} (every replica, every trial: {sorted(set(sessions))})",
            status(max(sessions) <= 3),
        ],
        [
            f"{title} all names led within 5 s of start (median / p99 of trials)",
            mp(led),
            status(bool(led) and p99(led) < 5),
        ],
        [
            f"{title} SIGKILL of a replica: its names led again within 1 s at p99 (aim 250 ms)",
            f"per name {mp(per_name)}; all of them {mp(alls)}; one raw session {mp(floors)}",
            status(bool(per_name) and p99(per_name) < 1),
        ],
        [
            f"{title} idle CPU per replica < 2% of one core (median / p99, replica x window)",
            mp(cpu, pct),
            status(bool(cpu) and p99(cpu) < 2),
        ],
    ]


DEDICATED_LABELS = {
    "coordinator": "Coordinator, dedicated sessions",
    "unsettled": "Coordinator, dedicated, killed before it settled",
    "leaderlock": "a LeaderLock per name",
    "raw": "raw psycopg: a session per name (floor)",
}


def report_dedicated(
    results: dict[str, list[KillTrial]], args: argparse.Namespace
) -> list[list[str]]:
    """Print the dedicated section's tables; return its row of the targets table."""
    groups = {
        "coordinator": [t for t in results["coordinator"] if not t.error and not t.unsettled],
        "unsettled": [t for t in results["coordinator"] if not t.error and t.unsettled],
        "leaderlock": [t for t in results["leaderlock"] if not t.error],
        "raw": [t for t in results["raw"] if not t.error],
    }
    per = {k: [x for t in ts for x in t.per_name] for k, ts in groups.items()}
    rows = []
    for key, ts in groups.items():
        if not ts:
            continue
        alls = [t.all_s for t in ts if t.all_s is not None]
        vs = f"{med(per[key]) / med(per['raw']):.2f}x" if per[key] and per["raw"] else "-"
        rows.append(
            [
                DEDICATED_LABELS[key],
                str(len(ts)),
                str(sorted({t.names for t in ts})),
                mp(per[key]),
                fmt_ms(max(per[key]) if per[key] else None),
                mp(alls),
                vs,
            ]
        )
    headers = [
        "variant",
        "trials",
        "names it led",
        "per name: median / p99",
        "max",
        "all of them: median / p99",
        "vs floor (median)",
    ]
    print("\n### Dedicated sessions: SIGKILL of one process\n")
    print(markdown_table(headers, rows))
    settled = groups["coordinator"]
    if settled:
        balanced = [t.settle_s for t in settled if t.settle_s is not None]
        queued = [t.queued_s for t in settled if t.queued_s is not None]
        print(
            f"\nCoordinator, dedicated: balanced {mp(balanced)} after start, every standby"
            f" queued after {mp(queued)}; sessions per replica"
            f" {sorted({s for t in settled for s in t.sessions})}"
        )
    for t in results["coordinator"]:
        if t.error or t.unsettled:
            print(f"Coordinator, dedicated: {t.error or t.unsettled}")
    done = [t for t in results["coordinator"] if not t.error]
    if done:
        evens = [t.even_s for t in done if t.even_s is not None]
        within = sum(1 for x in evens if x <= 2.0)
        print(
            f"Coordinator, dedicated: survivors even (±1) after the kill {mp(evens)}, within 2 s"
            f" in {within} of {len(done)}; counts right after the failover"
            f" {[t.after for t in done]}"
        )
    target = (
        f"Dedicated, {args.dedicated_names} names / {args.replicas} replicas: per-name"
        " failover after SIGKILL within 2x of a LeaderLock per name (median / p99)"
    )
    tried = len(results["coordinator"])
    if not results["leaderlock"]:
        return [[target, "not measured (the leaderlock variant did not run)", "-"]]
    if not per["coordinator"] or not per["leaderlock"]:
        return [[target, f"no measurement: {len(settled)} of {tried} trials settled", "MISSED"]]
    ratio = med(per["coordinator"]) / med(per["leaderlock"])
    ratio99 = p99(per["coordinator"]) / p99(per["leaderlock"])
    measured = (
        f"{mp(per['coordinator'])} vs {mp(per['leaderlock'])}: {ratio:.2f}x /"
        f" {ratio99:.2f}x; raw floor {mp(per['raw'])}"
    )
    if len(settled) < tried:
        measured += f" ({len(settled)} of {tried} trials settled)"
    return [[target, measured, status(ratio <= 2)]]


def report_balance(trials: list[BalanceTrial], args: argparse.Namespace) -> list[list[str]]:
    """Print the balance section's table; return its rows of the targets table."""
    headers = [
        "trial",
        "settled",
        "after",
        "joiner's share after",
        "settled",
        "after",
        "moves (sum of Coordinator.moves)",
        "acquisitions",
        "steady state",
    ]
    rows = [
        [
            str(i + 1),
            str(t.counts),
            fmt_ms(t.settled_s),
            fmt_ms(t.join_share_s),
            str(t.join_counts),
            fmt_ms(t.join_settled_s),
            str(t.join_moves),
            str(t.join_acquisitions),
            "-"
            if t.steady_moves is None
            else f"{t.steady_s:.0f} s: {t.steady_moves} moves, {t.steady_changes} changes",
        ]
        for i, t in enumerate(trials)
    ]
    print("\n### Balance, per trial\n")
    print(markdown_table(headers, rows))
    n, r = args.balance_names, args.replicas
    share, joined = n // r, n // (r + 1)
    settled = [t.settled_s for t in trials if t.settled_s is not None]
    even = all(max(t.counts) - min(t.counts) <= 1 and sum(t.counts) == n for t in trials)
    join = [t.join_share_s for t in trials if t.join_share_s is not None]
    moves = [t.join_moves for t in trials]
    found = sorted({c for t in trials for c in t.counts})
    out = [
        [
            f"Balance: {n} names / {r} replicas settle on {share} ± 1",
            f"{found} in every trial, after {mp(settled)}",
            status(even),
        ],
        [
            f"Balance: a joining replica reaches its share ({joined}) within 10 s",
            mp(join),
            status(bool(join) and max(join) < 10),
        ],
        [
            f"Balance: moves for the join ≤ share + 2 ({joined + 2})",
            f"{moves} (acquisitions seen: {[t.join_acquisitions for t in trials]})",
            status(bool(moves) and max(moves) <= joined + 2),
        ],
    ]
    for t in trials:
        if t.steady_moves is not None:
            out.append(
                [
                    f"Balance: {t.steady_s:.0f} s at steady state: 0 moves",
                    f"{t.steady_moves} moves, {t.steady_changes} leadership changes",
                    status(t.steady_moves == 0 and t.steady_changes == 0),
                ]
            )
    return out


def report(results: dict[str, Any], args: argparse.Namespace) -> None:
    """Print every section's tables, then the targets."""
    rows: list[list[str]] = []
    shared = [t for t in results.get("shared", []) if not t.error]
    if shared:
        rows += report_shared(shared, args)
    if results.get("dedicated"):
        rows += report_dedicated(results["dedicated"], args)
    balance = [t for t in results.get("balance", []) if not t.error]
    if balance:
        rows += report_balance(balance, args)
    capacity = results.get("capacity")
    if capacity:
        print("\n### Lock table\n")
        print(
            f"max_connections={capacity['max_connections']}, max_locks_per_transaction="
            f"{capacity['max_locks_per_transaction']}: one session took {capacity['capacity']:,}"
            " advisory locks before 'out of shared memory' (the nominal size,"
            " max_locks_per_transaction x (max_connections + autovacuum_max_workers + 1 +"
            " max_worker_processes + max_wal_senders + max_prepared_transactions), is"
            f" {capacity['nominal']:,})"
        )
    if rows:
        print("\n### Targets\n")
        print(markdown_table(["Target", "Measured", "Status"], rows))
