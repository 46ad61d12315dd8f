"""What the chaos checker (``chaos_check.check``) returns: its findings by kind and the
figures of the soak, and their text (tables with the median, p95 and max)."""

from __future__ import annotations

import math
import statistics
from collections import Counter, defaultdict
from collections.abc import Sequence
from dataclasses import dataclass, field

SAFETY = (
    "stale_row", "term_crossed", "two_leaders", "sem_excess", "name_two_leaders",
    "slot_duplicated", "slot_missing", "checkpoint",
)  # fmt: skip
AVAILABILITY = (
    "late_loss", "granted_silent", "stuck_state", "blocked_loop", "name_unled",
    "stopped_loop", "unexpected_exit", "leaked_session",
)  # fmt: skip


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
