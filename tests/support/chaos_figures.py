"""The chaos soak's figures (``chaos_check.check`` adds them to its report): the faults,
the time without a leader after each fault that hit the lock's leader, and how long a
SIGKILLed replica's names took to be led again, by what else was going on
(``RELED_CASES``)."""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Sequence

from pgleaderlock.testing.beliefs import BeliefInterval
from support.chaos_context import Context
from support.chaos_data import Span, intersect, measure, norm, subtract

RECOVERY_S = 10.0
"""A SIGKILL this soon after the server came back, or after a frozen replica ran again
(or with a restart or a freeze before its names were led again), overlaps that fault:
every session of every replica, or of the thawed one, was reconnecting."""


def figures(ctx: Context) -> None:
    tl, report = ctx.tl, ctx.report
    report.faults = Counter(str(e["kind"]) for e in tl.faults)
    report.rows = Counter(r.kind for r in ctx.data.rows)
    for e in tl.events:
        if e["e"] == "log":
            report.logged[f"{e['level']}:{e['event']}"] += 1
    for events in tl.by_cand.values():
        last = [e for e in events if e["e"] in ("hb", "exit")]
        for key, n in (last[-1]["counts"] if last else {}).items():
            role, _, what = str(key).rpartition(".")
            report.work[f"{role.split(':')[0]}.{what}"] += n
    leaderless(ctx)
    reled(ctx)


def leaderless(ctx: Context) -> None:
    """For each fault that hit the lock's leader: the time without a leader from the
    fault to the next leadership (frozen believers and a down server lead nothing)."""
    tl = ctx.tl
    believed = {c: ctx.spans(ctx.lock, c) for c in tl.cands}
    led = subtract(
        norm(s for c in tl.cands for s in subtract(believed[c], tl.frozen_spans(c))),
        norm(tl.server_down),
    )
    starts = sorted(i.start for i in ctx.lock.intervals())
    for f in tl.faults:
        m, kind = float(f["m"]), str(f["kind"])
        hit = f["targets"] if kind != "terminate" or f["role"] == "lock" else []
        if not any(leads_at(believed[c], m) and not frozen_before(tl.frozen_spans(c), m)
                   for c in hit):  # fmt: skip
            ctx.report.missed_leader[kind] += 1
            continue
        nxt = next((s for s in starts if s > m), tl.end)
        ctx.report.leaderless[kind].append(measure(subtract([(m, nxt)], led)))


def leads_at(spans: Sequence[Span], m: float) -> bool:
    return any(a <= m <= b for a, b in spans)


def frozen_before(spans: Sequence[Span], m: float) -> bool:
    """Frozen already when ``m`` came (a freeze that begins at ``m`` is the fault's)."""
    return any(a < m <= b for a, b in spans)


def reled(ctx: Context) -> None:
    """After each SIGKILL: for each name the killed replica ran, the time until another
    replica's worker of that name began; also by case (``RELED_CASES``)."""
    ready = {e["c"]: float(e["m"]) for e in ctx.tl.events if e["e"] == "ready"}
    for f in ctx.tl.faults:
        if f["kind"] not in ("kill", "kill2"):
            continue
        m = float(f["m"])
        for log in ctx.names.values():
            intervals: list[BeliefInterval] = log.intervals()
            if not any(i.candidate in f["targets"] and i.start < m <= i.end_or(math.inf)
                       for i in intervals):  # fmt: skip
                continue
            nxt = [i.start for i in intervals if i.start > m]
            if nxt:
                took = min(nxt) - m
                ctx.report.releds.append(took)
                ctx.report.releds_by[reled_case(ctx, f, (m, m + took), ready)].append(took)
            else:
                ctx.report.never_reled += 1


def reled_case(ctx: Context, fault: dict[str, object], span: Span, ready: dict[str, float]) -> str:
    """Which of ``RELED_CASES`` a re-lead over ``span`` after ``fault`` falls in."""
    tl, (m, end) = ctx.tl, span
    others = [c for c in tl.cands if c not in fault["targets"]]  # type: ignore[operator]
    running = [
        c for c in others
        if ready.get(c, math.inf) <= m < tl.died.get(c, math.inf)
        and not leads_at(tl.frozen_spans(c, stalls=False), m)
    ]  # fmt: skip
    if not running:
        return "nobody"
    near = [(m - RECOVERY_S, end)]
    if intersect(near, tl.server_down):
        return "restart"
    if any(intersect(near, tl.frozen_spans(c, stalls=False)) for c in others):
        return "frozen"
    return "alone"
