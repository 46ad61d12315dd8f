"""What the command line learns about its lock while it runs: the one place it counts.

:class:`Tracker` is a plugin registered on the lock. The commands read it to choose an
exit code (was the server ever reached? did an attempt find the lock taken? which error
came last?) and to wait for a loss or a stop. When ``LeaderLock.statistics()`` exists,
the counters here should come from it instead; the events (``lost``, ``stopped``) stay.
"""

from __future__ import annotations

import asyncio

from ..core.hooks import hookimpl
from ..core.lock import LeaderLock
from ..core.models import LockState
from .logs import log

__all__ = ["Tracker"]


class Tracker:
    """A plugin that tells the CLI what the lock is doing."""

    def __init__(self) -> None:
        self.reached_server = False  # a session was opened at least once
        self.held_elsewhere = 0  # attempts that found the lock taken
        self.errors: list[Exception] = []
        self.lost = asyncio.Event()
        self.stopped = asyncio.Event()
        self._busy = False

    @property
    def last_error(self) -> Exception | None:
        """The most recent error the lock reported, if any."""
        return self.errors[-1] if self.errors else None

    @hookimpl
    def pgleaderlock_state_change(self, new: LockState) -> None:
        """Note that the server was reached (an attempt only starts on an open session)."""
        if new is LockState.ACQUIRING:
            self.reached_server = True

    @hookimpl
    def pgleaderlock_acquire_failed(self, lock: LeaderLock, attempt: int) -> None:
        """Log the first attempt of a series that found the lock taken (the rest: debug)."""
        self.held_elsewhere += 1
        level = "DEBUG" if self._busy else "INFO"
        self._busy = True
        log(level, "lock_busy", lock=lock.label, attempt=attempt, holder="another session")

    @hookimpl
    def pgleaderlock_acquired(self) -> None:
        """Reset the busy series."""
        self._busy = False

    @hookimpl
    def pgleaderlock_error(self, error: Exception) -> None:
        """Remember errors, for the exit code."""
        self.errors.append(error)

    @hookimpl
    def pgleaderlock_lost(self) -> None:
        """Leadership that was held is gone."""
        self.lost.set()

    @hookimpl
    def pgleaderlock_stopped(self) -> None:
        """The lock reached STOPPED."""
        self.stopped.set()
