"""The record of a chaos soak as the checker (``chaos_check.py``) reads it: the events
of the harness and of every replica (``chaos_soak.py``, ``chaos_replica.py``), the
final database, and the timelines made from them.

Times: events carry ``m`` (``time.monotonic()``, one clock for every process of the
host) and ``t`` (``time.time()``); the database's commit times are the server's
``time.time()`` (same host). Spans are ``(start, end)`` pairs of monotonic seconds.
"""

from __future__ import annotations

import bisect
import datetime as dt
import itertools
import json
from collections import defaultdict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

__all__ = [
    "Bounds",
    "Bump",
    "Event",
    "LedgerRow",
    "Row",
    "SoakData",
    "Span",
    "Timeline",
    "intersect",
    "measure",
    "norm",
    "subtract",
]

Event = dict[str, Any]
Span = tuple[float, float]


@dataclass(frozen=True)
class Row:
    """A committed row of ``chaos.rows``: ``kind`` (``lock``, ``sem``, ``name``,
    ``sched``), the keys it was fenced with, the term it committed under, the term its
    unit of work began under, the replica, the item (a sequence number, a slot, a name),
    a position (a name's checkpoint, a slot's attempt), and its commit time."""

    kind: str
    key1: int
    key2: int
    term: int
    began: int
    cand: str
    item: str
    position: int | None
    committed: float


@dataclass(frozen=True)
class Bump:
    """A term written to the terms table (``chaos.term_history``), and when it committed."""

    key1: int
    key2: int
    term: int
    committed: float


@dataclass(frozen=True)
class LedgerRow:
    """A row of the schedule ledger: the slot (epoch seconds), its outcome, term, attempt."""

    slot: float
    outcome: str
    term: int
    attempt: int


@dataclass(frozen=True)
class Bounds:
    """How long each availability promise may be late before it is a finding. Loose on
    purpose (a shared, loaded machine): they catch stalls of seconds, they measure
    nothing."""

    late_loss_s: float = 2.5
    """A replica still believes it holds a lock (or runs a name's worker) this long
    after the server says it does not (the issue's target: 1 s)."""
    granted_silent_s: float = 5.0
    """The server granted a replica's session the lock, and the replica does not lead
    (its fencing grace is 2 s)."""
    stuck_s: float = 5.0
    """In RELEASING or RECONNECTING, with the server up."""
    heartbeat_gap_s: float = 3.0
    """A running (not frozen) replica's event loop did not tick (its heartbeat is 1 s)."""
    name_unled_s: float = 15.0
    """A name led by nobody (a frozen leader keeps it for its lease, 10 s)."""
    catch_up_s: float = 10.0
    """Slots due this long before the graceful stop must have run."""


@dataclass
class SoakData:
    """Everything the checker looks at."""

    events: list[Event]
    rows: list[Row] = field(default_factory=list)
    bumps: list[Bump] = field(default_factory=list)
    ledger: list[LedgerRow] = field(default_factory=list)
    checkpoints: dict[str, int] = field(default_factory=dict)
    """The final ``last_position`` of each name (``name`` without the group)."""
    period_s: float = 2.0
    sem_slots: int = 2
    bounds: Bounds = field(default_factory=Bounds)

    @classmethod
    def load(cls, out: Path, **options: Any) -> SoakData:
        """The record a ``Soak`` left in ``out``."""
        events: list[Event] = []
        for path in sorted(out.glob("*.jsonl")):
            with open(path, "rb") as f:
                events.extend(json.loads(line) for line in f if line.endswith(b"\n"))
        db = json.loads((out / "db.json").read_text())
        return cls(
            events=events,
            rows=[Row(*r) for r in db["rows"]],
            bumps=[Bump(*b) for b in db["bumps"]],
            ledger=[LedgerRow(*r) for r in db["ledger"]],
            checkpoints={str(n).split(":", 1)[-1]: int(p) for n, p in db["checkpoints"]},
            **options,
        )


def slot_epoch(item: str) -> float:
    """A ``sched`` row's slot (ISO 8601) as epoch seconds."""
    return dt.datetime.fromisoformat(item).timestamp()


# ---------------------------------------------------------------------- spans


def norm(spans: Iterable[Span]) -> list[Span]:
    """Sorted, merged, without empty spans."""
    merged: list[Span] = []
    for a, b in sorted(s for s in spans if s[1] > s[0]):
        if merged and a <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], b))
        else:
            merged.append((a, b))
    return merged


def intersect(x: Sequence[Span], y: Sequence[Span]) -> list[Span]:
    """Where both hold (both normalized)."""
    found, i, j = [], 0, 0
    while i < len(x) and j < len(y):
        a, b = max(x[i][0], y[j][0]), min(x[i][1], y[j][1])
        if a < b:
            found.append((a, b))
        if x[i][1] < y[j][1]:
            i += 1
        else:
            j += 1
    return found


def subtract(x: Sequence[Span], y: Sequence[Span]) -> list[Span]:
    """Where ``x`` holds and ``y`` does not (both normalized)."""
    found: list[Span] = []
    for a, b in x:
        start = a
        for c, d in y:
            if d <= start or c >= b:
                continue
            if c > start:
                found.append((start, c))
            start = max(start, d)
        if start < b:
            found.append((start, b))
    return found


def measure(spans: Iterable[Span]) -> float:
    return sum(b - a for a, b in spans)


# ---------------------------------------------------------------------- timelines


class Timeline:
    """What happened when, from the events: the phases, the faults, each replica's
    life, its freezes (SIGSTOP), its stalls (heartbeats more than ``stall_s`` apart
    while not frozen: an event loop that did not run; the stall is the longest silence
    between them), the server's restarts, who held the lock and the slots."""

    def __init__(self, events: Iterable[Event], stall_s: float = 3.0) -> None:
        self.events = sorted(events, key=lambda e: float(e["m"]))
        evs = self.events
        phases = {str(e["name"]): e for e in evs if e["e"] == "phase"}
        self.phases = phases
        self.start = float(phases["faults"]["m"]) if "faults" in phases else evs[0]["m"]
        self.end = float(phases["end"]["m"]) if "end" in phases else float(evs[-1]["m"])
        self.shutdown = float(phases["shutdown"]["m"]) if "shutdown" in phases else self.end
        self.shutdown_t = float(phases["shutdown"]["t"]) if "shutdown" in phases else 0.0
        self.faults = [e for e in evs if e["e"] == "fault"]
        self.by_cand: dict[str, list[Event]] = defaultdict(list)
        self.spawned: dict[str, float] = {}
        self.died: dict[str, float] = {}
        self.members: dict[str, str] = {}
        frozen_at: dict[str, float] = {}
        self.frozen: dict[str, list[Span]] = defaultdict(list)
        self.server_down: list[Span] = []
        down_at: float | None = None
        self.holders: dict[str, list[tuple[float, list[str] | None]]] = defaultdict(list)
        for e in evs:
            m, kind = float(e["m"]), e["e"]
            if e["c"] != "harness":
                self.by_cand[e["c"]].append(e)
                self.spawned.setdefault(e["c"], m)
                if kind == "ready":
                    self.members[str(e["member"])] = e["c"]
            elif kind == "spawn":
                self.spawned[e["cand"]] = min(m, self.spawned.get(e["cand"], m))
            elif kind == "fault" and e["kind"] in ("kill", "kill2"):
                for cand in e["targets"]:
                    self.died[cand] = m
            elif kind == "exited":
                self.died.setdefault(e["cand"], m)
            elif kind == "fault" and e["kind"] == "stop":
                frozen_at[e["targets"][0]] = m
            elif kind == "cont" and e["cand"] in frozen_at:
                self.frozen[e["cand"]].append((frozen_at.pop(e["cand"]), m))
            elif kind == "fault" and e["kind"].startswith("pg_"):
                down_at = m
            elif kind == "server_up" and down_at is not None:
                self.server_down.append((down_at, m))
                down_at = None
            elif kind == "holder":
                self.holders[e["what"]].append((m, e["holders"]))
        for cand, since in frozen_at.items():
            self.frozen[cand].append((since, self.died.get(cand, self.end)))
        if down_at is not None:
            self.server_down.append((down_at, self.end))
        self.stalled: dict[str, list[Span]] = {}
        for cand, evs_of in self.by_cand.items():
            times = [float(e["m"]) for e in evs_of]
            beats = [float(e["m"]) for e in evs_of if e["e"] == "hb"]
            frozen = norm(self.frozen.get(cand, []))
            self.stalled[cand] = [
                # The longest silence between two heartbeats too far apart: the loop ran
                # nothing then (what it logged in the gap came before or after).
                max(
                    itertools.pairwise(
                        times[bisect.bisect_left(times, a) : bisect.bisect_right(times, b)]
                    ),
                    key=lambda pair: pair[1] - pair[0],
                )
                for a, b in itertools.pairwise(beats)
                if measure(subtract([(a, b)], frozen)) > stall_s
            ]

    @property
    def cands(self) -> list[str]:
        return sorted(self.spawned)

    def life(self, cand: str) -> Span:
        return self.spawned[cand], self.died.get(cand, self.end)

    def frozen_spans(self, cand: str, stalls: bool = True) -> list[Span]:
        """When ``cand`` did not run: SIGSTOPped, and (``stalls``) stalled."""
        return norm([*self.frozen.get(cand, []), *(self.stalled.get(cand, []) if stalls else [])])

    def held(self, what: str, cand: str) -> tuple[list[Span], list[Span]]:
        """When ``cand`` held ``what`` (``lock``, ``sem``) by the server's ``pg_locks``,
        and when the harness knew who held it (its samples answered), until the graceful
        stop began."""
        series = self.holders.get(what, [])
        held, known = [], []
        for (m, holders), nxt in zip(series, [*series[1:], (self.shutdown, None)], strict=True):
            span = (m, min(nxt[0], self.shutdown))  # the graceful stop is not looked at
            if holders is None:
                continue
            known.append(span)
            if cand in holders:
                held.append(span)
        return norm(held), norm(known)
