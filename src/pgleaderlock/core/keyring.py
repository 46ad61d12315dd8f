"""Which advisory lock a lock's session takes: the runner's one hook point for locks that
hold one of several keys (a [`Semaphore`][pgleaderlock.Semaphore]).

A [`LeaderLock`][pgleaderlock.LeaderLock] takes its one pair of keys
([`FixedKeys`][pgleaderlock.core.keyring.FixedKeys]). A keyring decides *which* lock an
acquisition call takes and says which one the session holds afterwards; the machine
decides *when* (it never sees keys), and the runner's probes, unlock and fencing calls
use [`held`][pgleaderlock.core.keyring.Keyring.held].
"""

from __future__ import annotations

from typing import Protocol

from .session import LockSession, WaitingSession

__all__ = ["FixedKeys", "Keyring"]


class Keyring(Protocol):
    """What the runner asks of a lock's keys."""

    @property
    def held(self) -> tuple[int, int]:
        """The keys the session holds (or last held): what a probe, an unlock and a
        fencing term use."""
        ...

    async def try_lock(self, session: LockSession) -> bool:
        """One acquisition attempt that never waits: True if the session now holds one
        lock (then [`held`][pgleaderlock.core.keyring.Keyring.held] names it)."""
        ...

    async def wait_lock(self, session: WaitingSession, wait_s: float) -> bool:
        """An attempt that may take ``wait_s`` seconds: True once the session holds one
        lock, False when ``wait_s`` has passed without."""
        ...

    @property
    def waits_on_server(self) -> bool:
        """Does `wait_lock` wait on the server (``WaitingSession.wait_lock``, which asks
        the server to cancel a wait that is cut short)? Otherwise it runs plain
        statements (tries), which the runner drops the session under before it cuts
        them short: a driver that cancels a statement on the server waits for that,
        for seconds on a bad network."""
        ...


class FixedKeys:
    """One pair of keys, as a [`LeaderLock`][pgleaderlock.LeaderLock] has."""

    __slots__ = ("held",)

    waits_on_server = True

    def __init__(self, key1: int, key2: int) -> None:
        self.held = (key1, key2)

    async def try_lock(self, session: LockSession) -> bool:
        return bool(await session.try_lock(*self.held))

    async def wait_lock(self, session: WaitingSession, wait_s: float) -> bool:
        return bool(await session.wait_lock(*self.held, wait_s))
