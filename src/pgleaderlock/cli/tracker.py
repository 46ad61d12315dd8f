"""What the command line learns about its lock while it runs, beyond its statistics.

The counters the commands need (attempts that found the lock taken, the last database
error) come from [`LeaderLock.statistics()`][pgleaderlock.LeaderLock.statistics].
`Tracker` is a plugin registered on the lock for what statistics do not hold: whether
the server was ever reached (an attempt began), the moments of a loss and of the stop
(to wait on), and which attempt of a series that finds the lock taken is logged at INFO.
"""

from __future__ import annotations

import asyncio

from ..lowlevel import LeaderLock, LockState, hookimpl
from .logs import log

__all__ = ["Tracker"]


class Tracker:
    """A plugin that tells the CLI what the lock is doing."""

    def __init__(self) -> None:
        # Statistics count attempts but not whether one ever began (a server that was
        # never reached is a configuration problem): this is the CLI's own bookkeeping.
        self.reached_server = False
        self.lost = asyncio.Event()
        self.stopped = asyncio.Event()
        self._busy = False

    @hookimpl
    def pgleaderlock_state_change(self, new: LockState) -> None:
        """Note that the server was reached (an attempt only starts on an open session)."""
        if new is LockState.ACQUIRING:
            self.reached_server = True

    @hookimpl
    def pgleaderlock_acquire_failed(self, lock: LeaderLock, attempt: int) -> None:
        """Log the first attempt of a series that found the lock taken (the rest: debug)."""
        level = "DEBUG" if self._busy else "INFO"
        self._busy = True
        log(level, "lock_busy", lock=lock.label, attempt=attempt, holder="another session")

    @hookimpl
    def pgleaderlock_acquired(self) -> None:
        """Reset the busy series."""
        self._busy = False

    @hookimpl
    def pgleaderlock_lost(self) -> None:
        """Leadership that was held is gone."""
        self.lost.set()

    @hookimpl
    def pgleaderlock_stopped(self) -> None:
        """The lock reached STOPPED."""
        self.stopped.set()
