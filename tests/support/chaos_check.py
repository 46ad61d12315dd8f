"""The chaos soak's invariants, checked over its record (``chaos_data.SoakData``).

``check(data)`` runs every check of ``CHECKS`` (``skip=`` leaves some out: the tests
show that each planted violation is found by its own check) and returns a ``Report``:
its findings by kind, and the figures (faults, leaderless time per fault, names re-led
after a SIGKILL, slots).

The report: ``chaos_report.py``; the record read into timelines and belief logs:
``chaos_context.py``; the figures: ``chaos_figures.py``.

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

from collections import Counter, defaultdict
from collections.abc import Callable, Sequence

from support.chaos_context import Context
from support.chaos_data import SoakData, Span, intersect, norm, slot_epoch, subtract
from support.chaos_figures import figures
from support.chaos_report import AVAILABILITY, SAFETY, Finding, Report

__all__ = ["AVAILABILITY", "CHECKS", "SAFETY", "Finding", "Report", "check"]

STUCK_STATES = ("releasing", "reconnecting")
STOPPING_LOGS = ("coordinator_failed", "leader_task_gave_up")
SINGLE_ROLES = (
    "lock", "sem", "lockwork", "semwork", "coord:util", "coord:listen", "coord:watch",
    "coord:hold",
)  # fmt: skip


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


def check(data: SoakData, skip: frozenset[str] = frozenset()) -> Report:
    """Every check of ``CHECKS`` but those in ``skip``, and the figures."""
    ctx = Context(data)
    for name, run in CHECKS.items():
        if name not in skip:
            run(ctx)
    figures(ctx)
    return ctx.report
