"""The chaos soak's record as the checks read it (``chaos_check.py``): its timelines,
the belief logs of the lock, the semaphore and every name (built once), and the
report the checks add their findings to."""

from __future__ import annotations

import math
from collections import defaultdict
from functools import cached_property

from pgleaderlock.testing.beliefs import BeliefInterval, BeliefLog, Overlap
from support.chaos_data import SoakData, Span, Timeline, measure, norm, subtract
from support.chaos_report import Finding, Report


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
