"""The report of ``failover.py``: per scenario and implementation, the median, p95 and
max of each measure and its ratio to the raw blocking waiter of the same run, then a
summary of the medians.
"""

from __future__ import annotations

import argparse
from dataclasses import asdict
from typing import Any

from _common import fmt_ms, markdown_table, summarize
from _failover_experiment import Experiment
from _failover_impls import FLOOR, IMPLS


def _stat_cells(values: list[float], floor: float | None) -> list[str]:
    s = summarize(values)
    ratio = f"{s.median / floor:.2f}x" if floor and values else "-"
    return [fmt_ms(s.median), fmt_ms(s.p95), fmt_ms(s.max), ratio]


def report(results: dict[tuple[str, str], Experiment], args: argparse.Namespace) -> dict[str, Any]:
    """Print one table per scenario and a summary; return the figures for ``--json``."""
    figures: dict[str, Any] = {}
    medians: dict[tuple[str, str, str], float] = {}
    for scenario in args.scenario:
        exps = [results[(k, scenario)] for k in args.impl if (k, scenario) in results]
        floor_exp = results.get((FLOOR, scenario))
        floor_fail = floor_det = None
        if floor_exp is not None:
            fl = [t.failover_s for t in floor_exp.trials if t.failover_s is not None]
            fd = [t.detection_s for t in floor_exp.trials if t.detection_s is not None]
            floor_fail = summarize(fl).median if fl else None
            floor_det = summarize(fd).median if fd else None
        headers = ["implementation", "trials", "new leader: median", "p95", "max", "vs floor"]
        if scenario == "terminate":
            headers += ["detection: median", "p95", "max", "vs floor", "double leader: median/max"]
            headers += ["old leader took it back"]
        if scenario == "graceful":
            headers += ["old leader released after (median)"]
        rows = []
        for exp in exps:
            trials = exp.trials
            fail = [t.failover_s for t in trials if t.failover_s is not None]
            timeouts = len(trials) - len(fail)
            row: list[str] = [exp.impl.label, str(len(trials))]
            row += _stat_cells(fail, floor_fail)
            if timeouts:
                row[2] += f" ({timeouts} > {args.failover_timeout:g} s)"
            entry: dict[str, Any] = {
                "trials": [asdict(t) for t in trials],
                "failover": summarize(fail).as_dict(),
                "error": exp.error,
            }
            if fail:
                medians[(exp.impl.key, scenario, "failover")] = summarize(fail).median
            if scenario == "terminate":
                det = [t.detection_s for t in trials if t.detection_s is not None]
                never = len(trials) - len(det)
                if det:
                    row += _stat_cells(det, floor_det)
                    if never:
                        row[6] += f" ({never} never)"
                    medians[(exp.impl.key, scenario, "detection")] = summarize(det).median
                else:
                    row += [f"never (> {args.detect_timeout:g} s)", "-", "-", "-"]
                over = [t.overlap_s or 0.0 for t in trials if not t.overlap_unbounded]
                unbounded = [t.overlap_s or 0.0 for t in trials if t.overlap_unbounded]
                if unbounded:
                    row.append(f"> {fmt_ms(min(unbounded))} (until killed)")
                else:
                    s = summarize(over)
                    row.append(f"{fmt_ms(s.median)} / {fmt_ms(s.max)}")
                    medians[(exp.impl.key, scenario, "overlap")] = s.max
                row.append(f"{sum(t.new_is_old for t in trials)}/{len(trials)}")
                entry["detection"] = summarize(det).as_dict()
                entry["never_detected"] = never
            if scenario == "graceful":
                rel = [t.released_s for t in trials if t.released_s is not None]
                row.append(fmt_ms(summarize(rel).median) if rel else "-")
            if exp.error:
                row[0] += " (stopped early)"
            rows.append(row)
            figures[f"{exp.impl.key}/{scenario}"] = entry
        title = {
            "crash": "Crash: SIGKILL of the leader process",
            "graceful": "Graceful: SIGTERM, the leader releases and exits",
            "terminate": "Terminated backend: pg_terminate_backend() of the leader's session",
        }[scenario]
        print(f"\n### {title}\n")
        print(markdown_table(headers, rows))
    _print_summary(medians, args)
    return figures


def _print_summary(medians: dict[tuple[str, str, str], float], args: argparse.Namespace) -> None:
    columns = [
        ("crash", "failover", "crash"),
        ("graceful", "failover", "graceful"),
        ("terminate", "failover", "terminated: new leader"),
        ("terminate", "detection", "terminated: old leader notices"),
    ]
    columns = [c for c in columns if c[0] in args.scenario]
    rows = []
    for key in args.impl:
        row = [IMPLS[key].label]
        for scenario, metric, _ in columns:
            value = medians.get((key, scenario, metric))
            floor = medians.get((FLOOR, scenario, metric))
            if value is None:
                row.append("never" if metric == "detection" else "-")
            elif floor and key != FLOOR:
                row.append(f"{fmt_ms(value)} ({value / floor:.1f}x)")
            else:
                row.append(fmt_ms(value))
        rows.append(row)
    print("\n### Summary: medians (and ratio to the raw blocking waiter of the same run)\n")
    print(markdown_table(["implementation", *(c[2] for c in columns)], rows))
