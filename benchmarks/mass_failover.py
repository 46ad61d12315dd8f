"""Mass failover: N leaders killed at once, N followers of the same names take over.

One *leaders* process holds N locks (distinct names); a *followers* process holds N
followers of the same names, each queued on the server. Once every follower is queued
(``pg_locks`` shows N waiting advisory locks of the followers' backends) and a random
``--settle`` .. ``--settle + --jitter`` seconds have passed, the parent takes
``time.monotonic()`` and SIGKILLs the leaders process. The kernel closes its N
connections, the server ends their backends, each backend frees its lock and the server
grants it to the queued follower. The followers process stamps each name's new
leadership with its own ``time.monotonic()`` (one machine, one clock): ``on_acquired``
for the library, the return of ``pg_advisory_lock`` for the raw sessions.

Per trial: the time until all N names are led again, and per name the median and the
p99 of kill -> led; also the CPU the followers process and the server spent from the kill
until the last name was led (utime + stime; the server's from ``/proc``, as in
``idle_scale.py``). Per variant and N: the median over trials of each.

Variants (the same as ``idle_scale.py``, whose worker processes this script runs):
``--variant LABEL=SRC`` (the library in the checkout SRC, ``LeaderLock`` defaults,
``follower_mode="wait"``), ``--variant raw`` (raw driver sessions: leaders
``pg_try_advisory_lock`` and idle; followers queued in ``pg_advisory_lock``, each socket
watched by the event loop, so the client does nothing until its grant arrives: the
blocking-waiter floor), ``--variant current`` (the default: the library this process
imports, e.g. through ``PYTHONPATH``). Trials run interleaved: for each N, round after
round, every variant once per round in a shuffled order.

Usage::

    python benchmarks/mass_failover.py                               # N = 100, 1000; 5 trials
    python benchmarks/mass_failover.py --variant current --variant raw --n 1000 --trials 9
    python benchmarks/mass_failover.py --variant before=/work/before/src --variant after=src \\
        --variant raw

Without ``--dsn`` a throwaway cluster is started (``max_connections`` raised) and removed
afterwards. Every wait is bounded, and every process started here is killed on every exit
path.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import random
import statistics
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from _common import (
    database,
    describe_machine,
    fmt_ms,
    interrupt_on_signals,
    machine_info,
    markdown_table,
    server_info,
)
from idle_scale import Server, Variant, Worker, cpu_split, kill_all_workers


def percentile(values: Sequence[float], q: float) -> float:
    """Nearest-rank percentile ``q`` (0..100) of ``values``."""
    ordered = sorted(values)
    if not ordered:
        return math.nan
    return ordered[max(0, math.ceil(q / 100 * len(ordered)) - 1)]


def trial(
    dsn: str, server: Server, variant: Variant, n: int, args: argparse.Namespace, log_dir: Path
) -> dict[str, Any]:
    """One kill of N leaders; the followers' acquisition times."""
    prefix = f"m{n}-{variant.label}-{random.randrange(10**6)}"
    common = {"dsn": dsn, "n": n, "prefix": prefix, "backend": args.backend, "log_dir": log_dir}
    server.wait_idle()
    leaders = Worker("leaders", variant, **common)
    followers: Worker | None = None
    try:
        ready = leaders.expect("ready", 240)
        if ready["leading"] < n:
            raise RuntimeError(f"only {ready['leading']} of {n} leaders; see {leaders.log_path}")
        followers = Worker("followers", variant, announce=True, **common)
        pids = followers.expect("ready", 240)["pids"]
        deadline = time.monotonic() + 60
        while server.waiting(pids) < n and time.monotonic() < deadline:
            time.sleep(0.1)
        time.sleep(args.settle + random.uniform(0, args.jitter))
        # A follower whose wait just timed out is between two waits for a moment; the
        # kill comes when all N are queued (or after 15 s more, whatever is queued).
        deadline = time.monotonic() + 15
        while (queued := server.waiting(pids)) < n and time.monotonic() < deadline:
            time.sleep(0.05)
        server0, client0 = server.processes(), followers.cpu_s()
        killed_at = time.monotonic()
        leaders.kill()
        complete = True
        try:
            times = followers.expect("all_acquired", args.timeout)["times"]
        except TimeoutError:
            complete = False
            times = followers.ask("times", "times")["times"]
        client_cpu_s = followers.cpu_s() - client0
        server_cpu = cpu_split(server0, server.processes(), {"followers": set(pids)})[0]
    finally:
        if followers is not None:
            followers.kill()
            followers.close()
        leaders.kill()
        leaders.close()
    latencies = sorted(t - killed_at for t in times)
    return {
        "variant": variant.label,
        "n": n,
        "queued_at_kill": queued,
        "complete": complete,
        "led": len(latencies),
        "all_s": latencies[-1] if complete and latencies else math.nan,
        "first_s": latencies[0] if latencies else math.nan,
        "median_s": statistics.median(latencies) if latencies else math.nan,
        "p99_s": percentile(latencies, 99),
        "followers_cpu_s": client_cpu_s,
        "server_cpu_s": sum(server_cpu.values()),
        "server_cpu_split_s": server_cpu,
    }


def summary_rows(results: Sequence[dict[str, Any]], variants: Sequence[Variant]) -> list[list[str]]:
    """One row per (N, variant): medians over trials, and the ratio to the raw floor."""
    rows = []
    for n in sorted({r["n"] for r in results}):
        floor = [r["all_s"] for r in results if r["n"] == n and r["variant"] == "raw"]
        floor_median = statistics.median(floor) if floor else math.nan
        for variant in variants:
            mine = [r for r in results if r["n"] == n and r["variant"] == variant.label]
            if not mine:
                continue
            alls = [r["all_s"] for r in mine]
            med = statistics.median(alls)
            ratio = f"{med / floor_median:.2f}x" if floor and variant.label != "raw" else ""
            rows.append(
                [
                    f"{n:,}",
                    f"{variant.label} ({variant.revision})",
                    f"{sum(r['complete'] for r in mine)}/{len(mine)}",
                    fmt_ms(med),
                    f"{fmt_ms(min(alls))} .. {fmt_ms(max(alls))}",
                    ratio,
                    fmt_ms(statistics.median(r["first_s"] for r in mine)),
                    fmt_ms(statistics.median(r["median_s"] for r in mine)),
                    fmt_ms(statistics.median(r["p99_s"] for r in mine)),
                    f"{statistics.median(r['followers_cpu_s'] for r in mine):.2f} s",
                    f"{statistics.median(r['server_cpu_s'] for r in mine):.2f} s ("
                    + ", ".join(
                        f"{statistics.median(r['server_cpu_split_s'][k] for r in mine):.2f}"
                        for k in ("ended", "followers", "rest")
                    )
                    + ")",
                ]
            )
    return rows


HEADERS = [
    "N",
    "followers",
    "complete",
    "all N led again (median)",
    "min .. max",
    "vs raw",
    "first name led",
    "per name: median",
    "per name: p99",
    "followers' CPU",
    "server CPU (leaders' backends, followers' backends, rest)",
]


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    """The command line."""
    parser = argparse.ArgumentParser(
        prog="python benchmarks/mass_failover.py",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--dsn", help="server to use (default: a throwaway cluster)")
    parser.add_argument("--n", type=int, action="append", help="locks (repeatable; 100, 1000)")
    parser.add_argument("--trials", type=int, default=5, help="kills per variant and N (5)")
    parser.add_argument(
        "--variant",
        type=Variant.parse,
        action="append",
        help="LABEL=SRC, raw or current (repeatable; default: current and raw)",
    )
    parser.add_argument("--backend", choices=("psycopg", "asyncpg"), default="psycopg")
    parser.add_argument("--settle", type=float, default=1.0, help="seconds queued before the kill")
    parser.add_argument("--jitter", type=float, default=1.0, help="plus up to this, at random")
    parser.add_argument("--timeout", type=float, default=60.0, help="wait for all N at most (60)")
    parser.add_argument("--max-connections", type=int, default=2500, help="throwaway cluster")
    parser.add_argument("--log-dir", type=Path, help="worker logs (default: a temp dir)")
    parser.add_argument("--json", type=Path, help="also write every trial here")
    args = parser.parse_args(argv)
    args.n = args.n or [100, 1000]
    args.variant = args.variant or [Variant.parse("current"), Variant.parse("raw")]
    return args


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark."""
    args = parse_args(argv)
    interrupt_on_signals()
    started = time.monotonic()
    log_dir = args.log_dir or Path(tempfile.mkdtemp(prefix="mass-failover-"))
    log_dir.mkdir(parents=True, exist_ok=True)
    results: list[dict[str, Any]] = []
    max_connections = max(args.max_connections, 2 * max(args.n) + 100)
    try:
        with database(args.dsn, max_connections=max_connections) as dsn:
            info = {**machine_info(), **server_info(dsn)}
            print(describe_machine(info))
            print(f"Worker logs: {log_dir}; driver: {args.backend}")
            for variant in args.variant:
                print(f"Variant {variant.label}: {variant.revision} ({variant.src or 'inherited'})")
            server = Server(dsn)
            try:
                for n in args.n:
                    for number in range(args.trials):
                        for variant in random.sample(args.variant, len(args.variant)):
                            r = trial(dsn, server, variant, n, args, log_dir)
                            results.append(r)
                            print(
                                f"  N={n} trial {number + 1} {variant.label}: all led after "
                                f"{fmt_ms(r['all_s'])} ({r['led']}/{n}; per name median "
                                f"{fmt_ms(r['median_s'])}, p99 {fmt_ms(r['p99_s'])}; "
                                f"{r['queued_at_kill']} queued at the kill)",
                                flush=True,
                            )
            finally:
                server.close()
    except KeyboardInterrupt:
        print("\nInterrupted.")
        return 130
    finally:
        kill_all_workers()
    print(f"\n### Mass failover: N leaders SIGKILLed at once ({args.backend})\n")
    print(markdown_table(HEADERS, summary_rows(results, args.variant)))
    print(f"\nTotal time {time.monotonic() - started:.0f} s")
    if args.json:
        payload = {"machine": info, "trials": results}
        args.json.write_text(json.dumps(payload, indent=2, default=str))
        print(f"Wrote {args.json}")
    return 0


if __name__ == "__main__":
    with contextlib.suppress(BrokenPipeError):
        sys.exit(main())
