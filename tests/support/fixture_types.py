"""The types of the shared fixtures (tests/conftest.py, fix_db.py, fix_locks.py), named
once: a test's signature says ``recorder: MakeRecorder`` rather than spelling the
callable out again."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Protocol

from pgleaderlock import LeaderLock

if TYPE_CHECKING:
    from conftest import Recorder

__all__ = ["Figures", "LockPids", "MakeLock", "MakeRecorded", "MakeRecorder", "Terminate"]

MakeLock = Callable[..., LeaderLock]
"""``make_lock(**options)``."""
MakeRecorder = Callable[[LeaderLock], "Recorder"]
"""``recorder(lock)``."""
MakeRecorded = Callable[..., tuple[LeaderLock, "Recorder"]]
"""``recorded(**options)``: ``make_lock(**options)`` and its ``recorder``."""
LockPids = Callable[[int, int], Awaitable[list[int]]]
"""``holders(key1, key2)`` and ``waiters(key1, key2)``: backend pids, from pg_locks."""
Terminate = Callable[[int | None], Awaitable[None]]
"""``terminate(pid)``."""


class Figures(Protocol):
    """``figures(metric, value, unit="s")``."""

    def __call__(self, metric: str, value: float, unit: str = "s") -> None: ...
