"""``FencedWorker``: a ``tests/faults/fenced_worker.py`` child (a fencing lock that runs
fenced transactions while it leads), observed like a candidate process, for the fault
tests (``test_fencing_faults.py``, ``test_frozen_leader.py``)."""

from __future__ import annotations

import asyncio
import sys
import time
from pathlib import Path
from typing import IO

from pgleaderlock.testing.beliefs import BeliefLog
from pgleaderlock.testing.candidate import CandidateEvent, CandidateProcess

__all__ = ["WORKER", "FencedWorker"]

WORKER = Path(__file__).parent.parent / "faults" / "fenced_worker.py"


class FencedWorker(CandidateProcess):
    """A ``fenced_worker.py`` child, observed like a candidate process."""

    def __init__(
        self,
        name: str,
        dsn: str,
        keys: tuple[int, int],
        args: list[str],
        stderr: IO[str],
        beliefs: BeliefLog | None = None,
    ) -> None:
        super().__init__(name, dsn, *keys, stderr=stderr, beliefs=beliefs)
        self.args = args

    def argv(self) -> list[str]:
        return [
            sys.executable,
            str(WORKER),
            f"--key1={self.keys[0]}",
            f"--key2={self.keys[1]}",
            f"--name={self.name}",
            *self.args,
        ]

    async def first(
        self, events: tuple[str, ...], since: float, timeout_s: float = 10.0
    ) -> CandidateEvent:
        """The first of ``events`` at or after ``since`` (polled, bounded)."""
        deadline = time.monotonic() + timeout_s
        while True:
            found = [e for e in self.events if e.event in events and e.t >= since]
            if found:
                return found[0]
            assert time.monotonic() < deadline, f"{self.name}: none of {events}: {self._tail()}"
            await asyncio.sleep(0.01)
