"""Replica processes of a ``Coordinator`` group (``tests/faults/coordinator_worker.py``)
on a throwaway server, for tests/faults/test_coordinator_*.py: each replica's workers as
its output shows them, every name's beliefs across the group, the fenced log of each
name, and how long a failed replica's names took to be led again."""

from __future__ import annotations

import asyncio
import collections
import contextlib
import os
import statistics
import sys
import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

import psycopg

from pgleaderlock.coordination.protocol import checkpoint_name
from pgleaderlock.core.config import default_lease_s
from pgleaderlock.testing.beliefs import FROZEN_RESUME_LIMIT_S, BeliefLog
from pgleaderlock.testing.candidate import CandidateEvent, CandidateProcess
from support.fixture_types import Figures
from support.server import one_row

WORKER = Path(__file__).parents[1] / "faults" / "coordinator_worker.py"


RELEAD_BOUND_S = 5.0
"""Every name of a failed replica is led again within this (generous: the figures
measured are milliseconds; printed)."""


SETTLE_BOUND_S = 15.0
"""A group balances within this after a start or a fault."""


DETECTION_S = 1.0
"""The replicas' ``health_interval_s + health_timeout_s``: how long a replica may take
to notice that the server ended its sessions, and so the longest terminate overlap."""


LEASE_S = default_lease_s(0.5, 0.5)
"""The replicas' lease (their timings' default, 2 s): a frozen replica's names are led
again within it (plus the slack below)."""


SLACK_S = 1.5


Admin = psycopg.AsyncConnection[tuple[Any, ...]]


def unique(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex[:10]}"


class Replica(CandidateProcess):
    """A ``coordinator_worker.py`` child, observed like a candidate process."""

    def __init__(self, name: str, dsn: str, args: list[str], stderr: IO[str]) -> None:
        super().__init__(name, dsn, 0, 0, stderr=stderr)
        self.args = args

    def argv(self) -> list[str]:
        return [sys.executable, str(WORKER), f"--name={self.name}", *self.args]

    @property
    def member(self) -> str:
        ready = self.find("ready")
        assert ready is not None
        return str(ready.data["member"])

    @property
    def killed_at(self) -> float | None:
        return self._killed_at

    def workers(self) -> set[str]:
        """The names whose worker runs here now (none once the process is gone)."""
        names: set[str] = set()
        for event in self.events:
            if event.event == "begin":
                names.add(event.data["name"])
            elif event.event == "end":
                names.discard(event.data["name"])
        return names if self.running else set()

    def status(self, key: str) -> int:
        for event in reversed(self.events):
            if event.event == "status":
                return int(event.data[key])
        return 0

    def begins(self, since: float) -> list[CandidateEvent]:
        return [e for e in self.events if e.event == "begin" and e.t >= since]

    def signal(self, signum: int) -> None:
        if self.running and self.pid is not None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, signum)


@dataclass
class Group:
    """Replica processes of one group on ``dsn``, and what was done to them."""

    dsn: str
    mode: str
    n: int
    stderr: IO[str]
    fencing: bool = False
    group: str = field(default_factory=lambda: unique("cg"))
    prefix: str = field(default_factory=lambda: unique("name"))
    log_table: str = field(default_factory=lambda: unique("log"))
    checkpoint_table: str = field(default_factory=lambda: unique("cp"))
    fencing_table: str = field(default_factory=lambda: unique("terms"))
    replicas: list[Replica] = field(default_factory=list)
    faults: list[tuple[str, str, float]] = field(default_factory=list)
    spawned: int = 0

    @property
    def names(self) -> list[str]:
        return [f"{self.prefix}:{i}" for i in range(self.n)]

    def args(self) -> list[str]:
        args = [f"--group={self.group}", f"--mode={self.mode}", f"--prefix={self.prefix}",
                f"--names={self.n}"]  # fmt: skip
        if self.fencing:
            args += ["--fencing", f"--log-table={self.log_table}",
                     f"--checkpoint-table={self.checkpoint_table}",
                     f"--fencing-table={self.fencing_table}"]  # fmt: skip
        return args

    async def prepare(self) -> None:
        if self.fencing:
            async with await psycopg.AsyncConnection.connect(self.dsn, autocommit=True) as conn:
                await conn.execute(
                    f"CREATE TABLE {self.log_table} (name text, position bigint, term bigint,"
                    " member text)".encode()
                )

    async def spawn(self, count: int, *, together: bool = False) -> list[Replica]:
        """Start ``count`` replicas, one after the other (each ready before the next
        starts, as in a rolling deployment) or all at once."""
        new = []
        for _ in range(count):
            self.spawned += 1
            new.append(Replica(f"r{self.spawned}", self.dsn, self.args(), self.stderr))
        self.replicas += new
        if together:
            await asyncio.gather(*(r.start() for r in new))
        else:
            for replica in new:
                await replica.start()
        return new

    def stderr_tail(self, chars: int = 3000) -> str:
        self.stderr.flush()
        self.stderr.seek(0)
        text = self.stderr.read()
        self.stderr.seek(0, os.SEEK_END)
        return f"\n--- replicas' stderr (tail) ---\n{text[-chars:]}" if text else ""

    def live(self) -> list[Replica]:
        return [r for r in self.replicas if r.running]

    def led(self) -> dict[str, list[str]]:
        """Each name -> the live replicas running its worker."""
        led: dict[str, list[str]] = {name: [] for name in self.names}
        for replica in self.live():
            for name in replica.workers():
                led[name].append(replica.name)
        return led

    def balanced(self) -> bool:
        """Every name runs on exactly one live replica, and each live replica runs
        ⌊N/M⌋ or ⌈N/M⌉ of them."""
        live = self.live()
        if not live or any(len(who) != 1 for who in self.led().values()):
            return False
        counts = {len(r.workers()) for r in live}
        return counts <= {self.n // len(live), -(-self.n // len(live))}

    async def settle(self, what: str, bound_s: float = SETTLE_BOUND_S) -> float:
        started = time.monotonic()
        while not self.balanced():
            if time.monotonic() - started > bound_s:
                counts = {r.name: len(r.workers()) for r in self.live()}
                doubled = {n: w for n, w in self.led().items() if len(w) != 1}
                raise AssertionError(
                    f"{what}: not balanced within {bound_s} s: counts {counts}, names not led "
                    f"once: {dict(list(doubled.items())[:10])} ({len(doubled)})"
                    + self.stderr_tail()
                )
            await asyncio.sleep(0.01)
        return time.monotonic() - started

    async def releads(
        self, names: set[str], since: float, by: Callable[[Replica], bool]
    ) -> dict[str, float]:
        """Poll until each of ``names`` has a worker begun at or after ``since`` on a
        replica that ``by`` accepts; return name -> seconds from ``since``."""
        found: dict[str, float] = {}
        deadline = since + RELEAD_BOUND_S
        while True:
            for replica in self.replicas:
                if not by(replica):
                    continue
                for event in replica.begins(since):
                    name = event.data["name"]
                    if name in names and (name not in found or event.t - since < found[name]):
                        found[name] = event.t - since
            if len(found) == len(names) or time.monotonic() > deadline:
                break
            await asyncio.sleep(0.01)
        missing = sorted(names - set(found))
        assert not missing, (
            f"{len(missing)} of {len(names)} names not led again within {RELEAD_BOUND_S} s: "
            f"{missing[:10]}; led now: {[(n, self.led()[n]) for n in missing[:10]]}"
            + self.stderr_tail()
        )
        return found

    async def terminate(self, module_admin: Admin, replica: Replica) -> int:
        """``pg_terminate_backend`` of every session of ``replica``'s coordinator."""
        pattern = f"pgl:{self.group}:{replica.member}:%".replace("_", "\\_")
        row = await one_row(
            module_admin,
            "SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity"
            " WHERE application_name LIKE %s",
            (pattern,),
        )
        return int(row[0])

    async def close(self) -> None:
        await asyncio.gather(*(r.stop(timeout_s=20) for r in self.replicas))

    # ------------------------------------------------------------ checks

    def beliefs(self) -> dict[str, BeliefLog]:
        """A BeliefLog per name, from every replica's begin/end lines; a killed
        replica's workers end at its kill."""
        logs = {name: BeliefLog() for name in self.names}
        for replica in self.replicas:
            for event in replica.events:
                if event.event == "begin":
                    logs[event.data["name"]].begin(replica.name, event.t)
                elif event.event == "end":
                    logs[event.data["name"]].end(replica.name, event.data["how"], event.t)
            killed = replica.killed_at
            for name, log in logs.items():
                if replica.name in log.leaders():
                    assert killed is not None, f"{replica.name} exited with {name} running"
                    log.end(replica.name, "killed", killed)
        for kind, victim, t in self.faults:
            if kind in ("terminate", "freeze", "thaw"):
                for log in logs.values():
                    log.fault(kind, victim, t)
        return logs

    def check_beliefs(self, figures: Figures) -> None:
        overlaps, terminate_overlaps, leaderships = [], [], 0
        resumed: list[float | None] = []  # frozen overlaps: how long after the thaw
        for log in self.beliefs().values():
            report = log.report()
            leaderships += len(report.intervals)
            overlaps += [o.describe(report.origin) for o in report.other_overlaps]
            terminate_overlaps += [o.size_s for o in report.terminate_overlaps]
            resumed += [o.resumed_late_s for o in report.frozen_overlaps]
        figures("leaderships", leaderships, "")
        figures("terminate overlaps", len(terminate_overlaps), "")
        if terminate_overlaps:
            figures("longest terminate overlap", max(terminate_overlaps), "ms")
        assert not overlaps, "two replicas ran a name at once:\n  " + "\n  ".join(overlaps[:20])
        # Inside the terminate window a worker believes until its replica notices (with
        # fencing too: a worker learns only at its next fence); what fencing rules out,
        # even there, is interleaved work, which check_log checks.
        assert max(terminate_overlaps, default=0.0) <= DETECTION_S, (
            f"terminate overlaps {sorted(terminate_overlaps)[-5:]} s (limit {DETECTION_S} s)"
        )
        if resumed:  # a frozen replica stopped its workers as soon as it ran again
            figures("frozen overlaps", len(resumed), "")
            assert None not in resumed, "a frozen replica's worker ran on after it thawed"
            late = max(r for r in resumed if r is not None)
            figures("workers stopped after the thaw, at most", late, "ms")
            assert late <= FROZEN_RESUME_LIMIT_S

    async def check_log(self, figures: Figures) -> None:
        """Every name's log: each position once, 1..n, terms never going back; the
        checkpoint is the last position."""
        async with await psycopg.AsyncConnection.connect(self.dsn, autocommit=True) as conn:
            cur = await conn.execute(
                f"SELECT name, position, term FROM {self.log_table} ORDER BY name, position".encode()
            )
            rows = await cur.fetchall()
            cur = await conn.execute(
                f"SELECT subscription_name, last_position FROM {self.checkpoint_table}".encode()
            )
            head = checkpoint_name(self.group, "")  # the group's rows: "<group>:<name>"
            checkpoints = {str(n)[len(head) :]: p for n, p in await cur.fetchall()}
        by_name: dict[str, list[tuple[int, int]]] = collections.defaultdict(list)
        for name, position, term in rows:
            by_name[name].append((position, term))
        problems: list[str] = []
        for name, entries in by_name.items():
            positions = [p for p, _ in entries]
            if positions != list(range(1, len(positions) + 1)):
                dup = [p for p, c in collections.Counter(positions).items() if c > 1]
                problems.append(f"{name}: positions not 1..{len(positions)} (repeated: {dup[:5]})")
            terms = [t for _, t in entries]
            back = [(p, t) for (p, t), prev in zip(entries[1:], terms, strict=False) if t < prev]
            if back:
                problems.append(f"{name}: term went back at {back[:5]}")
            if checkpoints.get(name) != positions[-1]:
                problems.append(f"{name}: checkpoint {checkpoints.get(name)} != {positions[-1]}")
        fenced = sum(int(e.data.get("fenced", 0)) for r in self.replicas for e in r.events
                     if e.event == "exit")  # fmt: skip
        figures("fenced commits", len(rows), "")
        figures("transactions refused by their fence", fenced, "")
        assert set(by_name) == set(self.names), "some names never committed"
        assert not problems, "\n".join(problems[:20])


@contextlib.asynccontextmanager
async def running(group: Group) -> AsyncIterator[Group]:
    await group.prepare()
    try:
        yield group
    finally:
        await group.close()


def anyone(replica: Replica) -> bool:
    return True


def other_than(victim: Replica) -> Callable[[Replica], bool]:
    return lambda replica: replica is not victim


def spread(values: dict[str, float]) -> str:
    ms = sorted(v * 1000 for v in values.values())
    return f"median {statistics.median(ms):.1f} ms, max {ms[-1]:.1f} ms over {len(ms)} names"
