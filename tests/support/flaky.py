"""``Flaky``: a job (a leader task, a Coordinator's worker) that crashes on its first
calls, then runs until it is cancelled; for the tests of restarting it."""

from __future__ import annotations

import asyncio


class Flaky:
    """``run`` raises ``RuntimeError(f"{message} {n}")`` on calls 1 to ``crashes``; the
    next call sets ``running`` and waits until it is cancelled. ``calls`` counts them."""

    def __init__(self, crashes: int, message: str) -> None:
        self.crashes = crashes
        self.message = message
        self.calls = 0
        self.running = asyncio.Event()

    async def run(self, *_context: object) -> None:
        self.calls += 1
        if self.calls <= self.crashes:
            raise RuntimeError(f"{self.message} {self.calls}")
        self.running.set()
        await asyncio.Event().wait()
