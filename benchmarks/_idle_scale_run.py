"""``idle_scale.py``'s measurements: the start-up of N leaders and N followers, and a
configuration's idle windows, each variant in turn, then their tables.
"""

from __future__ import annotations

import os
import random
import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from _common import markdown_table
from _idle_scale_fleets import HEALTH_INTERVAL_S
from _idle_scale_parent import Variant, Worker, neighbours
from _idle_scale_server import Server, Snapshot, _probe_stats, cpu_split


@dataclass
class Config:
    """One measurement: a variant, N, the backend."""

    variant: Variant
    n: int
    backend: str
    minutes: float
    settle_s: float
    neighbours: int
    followers_connect_fn: bool = False
    results: dict[str, Any] = field(default_factory=dict)


def _progress(text: str) -> None:
    print(f"  [{time.strftime('%H:%M:%S')}] {text}", flush=True)


def run_startup(
    dsn: str, server: Server, variant: Variant, n: int, backend: str, log_dir: Path
) -> dict[str, Any]:
    """Start N leaders (nothing else), stop them: how long, at what CPU."""
    prefix = f"s{n}-{variant.label}-{random.randrange(10**6)}"
    server.wait_idle()
    time.sleep(1.0)
    server0 = server.processes()
    leaders = Worker("leaders", variant, dsn=dsn, n=n, prefix=prefix, backend=backend,
                     log_dir=log_dir)  # fmt: skip
    try:
        ready = leaders.expect("ready", 240)
        server_cpu, _, _ = cpu_split(server0, server.processes(), {})
        shutdown_s = leaders.stop()
    finally:
        leaders.close()
    return {
        "variant": variant.label,
        "revision": variant.revision,
        "backend": backend,
        "n": n,
        "leading": ready["leading"],
        "seconds": ready["startup_s"],
        "client_cpu_s": ready["startup_cpu_s"],
        "server_cpu_s": sum(server_cpu.values()),
        "shutdown_s": shutdown_s,
    }


def print_startup(results: Sequence[dict[str, Any]], variants: Sequence[Variant]) -> None:
    """Medians over the start-up trials."""
    rows = []
    for n in sorted({r["n"] for r in results}):
        for variant in variants:
            mine = [r for r in results if r["n"] == n and r["variant"] == variant.label]
            if not mine:
                continue

            def med(key: str, mine: list[dict[str, Any]] = mine) -> str:
                return f"{statistics.median(float(r[key] or 0) for r in mine):.2f} s"

            rows.append(
                [
                    f"{variant.label} ({variant.revision})",
                    f"{n:,}",
                    str(len(mine)),
                    f"{min(r['leading'] for r in mine):,}",
                    med("seconds"),
                    f"{min(r['seconds'] for r in mine):.2f} .. "
                    f"{max(r['seconds'] for r in mine):.2f} s",
                    med("client_cpu_s"),
                    med("server_cpu_s"),
                    med("shutdown_s"),
                ]
            )
    headers = ["library", "N", "trials", "led (min)", "all lead after (median)", "min .. max",
               "client CPU", "server CPU", "shutdown"]  # fmt: skip
    print("\n### Start-up of N leaders (nothing else running in the benchmark; medians)\n")
    print(markdown_table(headers, rows))


def run_config(dsn: str, server: Server, config: Config, log_dir: Path) -> dict[str, Any]:
    """Start the fleets, measure the window, stop them."""
    variant, n = config.variant, config.n
    prefix = f"i{n}-{variant.label}-{random.randrange(10**6)}"
    common = {"dsn": dsn, "n": n, "prefix": prefix, "backend": config.backend, "log_dir": log_dir}
    server.wait_idle()
    result: dict[str, Any] = {
        "variant": variant.label,
        "revision": variant.revision,
        "backend": config.backend,
        "n": n,
        "minutes": config.minutes,
        "neighbours": config.neighbours,
        "followers_connect_fn": config.followers_connect_fn,
    }
    print(f"\n## {variant.label} ({variant.revision}), {config.backend}, N = {n}", flush=True)
    server0 = server.processes()
    leaders = Worker("leaders", variant, **common)
    followers: Worker | None = None
    try:
        ready = leaders.expect("ready", 240)
        server1 = server.processes()
        startup_server, _, _ = cpu_split(server0, server1, {})
        result["startup"] = {
            "leading": ready["leading"],
            "seconds": ready["startup_s"],
            "client_cpu_s": ready["startup_cpu_s"],
            "server_cpu_s": sum(startup_server.values()),
        }
        _progress(
            f"leaders: {ready['leading']}/{n} lead after {ready['startup_s']:.2f} s "
            f"(client CPU {ready['startup_cpu_s']:.2f} s, server CPU "
            f"{sum(startup_server.values()):.2f} s)"
        )
        followers = Worker("followers", variant, connect_fn=config.followers_connect_fn, **common)
        fready = followers.expect("ready", 240)
        deadline = time.monotonic() + 60
        while server.waiting(fready["pids"]) < n and time.monotonic() < deadline:
            time.sleep(0.2)
        _progress(
            f"followers: {server.waiting(fready['pids'])}/{n} queued on the server after "
            f"{fready['startup_s']:.2f} s; settling {config.settle_s:g} s"
        )
        time.sleep(config.settle_s)
        window_s = config.minutes * 60
        with neighbours(config.neighbours, window_s + 120):
            time.sleep(1.0 if config.neighbours else 0)  # the busy loops are running
            a = Snapshot.take(server, leaders, followers)
            end = a.at + window_s
            while (remaining := end - time.monotonic()) > 0:
                time.sleep(min(60.0, remaining))
                if end - time.monotonic() > 1:
                    r = leaders.ask("report", "report")
                    late = r["events"].get("probe_late", 0)
                    _progress(
                        f"{time.monotonic() - a.at:.0f} s: {r['leading']}/{n} lead; "
                        f"on_lost {r['lost']}, demotions {r['demotions']}, late probes {late}"
                    )
            b = Snapshot.take(server, leaders, followers)
        result.update(measure(a, b, n))
        result["shutdown_s"] = {"followers": followers.stop(), "leaders": leaders.stop()}
    finally:
        if followers is not None:
            followers.close()
        leaders.close()
    return result


def _events_delta(a: dict[str, Any], b: dict[str, Any]) -> dict[str, int]:
    events0, events1 = a.get("events", {}), b.get("events", {})
    return {k: v - events0.get(k, 0) for k, v in events1.items() if v - events0.get(k, 0)}


def measure(a: Snapshot, b: Snapshot, n: int) -> dict[str, Any]:
    """The window's figures from its two snapshots."""
    window = b.at - a.at
    groups = {
        "leaders": set(a.leaders["pids"]) | set(b.leaders["pids"]),
        "followers": set(a.followers["pids"]) | set(b.followers["pids"]),
    }
    server_cpu, ended, started = cpu_split(a.server, b.server, groups)
    probes = _probe_stats(a.statements, b.statements)
    busy = (b.machine[0] - a.machine[0]) / max(1, b.machine[1] - a.machine[1])
    return {
        "window_s": window,
        "leading": [a.leaders["leading"], b.leaders["leading"]],
        "lost": b.leaders["lost"] - a.leaders["lost"],
        "demotions": b.leaders["demotions"] - a.leaders["demotions"],
        "followers_acquired": b.followers["acquired"] - a.followers["acquired"],
        "leader_events": _events_delta(a.leaders, b.leaders),
        "follower_events": _events_delta(a.followers, b.followers),
        "leader_errors": b.leaders["errors"],
        "probes": probes,
        "probes_client": b.leaders.get("probes", 0) - a.leaders.get("probes", 0),
        "probes_expected": n * window / HEALTH_INTERVAL_S,
        "server_cpu_s": server_cpu,
        "server_processes_ended": ended,
        "server_processes_started": started,
        "client_cpu_s": {
            "leaders": b.leaders_cpu_s - a.leaders_cpu_s,
            "followers": b.followers_cpu_s - a.followers_cpu_s,
        },
        "machine_busy": busy * (os.cpu_count() or 1),
        "loadavg": [a.loadavg, b.loadavg],
    }


def pct(seconds: float, window: float) -> str:
    """CPU seconds over a window, as a percentage of one core."""
    return f"{seconds / window * 100:.2f}%"


def print_tables(results: Sequence[dict[str, Any]]) -> None:
    """The loss/CPU table and the start-up table."""
    rows = []
    for r in results:
        w = r["window_s"]
        probes = r["probes"]
        counted = sum(int(p["calls"]) for p in probes.values())
        kinds = ", ".join(f"{k} {int(p['calls'])}" for k, p in sorted(probes.items()) if p["calls"])
        client = r.get("probes_client", 0)
        if client > 2 * counted:  # a bare Sync runs no statement: the client counts
            kinds = ", ".join(filter(None, [kinds, f"Sync {client - counted}"]))
            counted = client
        exec_ms = sum(p["exec_ms"] for p in probes.values())
        events = r["leader_events"]
        via = ", followers via connect_fn" if r.get("followers_connect_fn") else ""
        rows.append(
            [
                f"{r['variant']} ({r['revision']}{via})",
                r["backend"],
                f"{r['n']:,}",
                f"{w / 60:.3g} min" + (f" + {r['neighbours']} busy" if r["neighbours"] else ""),
                f"{r['lost']}",
                f"{r['demotions']}",
                f"{r['followers_acquired']}",
                f"{events.get('probe_late', 0)} / {events.get('leadership_recovered', 0)}",
                f"{counted:,} of {r['probes_expected']:,.0f}" + (f" ({kinds})" if kinds else ""),
                pct(r["server_cpu_s"]["leaders"], w),
                pct(exec_ms / 1000, w),
                pct(r["server_cpu_s"]["followers"], w),
                pct(r["server_cpu_s"]["rest"] + r["server_cpu_s"].get("ended", 0.0), w),
                pct(r["client_cpu_s"]["leaders"], w),
                pct(r["client_cpu_s"]["followers"], w),
                f"{r['machine_busy']:.2f} cores",
            ]
        )
    headers = [
        "library",
        "driver",
        "N",
        "window",
        "on_lost",
        "left LEADER",
        "followers granted",
        "late probes / recovered",
        "probes answered",
        "server: leaders' backends",
        "probe exec time",
        "server: followers' backends",
        "server: rest",
        "client: leaders",
        "client: followers",
        "machine busy",
    ]
    print("\n### Idle at scale (CPU in % of one core over the window)\n")
    print(markdown_table(headers, rows))
    rows = [
        [
            f"{r['variant']} ({r['revision']})",
            r["backend"],
            f"{r['n']:,}",
            f"{r['startup']['leading']:,}",
            f"{r['startup']['seconds']:.2f} s",
            f"{r['startup']['client_cpu_s']:.2f} s",
            f"{r['startup']['server_cpu_s']:.2f} s",
            f"{(r.get('shutdown_s') or {}).get('leaders') or float('nan'):.2f} s",
        ]
        for r in results
    ]
    headers = ["library", "driver", "N", "led", "all lead after", "client CPU", "server CPU",
               "shutdown"]  # fmt: skip
    print("\n### Start-up of the leaders\n")
    print(markdown_table(headers, rows))
