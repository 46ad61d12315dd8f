"""The leadership-belief checker: did two candidates ever believe they led at once?

[`BeliefLog`][pgleaderlock.testing.beliefs.BeliefLog] records, for every candidate, the
intervals during which it *believed* it was leader (from entering LEADER / ``on_acquired``
to leaving LEADER / ``on_lost`` / ``on_released`` / ``on_stopped`` / its death) and checks
that no two intervals overlap. Feed it from in-process locks
([`BeliefLog.attach`][pgleaderlock.testing.beliefs.BeliefLog.attach]) or from candidate
processes ([`CandidateProcess`][pgleaderlock.testing.candidate.CandidateProcess] does it).

Overlaps that follow an external ``pg_terminate_backend`` of the old leader (recorded with
[`BeliefLog.fault`][pgleaderlock.testing.beliefs.BeliefLog.fault]) are reported separately
as *terminate overlaps* with their size: the server frees the lock before the old leader
can know, so those can be made short but not zero (see ``docs/guarantees.md``).

Overlaps of a leader that was *frozen* (SIGSTOP, or an event loop blocked by a
synchronous call: recorded as a ``freeze`` fault, and a ``thaw`` when it runs again) are
reported as *frozen overlaps*: the server ends a frozen leader's session when its lease
runs out, and the next leader begins while the frozen one cannot know. Its belief must
end promptly once it runs again (at its first probe: within
[`FROZEN_RESUME_LIMIT_S`][pgleaderlock.testing.beliefs.FROZEN_RESUME_LIMIT_S] of the
thaw); only fencing keeps its writes of that moment out (``docs/guarantees.md``).

All timestamps are ``time.monotonic()`` seconds (one clock for every process of a Linux
host, network namespaces included).
"""

from __future__ import annotations

import itertools
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Final

from ..lowlevel import LeaderLock, LockState

__all__ = [
    "FROZEN_RESUME_LIMIT_S",
    "TERMINATE_OVERLAP_LIMIT_S",
    "BeliefInterval",
    "BeliefLog",
    "BeliefReport",
    "Fault",
    "Gap",
    "Overlap",
    "describe_overlaps",
]

TERMINATE_OVERLAP_LIMIT_S: Final = 0.05
"""How long a terminate overlap may last (measured: 0.4-2.6 ms on loopback)."""

FROZEN_RESUME_LIMIT_S: Final = 1.0
"""How long after it runs again a frozen leader may still believe it leads: its next
probe is overdue, so it runs at once and fails (measured: a few ms)."""

_BEGIN_EVENTS: Final = frozenset({"acquired"})
_END_EVENTS: Final = frozenset({"lost", "released", "stopped"})


@dataclass
class BeliefInterval:
    """A span during which ``candidate`` believed it was the leader.

    ``end`` is None while the belief is still held.
    """

    candidate: str
    start: float
    end: float | None = None
    end_reason: str | None = None

    def end_or(self, until: float) -> float:
        """``end``, or ``until`` while the belief is still held."""
        return self.end if self.end is not None else until


@dataclass(frozen=True)
class Fault:
    """A fault injected at ``t``; ``kind == "terminate"`` explains a terminate overlap."""

    kind: str
    candidate: str | None
    t: float


@dataclass(frozen=True)
class Overlap:
    """Two candidates believed they were leader at once, for ``size_s`` seconds."""

    earlier: BeliefInterval
    later: BeliefInterval
    size_s: float
    terminate: Fault | None
    """The termination of ``earlier``'s backend that explains it, or None."""
    thaw: Fault | None = None
    """``earlier`` was frozen when ``later`` began: when it ran again (None if not
    frozen, or never thawed)."""

    @property
    def resumed_late_s(self) -> float | None:
        """For a frozen overlap: how long ``earlier`` still believed it led after it ran
        again (None: not a frozen overlap, or its belief has not ended)."""
        if self.thaw is None or self.earlier.end is None:
            return None
        return max(0.0, self.earlier.end - self.thaw.t)

    def describe(self, origin: float = 0.0) -> str:
        what = "terminate overlap" if self.terminate is not None else "OVERLAP"
        if self.thaw is not None:
            what = f"frozen overlap (ended {_ms(self.resumed_late_s)} after the thaw)"
        return (
            f"{what} {self.size_s * 1000:.3f} ms: {self.earlier.candidate} "
            f"[{self.earlier.start - origin:.4f}, {_fmt_end(self.earlier, origin)}] vs "
            f"{self.later.candidate} [{self.later.start - origin:.4f}, "
            f"{_fmt_end(self.later, origin)}]"
        )


def _ms(seconds: float | None) -> str:
    return "never" if seconds is None else f"{seconds * 1000:.3f} ms"


def _fmt_end(interval: BeliefInterval, origin: float) -> str:
    if interval.end is None:
        return "open"
    return f"{interval.end - origin:.4f} {interval.end_reason}"


@dataclass(frozen=True)
class Gap:
    """A leaderless span between two beliefs (or from the last belief to the end)."""

    start: float
    end: float

    @property
    def size_s(self) -> float:
        return self.end - self.start


@dataclass(frozen=True)
class BeliefReport:
    """What [`BeliefLog.report`][pgleaderlock.testing.beliefs.BeliefLog.report] found."""

    intervals: tuple[BeliefInterval, ...]
    faults: tuple[Fault, ...]
    terminate_overlaps: tuple[Overlap, ...]
    other_overlaps: tuple[Overlap, ...]
    frozen_overlaps: tuple[Overlap, ...]
    longest_gap: Gap | None
    leader_changes: int
    origin: float
    until: float

    @property
    def max_terminate_overlap_s(self) -> float:
        return max((o.size_s for o in self.terminate_overlaps), default=0.0)

    def assert_safe(
        self,
        terminate_limit_s: float = TERMINATE_OVERLAP_LIMIT_S,
        resume_limit_s: float = FROZEN_RESUME_LIMIT_S,
    ) -> None:
        """Raise AssertionError for any overlap other than a short terminate overlap, or
        a frozen overlap whose frozen leader learned of its loss promptly once it ran
        again."""
        problems = [o.describe(self.origin) for o in self.other_overlaps]
        problems += [
            o.describe(self.origin) + f" (limit {terminate_limit_s * 1000:g} ms)"
            for o in self.terminate_overlaps
            if o.size_s >= terminate_limit_s
        ]
        problems += [
            o.describe(self.origin) + f" (limit {resume_limit_s * 1000:g} ms)"
            for o in self.frozen_overlaps
            if (late := o.resumed_late_s) is None or late > resume_limit_s
        ]
        if problems:
            raise AssertionError(
                "leadership beliefs overlap:\n  " + "\n  ".join(problems) + "\n" + self.format()
            )

    def format(self) -> str:
        """A human-readable summary (intervals relative to the first event)."""
        lines = [
            f"{len(self.intervals)} leaderships, {self.leader_changes} leader changes, "
            f"{len(self.other_overlaps)} overlaps, "
            f"{len(self.terminate_overlaps)} terminate overlaps "
            f"(max {self.max_terminate_overlap_s * 1000:.3f} ms), "
            f"{len(self.frozen_overlaps)} frozen overlaps"
        ]
        if self.longest_gap is not None:
            lines.append(
                f"longest leaderless gap {self.longest_gap.size_s:.3f} s at "
                f"{self.longest_gap.start - self.origin:.3f}"
            )
        for interval in self.intervals[:50]:
            lines.append(
                f"  {interval.candidate}: {interval.start - self.origin:.4f} .. "
                f"{_fmt_end(interval, self.origin)}"
            )
        if len(self.intervals) > 50:
            lines.append(f"  ... {len(self.intervals) - 50} more")
        return "\n".join(lines)


class BeliefLog:
    """Records when each candidate believes it is leader, and checks for overlaps.

    Feed it from in-process locks with
    [`attach`][pgleaderlock.testing.beliefs.BeliefLog.attach], from candidate processes with
    [`feed`][pgleaderlock.testing.beliefs.BeliefLog.feed] (done by
    [`CandidateProcess`][pgleaderlock.testing.candidate.CandidateProcess]), or by hand with
    [`begin`][pgleaderlock.testing.beliefs.BeliefLog.begin] and
    [`end`][pgleaderlock.testing.beliefs.BeliefLog.end] (e.g. ``end(name, "killed", t)`` for
    a SIGKILLed process, ``end(name, "stop")`` after a ``shutdown()`` that cancelled the
    task, which emits no event).

    A belief begins at the earliest of ``on_state_change(..., LEADER)`` and
    ``on_acquired``, and ends at the earliest of ``on_state_change(LEADER, ...)``,
    ``on_lost``, ``on_released`` and ``on_stopped``.

    With ``slots=N`` (a [`Semaphore`][pgleaderlock.Semaphore]'s candidates) up to N
    beliefs may be held at once: an overlap is a moment when more than N candidates
    believe they hold a slot, reported against the belief that began last (``later``)
    and one of the N it came on top of (``earlier``: the one whose termination or freeze
    explains it, if any).

    Args:
        clock: the clock of the timestamps (``time.monotonic``).
        slots: how many candidates may believe at once (1: a lock).
    """

    def __init__(self, clock: Callable[[], float] = time.monotonic, slots: int = 1) -> None:
        if isinstance(slots, bool) or not isinstance(slots, int) or slots < 1:
            raise ValueError(f"slots must be an int of at least 1, got {slots!r}")
        self.slots = slots
        self._clock = clock
        self._open: dict[str, BeliefInterval] = {}
        self._closed: list[BeliefInterval] = []
        self._faults: list[Fault] = []
        self.origin = clock()

    # ---------------------------------------------------------------- recording

    def attach(self, lock: LeaderLock, candidate: str) -> None:
        """Record ``lock``'s beliefs as ``candidate``. Attach before other callbacks."""

        def state_change(old: LockState, new: LockState) -> None:
            self.feed(candidate, "state", self._clock(), old=old.value, new=new.value)

        lock.on_state_change(state_change)
        lock.on_acquired(lambda: self.begin(candidate))
        lock.on_lost(lambda: self.end(candidate, "lost"))
        lock.on_released(lambda: self.end(candidate, "released"))
        lock.on_stopped(lambda: self.end(candidate, "stopped"))

    def feed(
        self,
        candidate: str,
        event: str,
        t: float,
        *,
        old: str | None = None,
        new: str | None = None,
    ) -> None:
        """Record an event named like the callbacks (``state`` with ``old``/``new``)."""
        if event == "state":
            if new == LockState.LEADER.value:
                self.begin(candidate, t)
            elif old == LockState.LEADER.value:
                self.end(candidate, f"state:{new}", t)
        elif event in _BEGIN_EVENTS:
            self.begin(candidate, t)
        elif event in _END_EVENTS:
            self.end(candidate, event, t)

    def begin(self, candidate: str, t: float | None = None) -> None:
        """``candidate`` believes it leads from ``t`` (no-op if it already does)."""
        if candidate not in self._open:
            self._open[candidate] = BeliefInterval(candidate, self._clock() if t is None else t)

    def end(self, candidate: str, reason: str, t: float | None = None) -> None:
        """``candidate`` stops believing it leads at ``t`` (no-op if it does not)."""
        interval = self._open.pop(candidate, None)
        if interval is not None:
            at = self._clock() if t is None else t
            interval.end = max(at, interval.start)
            interval.end_reason = reason
            self._closed.append(interval)

    def fault(self, kind: str, candidate: str | None = None, t: float | None = None) -> Fault:
        """Record a fault. Call it *before* injecting it (``t`` defaults to now)."""
        recorded = Fault(kind, candidate, self._clock() if t is None else t)
        self._faults.append(recorded)
        return recorded

    # ---------------------------------------------------------------- queries

    def leaders(self) -> list[str]:
        """Candidates that believe they lead right now."""
        return sorted(self._open)

    @property
    def faults(self) -> list[Fault]:
        return list(self._faults)

    def intervals(self) -> list[BeliefInterval]:
        """Every belief so far (open ones have ``end`` None), by start time."""
        return sorted([*self._closed, *self._open.values()], key=lambda i: (i.start, i.candidate))

    def intervals_of(self, candidate: str) -> list[BeliefInterval]:
        return [i for i in self.intervals() if i.candidate == candidate]

    def report(self, until: float | None = None) -> BeliefReport:
        """Check every pair of beliefs; open beliefs count as held until ``until``."""
        end_of_time = self._clock() if until is None else until
        intervals = self.intervals()
        terminate: list[Overlap] = []
        other: list[Overlap] = []
        frozen: list[Overlap] = []
        found = (
            self._pair_overlaps(intervals, end_of_time)
            if self.slots == 1
            else self._excess_overlaps(intervals, end_of_time)
        )
        for overlap in found:
            if overlap.terminate is not None:
                terminate.append(overlap)
            elif overlap.thaw is not None:
                frozen.append(overlap)
            else:
                other.append(overlap)
        changes = sum(1 for a, b in itertools.pairwise(intervals) if a.candidate != b.candidate)
        return BeliefReport(
            intervals=tuple(intervals),
            faults=tuple(self._faults),
            terminate_overlaps=tuple(terminate),
            other_overlaps=tuple(other),
            frozen_overlaps=tuple(frozen),
            longest_gap=_longest_gap(intervals, end_of_time),
            leader_changes=changes,
            origin=self.origin,
            until=end_of_time,
        )

    def _overlap(self, earlier: BeliefInterval, later: BeliefInterval, size: float) -> Overlap:
        cause = self._terminate_cause(earlier, later)
        thaw = None if cause is not None else self._thaw(earlier, later)
        return Overlap(earlier, later, size, cause, thaw)

    def _pair_overlaps(self, intervals: list[BeliefInterval], until: float) -> list[Overlap]:
        """One leader at most: every pair of beliefs of two candidates that overlap."""
        found = []
        for j, later in enumerate(intervals):
            for earlier in intervals[:j]:
                stop = min(earlier.end_or(until), later.end_or(until))
                size = stop - later.start
                if size > 0 and earlier.candidate != later.candidate:
                    found.append(self._overlap(earlier, later, size))
        return found

    def _excess_overlaps(self, intervals: list[BeliefInterval], until: float) -> list[Overlap]:
        """Up to ``slots`` believers: the count only grows when a belief begins, so a
        moment with more than ``slots`` believers follows the start of one (``later``)
        that came on top of ``slots`` or more others (of other candidates), and lasts
        until enough of those have ended (or ``later`` has)."""
        found = []
        for j, later in enumerate(intervals):
            start = later.start
            others = [
                i
                for i in intervals[:j]
                if i.candidate != later.candidate and i.start <= start < i.end_or(until)
            ]
            if len(others) < self.slots:
                continue
            ends = sorted(i.end_or(until) for i in others)
            size = min(ends[len(others) - self.slots], later.end_or(until)) - start
            if size <= 0:
                continue
            candidates = [self._overlap(earlier, later, size) for earlier in others]
            explained = [o for o in candidates if o.terminate is not None or o.thaw is not None]
            found.append(explained[0] if explained else candidates[0])
        return found

    def _terminate_cause(self, earlier: BeliefInterval, later: BeliefInterval) -> Fault | None:
        for f in self._faults:
            if (
                f.kind == "terminate"
                and f.candidate == earlier.candidate
                and earlier.start <= f.t <= later.start
            ):
                return f
        return None

    def _thaw(self, earlier: BeliefInterval, later: BeliefInterval) -> Fault | None:
        """The ``thaw`` that ended a ``freeze`` of ``earlier``'s candidate during which
        ``later`` began (None: it was not frozen then, or never ran again)."""
        frozen_at = None
        for f in sorted(self._faults, key=lambda f: f.t):
            if f.candidate != earlier.candidate:
                continue
            if f.kind == "freeze" and earlier.start <= f.t <= later.start:
                frozen_at = f.t
            elif f.kind == "thaw" and frozen_at is not None and f.t >= later.start:
                return f
            elif f.kind == "thaw":
                frozen_at = None
        return None


def _longest_gap(intervals: Sequence[BeliefInterval], until: float) -> Gap | None:
    if not intervals:
        return None
    longest: Gap | None = None
    covered_to = intervals[0].end_or(until)
    for interval in intervals[1:]:
        if interval.start > covered_to:
            gap = Gap(covered_to, interval.start)
            if longest is None or gap.size_s > longest.size_s:
                longest = gap
        covered_to = max(covered_to, interval.end_or(until))
    if covered_to < until:
        gap = Gap(covered_to, until)
        if longest is None or gap.size_s > longest.size_s:
            longest = gap
    return longest


def describe_overlaps(overlaps: Sequence[Overlap]) -> str:
    """``n (max x ms, median y ms)`` for a list of overlaps."""
    if not overlaps:
        return "0"
    sizes = [o.size_s * 1000 for o in overlaps]
    return f"{len(sizes)} (max {max(sizes):.3f} ms, median {statistics.median(sizes):.3f} ms)"
