"""The chaos soak's invariants, checked over its record (``chaos_data.SoakData``).

``check(data)`` runs every check of ``CHECKS`` (``skip=`` leaves some out: the tests
show that each planted violation is found by its own check) and returns a ``Report``:
its findings by kind, and the figures (faults, leaderless time per fault, names re-led
after a SIGKILL, slots).

Safety (``SAFETY``): a fenced row committed under a term after the next term of its
keys had committed (``stale_row``); a unit of work begun under one term that committed
under another (``term_crossed``); two replicas believing they lead the lock at once
with no termination or freeze to explain it (``two_leaders``), more than ``sem_slots``
believing they hold a slot (``sem_excess``), two running one name's worker
(``name_two_leaders``); a slot of the Scheduler applied twice (``slot_duplicated``) or
never (``slot_missing``, for slots due ``catch_up_s`` before the end); a name's
checkpoint positions not 1, 2, 3, ... each once (``checkpoint``).

Availability (``AVAILABILITY``): a replica still believing it holds the lock or a slot
while ``pg_locks`` says it does not, or still running a name's worker after another
began (the termination or freeze that explains it notwithstanding), for longer than the
bound (``late_loss``); a session granted the lock whose replica does not lead
(``granted_silent``); a lock in RELEASING or RECONNECTING with the server up, a task
that outlived its cancellation, a replica that did not exit after SIGTERM
(``stuck_state``); an event loop that did not tick (``blocked_loop``); a name led by
nobody (``name_unled``); a lock, a semaphore, a coordinator or a leader task that
stopped while nothing asked it to (``stopped_loop``); a replica that exited by itself or
not cleanly (``unexpected_exit``); a session of no live replica, or one too many
(``leaked_session``). Bounds: ``chaos_data.Bounds``.
"""

from __future__ import annotations

import math
import statistics
from collections import Counter, defaultdict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from functools import cached_property

from pgleaderlock.testing.beliefs import BeliefInterval, BeliefLog, Overlap
from support.chaos_data import (
    SoakData,
    Span,
    Timeline,
    intersect,
    measure,
    norm,
    slot_epoch,
    subtract,
)

__all__ = ["AVAILABILITY", "CHECKS", "SAFETY", "Finding", "Report", "check"]

SAFETY = (
    "stale_row", "term_crossed", "two_leaders", "sem_excess", "name_two_leaders",
    "slot_duplicated", "slot_missing", "checkpoint",
)  # fmt: skip
AVAILABILITY = (
    "late_loss", "granted_silent", "stuck_state", "blocked_loop", "name_unled",
    "stopped_loop", "unexpected_exit", "leaked_session",
)  # fmt: skip
STUCK_STATES = ("releasing", "reconnecting")
STOPPING_LOGS = ("coordinator_failed", "leader_task_gave_up")
RECOVERY_S = 10.0
"""A SIGKILL this soon after the server came back, or after a frozen replica ran again
(or with a restart or a freeze before its names were led again), overlaps that fault:
every session of every replica, or of the thawed one, was reconnecting."""
RELED_CASES = {
    "alone": "the kill alone",
    "frozen": "a replica frozen (or thawed) near",
    "restart": "a server restart near",
    "nobody": "no other replica running",
}
"""What else was going on when a SIGKILLed replica's names were led again, the first
that applies from the last: no other replica was running its Coordinator (the others
were starting, frozen, or killed with it: the names wait for a process to start or
thaw), a server restart overlapped (``RECOVERY_S``), a replica was frozen or had just
thawed (a standby granted the name while SIGSTOPped holds it for the claim bound; a
thawed one reconnects), or nothing (the kill alone)."""
SINGLE_ROLES = (
    "lock", "sem", "lockwork", "semwork", "coord:util", "coord:listen", "coord:watch",
    "coord:hold",
)  # fmt: skip


@dataclass(frozen=True)
class Finding:
    kind: str
    at: float | None
    """Seconds since the faults began (None: not a moment)."""
    what: str

    def __str__(self) -> str:
        at = "" if self.at is None else f"at {self.at:.1f} s: "
        return f"{self.kind}: {at}{self.what}"


@dataclass
class Report:
    findings: list[Finding] = field(default_factory=list)
    faults: Counter[str] = field(default_factory=Counter)
    leaderless: dict[str, list[float]] = field(default_factory=lambda: defaultdict(list))
    """Per fault kind, for each fault that hit the lock's leader: seconds without one."""
    missed_leader: Counter[str] = field(default_factory=Counter)
    """Per fault kind: faults that did not hit the lock's leader."""
    releds: list[float] = field(default_factory=list)
    """After each SIGKILL, for each name the killed replica ran: seconds to a new one."""
    releds_by: dict[str, list[float]] = field(default_factory=lambda: defaultdict(list))
    """The same, by what else was going on (``RELED_CASES``)."""
    never_reled: int = 0
    slots: dict[str, int] = field(default_factory=dict)
    rows: Counter[str] = field(default_factory=Counter)
    work: Counter[str] = field(default_factory=Counter)
    """The replicas' counters: commits and errors of each kind of work."""
    logged: Counter[str] = field(default_factory=Counter)
    duration_s: float = 0.0

    def counts(self) -> Counter[str]:
        return Counter(f.kind for f in self.findings)

    def of(self, *kinds: str) -> list[Finding]:
        return [f for f in self.findings if f.kind in kinds]

    def format(self) -> str:
        counts = self.counts()
        lines = [
            f"{self.duration_s:.0f} s, {sum(self.faults.values())} faults: "
            + ", ".join(f"{k} {n}" for k, n in sorted(self.faults.items())),
            "",
            table(
                ["finding", "class", "count"],
                [
                    [k, "safety" if k in SAFETY else "availability", counts[k]]
                    for k in (*SAFETY, *AVAILABILITY)
                ],
            ),
            "",
            table(
                ["fault", "hit the leader", "leaderless: median", "p95", "max"],
                [
                    [k, f"{len(v)} of {len(v) + self.missed_leader[k]}", *summary(v)]
                    for k, v in sorted(self.leaderless.items())
                ],
            ),
            "",
            table(
                ["names re-led after a SIGKILL", "n", "p50", "p95", "max", "never"],
                [
                    ["all", len(self.releds), *summary(self.releds), self.never_reled],
                    *(
                        [RELED_CASES[case], len(v), *summary(v), ""]
                        for case in RELED_CASES
                        if (v := self.releds_by.get(case))
                    ),
                ],
            ),
            "",
            table(["slots", *self.slots], [["", *self.slots.values()]]),
            "",
            "rows committed: " + ", ".join(f"{k} {n}" for k, n in sorted(self.rows.items())),
            "work: " + ", ".join(f"{k} {n}" for k, n in sorted(self.work.items())),
            "logged (most frequent): "
            + ", ".join(f"{k} {n}" for k, n in self.logged.most_common(12)),
        ]
        shown = self.findings[:40]
        if shown:
            lines += ["", "findings:", *(f"  {f}" for f in shown)]
            if len(self.findings) > len(shown):
                lines.append(f"  ... {len(self.findings) - len(shown)} more")
        return "\n".join(lines)


def summary(values: Sequence[float]) -> list[str]:
    """Median, p95 (nearest rank) and max, in seconds."""
    if not values:
        return ["-", "-", "-"]
    ordered = sorted(values)
    p95 = ordered[max(0, math.ceil(0.95 * len(ordered)) - 1)]
    return [f"{v:.3f} s" for v in (statistics.median(ordered), p95, ordered[-1])]


def table(headers: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    cells = [[str(h) for h in headers], *[[str(c) for c in row] for row in rows]]
    widths = [max(len(row[i]) for row in cells) for i in range(len(headers))]

    def line(row: Sequence[str]) -> str:
        return "| " + " | ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)) + " |"

    return "\n".join([line(cells[0]), "|" + "|".join("-" * (w + 2) for w in widths) + "|",
                      *(line(r) for r in cells[1:])])  # fmt: skip


class Context:
    """The record, its timelines and belief logs (built once), and the report."""

    def __init__(self, data: SoakData) -> None:
        self.data = data
        self.tl = Timeline(data.events, data.bounds.heartbeat_gap_s)
        self.bounds = data.bounds
        self.report = Report(duration_s=self.tl.end - self.tl.start)

    def find(self, kind: str, at: float | None, what: str) -> None:
        rel = None if at is None else at - self.tl.start
        self.report.findings.append(Finding(kind, rel, what))

    def dead(self, cand: str, m: float) -> bool:
        return m >= self.tl.died.get(cand, math.inf)

    def _log(self, slots: int) -> BeliefLog:
        return BeliefLog(clock=lambda: self.tl.start, slots=slots)

    def _faults(self, logs: dict[str, BeliefLog], role: str) -> None:
        """Deaths, freezes, thaws and terminations, into each of ``logs`` (of ``role``:
        ``lock``, ``sem`` or ``name``). A stalled event loop counts as a freeze (it is
        a ``blocked_loop`` finding of its own)."""
        for cand in self.tl.cands:
            for a, b in self.tl.frozen_spans(cand):
                for log in logs.values():
                    log.fault("freeze", cand, a)
                    log.fault("thaw", cand, b)
        for e in self.tl.events:
            if e["c"] != "harness":
                continue
            m, kind = float(e["m"]), e["e"]
            for name, log in logs.items():
                if kind == "fault" and e["kind"] in ("kill", "kill2"):
                    for cand in e["targets"]:
                        log.end(cand, "killed", m)
                elif kind == "exited":
                    log.end(e["cand"], "exited", m)
                elif kind == "fault" and e["kind"].startswith("pg_"):
                    for cand in self.tl.cands:  # a restart reaches every replica alive
                        if self.tl.spawned[cand] <= m < self.tl.died.get(cand, math.inf):
                            log.fault("terminate", cand, m)
                elif (
                    kind == "fault"
                    and e["kind"] == "terminate"
                    and e["role"] == role
                    and (role != "name" or e["name"] == name)
                ):
                    log.fault("terminate", e["targets"][0], m)

    def _beliefs(self, what: str, slots: int) -> BeliefLog:
        log = self._log(slots)
        for e in self.tl.events:
            c, m = e["c"], float(e["m"])
            if c == "harness" or e.get("what") != what or self.dead(c, m):
                continue
            if e["e"] == "state":
                log.feed(c, "state", m, old=e["old"], new=e["new"])
            elif e["e"] == "cb":
                log.feed(c, e["cb"], m)
        self._faults({what: log}, what)
        return log

    @cached_property
    def lock(self) -> BeliefLog:
        return self._beliefs("lock", 1)

    @cached_property
    def sem(self) -> BeliefLog:
        return self._beliefs("sem", self.data.sem_slots)

    @cached_property
    def names(self) -> dict[str, BeliefLog]:
        logs: dict[str, BeliefLog] = defaultdict(lambda: self._log(1))
        for e in self.tl.events:
            c, m = e["c"], float(e["m"])
            if c == "harness" or e.get("what") != "name" or self.dead(c, m):
                continue
            if e["e"] == "begin":
                logs[e["name"]].begin(c, m)
            elif e["e"] == "end":
                logs[e["name"]].end(c, "end", m)
        self._faults(logs, "name")
        return dict(logs)

    @cached_property
    def terms(self) -> dict[tuple[str, str, float], int | None]:
        """The term each worker began with, by (name, replica, when)."""
        return {(e["name"], e["c"], float(e["m"])): e["term"] for e in self.tl.events
                if e["e"] == "begin" and e.get("what") == "name"}  # fmt: skip

    def lock_overlaps(self, log: BeliefLog, name: str | None = None) -> list[Overlap]:
        """The overlaps of ``log`` nothing explains. A belief that outlived its lock
        because its replica did not run (a freeze, a stall) while the other began, or
        within ``late_loss_s`` after it ran again (its session ended meanwhile, and it
        learns so at its next step), or one that began as its replica ran again (a grant
        from before: the replica acts on what it knew), is explained; for a name's worker (``name``), it is a ``late_loss`` if it went on
        for ``late_loss_s`` while its replica ran (for the lock and the semaphore,
        ``check_holders`` tells from ``pg_locks``)."""
        tl, late = self.tl, self.bounds.late_loss_s
        report = log.report(until=tl.end)
        found = list(report.other_overlaps)
        stale: list[tuple[Overlap, BeliefInterval]] = []
        for overlap in report.terminate_overlaps + report.frozen_overlaps:
            stale.append((overlap, overlap.earlier))

        def rerun(interval: BeliefInterval) -> bool:
            """It began as its replica ran again."""
            spans = tl.frozen_spans(interval.candidate)
            return any(a <= interval.start <= b + late for a, b in spans)

        for overlap in list(found):
            earlier, later = overlap.earlier, overlap.later
            if rerun(later) or rerun(earlier):
                found.remove(overlap)
                stale.append((overlap, later if rerun(later) else earlier))
            elif any(
                a <= later.start <= b + late and b >= earlier.start
                for a, b in tl.frozen_spans(earlier.candidate)
            ):
                found.remove(overlap)  # the other began while it did not run, or just after
                stale.append((overlap, earlier))
        for overlap, outlived in stale if name is not None else []:
            other = overlap.later if outlived is overlap.earlier else overlap.earlier
            both = (
                max(other.start, outlived.start),
                min(other.end_or(tl.end), outlived.end_or(tl.end)),
            )
            ran = measure(subtract([both], tl.frozen_spans(outlived.candidate)))
            if ran > late:
                what = f"{name}: " if name else ""
                self.find("late_loss", both[0], f"{what}{overlap.describe(tl.start)}, "
                          f"{outlived.candidate} ran {ran:.2f} s of it")  # fmt: skip
        return found

    def spans(self, log: BeliefLog, cand: str) -> list[Span]:
        return norm((i.start, i.end_or(self.tl.end)) for i in log.intervals_of(cand))


# ---------------------------------------------------------------------- safety


def check_stale_rows(ctx: Context) -> None:
    bumps: dict[tuple[int, int], list[tuple[int, float]]] = defaultdict(list)
    for b in ctx.data.bumps:
        bumps[(b.key1, b.key2)].append((b.term, b.committed))
    for history in bumps.values():
        history.sort()
    for r in ctx.data.rows:
        later = [c for t, c in bumps.get((r.key1, r.key2), []) if t > r.term]
        if later and min(later) < r.committed:
            ctx.find("stale_row", None, f"{r.kind} row {r.item!r} of {r.cand}, term {r.term}, "
                     f"committed {r.committed - min(later):.3f} s after a later term began")  # fmt: skip


def check_term_crossed(ctx: Context) -> None:
    for r in ctx.data.rows:
        if r.began != r.term:
            ctx.find("term_crossed", None, f"{r.kind} row {r.item!r} of {r.cand} began under "
                     f"term {r.began}, committed under {r.term}")  # fmt: skip


def check_beliefs(ctx: Context) -> None:
    for kind, log in (("two_leaders", ctx.lock), ("sem_excess", ctx.sem)):
        for overlap in ctx.lock_overlaps(log):
            ctx.find(kind, overlap.later.start, overlap.describe(ctx.tl.start))
    for name, log in sorted(ctx.names.items()):
        for overlap in ctx.lock_overlaps(log, name):
            terms = ctx.terms.get((name, overlap.earlier.candidate, overlap.earlier.start)), \
                ctx.terms.get((name, overlap.later.candidate, overlap.later.start))  # fmt: skip
            stale = " (a stale start: its term is older)" if terms[1] < terms[0] else ""  # type: ignore[operator]
            ctx.find("name_two_leaders", overlap.later.start,
                     f"{name}: {overlap.describe(ctx.tl.start)}, terms {terms}{stale}")  # fmt: skip


def check_slots(ctx: Context) -> None:
    applied = Counter(round(slot_epoch(r.item), 3) for r in ctx.data.rows if r.kind == "sched")
    ledger = {round(r.slot, 3): r for r in ctx.data.ledger}
    expected: list[float] = []
    if ledger:
        first, cutoff = min(ledger), ctx.tl.shutdown_t - ctx.bounds.catch_up_s
        expected = [s for k in range(int((cutoff - first) / ctx.data.period_s) + 1)
                    if (s := round(first + k * ctx.data.period_s, 3)) <= cutoff]  # fmt: skip
    for slot, n in sorted(applied.items()):
        if n > 1:
            ctx.find("slot_duplicated", None, f"slot {slot} applied {n} times")
    missing = [s for s in expected if applied[s] == 0]
    for slot in missing:
        row = ledger.get(slot)
        ctx.find("slot_missing", None, f"slot {slot} never applied (ledger: "
                 f"{'no row' if row is None else row.outcome})")  # fmt: skip
    ctx.report.slots = {
        "due": len(expected),
        "applied": sum(1 for s in expected if applied[s]),
        "duplicated": sum(1 for n in applied.values() if n > 1),
        "missing": len(missing),
    }


def check_checkpoints(ctx: Context) -> None:
    positions: dict[str, Counter[int]] = defaultdict(Counter)
    for r in ctx.data.rows:
        if r.kind == "name" and r.position is not None:
            positions[r.item][r.position] += 1
    for name, seen in sorted(positions.items()):
        top = max(seen)
        twice = sorted(p for p, n in seen.items() if n > 1)
        gaps = sorted(set(range(1, top + 1)) - set(seen))
        if twice or gaps:
            ctx.find("checkpoint", None, f"{name}: positions twice {twice[:10]}, "
                     f"missing {gaps[:10]} (of 1..{top})")  # fmt: skip
        final = ctx.data.checkpoints.get(name)
        if final is not None and final != top:
            ctx.find("checkpoint", None, f"{name}: checkpoint {final}, rows up to {top}")


# ---------------------------------------------------------------------- availability


def longest(spans: Sequence[Span], bound: float) -> list[Span]:
    return [s for s in spans if s[1] - s[0] > bound]


def check_holders(ctx: Context) -> None:
    tl = ctx.tl
    for what, log in (("lock", ctx.lock), ("sem", ctx.sem)):
        for cand in tl.cands:
            held, known = tl.held(what, cand)
            believed = ctx.spans(log, cand)
            frozen = tl.frozen_spans(cand)
            life = [tl.life(cand)]
            late = subtract(subtract(intersect(believed, known), held), frozen)
            for a, b in longest(late, ctx.bounds.late_loss_s):
                ctx.find("late_loss", a, f"{cand} believed it held the {what} for "
                         f"{b - a:.2f} s after the server said it did not")  # fmt: skip
            silent = subtract(subtract(intersect(held, life), believed), frozen)
            for a, b in longest(silent, ctx.bounds.granted_silent_s):
                ctx.find("granted_silent", a, f"{cand}'s session held the {what} for "
                         f"{b - a:.2f} s, and it did not lead")  # fmt: skip


def check_stuck(ctx: Context) -> None:
    tl = ctx.tl
    for cand, events in sorted(tl.by_cand.items()):
        excluded = norm([*tl.frozen_spans(cand), *tl.server_down])
        for what in ("lock", "sem"):
            states = [(float(e["m"]), e["new"]) for e in events
                      if e["e"] == "state" and e["what"] == what]  # fmt: skip
            ends = [m for m, _ in states[1:]] + [tl.life(cand)[1]]
            for (m, state), end in zip(states, ends, strict=True):
                if state in STUCK_STATES:
                    for a, b in longest(subtract([(m, end)], excluded), ctx.bounds.stuck_s):
                        ctx.find("stuck_state", a, f"{cand}'s {what} {state} for {b - a:.2f} s")
        for e in events:
            if e["e"] == "log" and str(e["event"]).endswith("_ignores_cancel"):
                ctx.find("stuck_state", e["m"], f"{cand}: {e['event']} {e['f']}")
    for e in tl.events:
        if e["e"] == "term_hung":
            ctx.find("stuck_state", e["m"], f"{e['cand']} did not exit after SIGTERM")


def check_heartbeats(ctx: Context) -> None:
    for cand, spans in sorted(ctx.tl.stalled.items()):
        stalls = [e for e in ctx.tl.by_cand[cand] if e["e"] == "stall"]
        for a, b in spans:
            where = [w for e in stalls if a <= e["m"] <= b for w in e["where"]]
            age = a - ctx.tl.spawned[cand]
            ctx.find("blocked_loop", a, f"{cand}: no sign of life for {b - a:.2f} s, "
                     f"{age:.1f} s after it started"
                     + (f", blocked in {' < '.join(where[:4])}" if where else ""))  # fmt: skip


def check_names_led(ctx: Context) -> None:
    tl = ctx.tl
    window = [(tl.start, tl.shutdown)]
    for name, log in sorted(ctx.names.items()):
        led = norm(
            s for cand in tl.cands for s in subtract(ctx.spans(log, cand), tl.frozen_spans(cand))
        )
        for a, b in longest(subtract(window, led), ctx.bounds.name_unled_s):
            ctx.find("name_unled", a, f"{name} led by nobody for {b - a:.2f} s")


def check_stopped_loops(ctx: Context) -> None:
    told: set[tuple[str, str]] = set()  # (replica, loop): once each (a log, then its state)
    for e in ctx.tl.events:
        kind = e["e"]
        if kind == "stopped" and (e["c"], e["what"]) not in told:
            told.add((e["c"], e["what"]))
            ctx.find("stopped_loop", e["m"], f"{e['c']}'s {e['what']} stopped: {e['error']}")
        elif kind == "log" and e["event"] in STOPPING_LOGS:
            loop = "coord" if e["event"] == "coordinator_failed" else f"task {e['f'].get('task')}"
            if (e["c"], loop) not in told:
                told.add((e["c"], loop))
                ctx.find("stopped_loop", e["m"], f"{e['c']}: {e['event']} {e['f']}")
        elif kind == "exited" and (e["how"] == "died" or (e["how"] == "term" and e["rc"] != 0)):
            ctx.find("unexpected_exit", e["m"], f"{e['cand']} exited by itself, rc {e['rc']}")


def check_sessions(ctx: Context) -> None:
    for e in ctx.tl.events:
        if e["e"] != "sessions":
            continue
        alive, members = set(e["alive"]), e["members"]
        seen: Counter[tuple[str, str]] = Counter()
        for app, pid in e["rows"]:
            if app == "harness":
                continue
            parts = app.split(":")
            cand = parts[1] if parts[0] == "chaos" and len(parts) >= 3 else None
            if parts[0] == "pgl" and len(parts) >= 4:
                cand = members.get(parts[2])
            role = ":".join(["coord", *parts[3:]] if parts[0] == "pgl" else parts[2:])
            seen[(str(cand), role)] += 1
            if e["when"] == "after" or cand not in alive:
                ctx.find("leaked_session", e["m"], f"{e['when']}: session {pid} {app!r} "
                         f"of {cand or 'no replica'} ({'alive' if cand in alive else 'gone'})")  # fmt: skip
        for (cand, role), n in sorted(seen.items()):
            if n > 1 and (role in SINGLE_ROLES or role.startswith("name:")):
                ctx.find("leaked_session", e["m"], f"{e['when']}: {cand} has {n} {role} sessions")


CHECKS: dict[str, Callable[[Context], None]] = {
    "stale_rows": check_stale_rows,
    "term_crossed": check_term_crossed,
    "beliefs": check_beliefs,
    "slots": check_slots,
    "checkpoints": check_checkpoints,
    "holders": check_holders,
    "stuck": check_stuck,
    "heartbeats": check_heartbeats,
    "names_led": check_names_led,
    "stopped_loops": check_stopped_loops,
    "sessions": check_sessions,
}


# ---------------------------------------------------------------------- figures


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


def check(data: SoakData, skip: frozenset[str] = frozenset()) -> Report:
    """Every check of ``CHECKS`` but those in ``skip``, and the figures."""
    ctx = Context(data)
    for name, run in CHECKS.items():
        if name not in skip:
            run(ctx)
    figures(ctx)
    return ctx.report
