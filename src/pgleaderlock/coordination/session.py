"""What a [`Coordinator`][pgleaderlock.Coordinator] needs of a session, beyond a lock's:
many locks at once, a view of a group's sessions and locks, and notifications.

The built-in backends implement it (``pgleaderlock.backends.BaseSession``); a third-party
backend that does not can still serve locks, not a Coordinator.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol, runtime_checkable

from ..core import FencedSessions, TableSession, TermTable

__all__ = ["GroupSession"]


@runtime_checkable
class GroupSession(TableSession, Protocol):
    """Optional capability, needed by a [`Coordinator`][pgleaderlock.Coordinator]: many
    locks on one session, a view of a group's sessions and locks, and notifications."""

    async def try_lock_many(self, keys: list[tuple[int, int]]) -> list[tuple[int, int]]:
        """``pg_try_advisory_lock`` for each of ``keys``: those granted now."""
        ...

    async def unlock_many(self, keys: list[tuple[int, int]]) -> int:
        """``pg_advisory_unlock`` for each of ``keys``: how many this session held."""
        ...

    async def bump_terms(
        self, table: TermTable, keys: list[tuple[int, int]], wait_s: float
    ) -> dict[tuple[int, int], int] | None:
        """Increment the fencing terms of ``keys`` (see ``FencingSession``); ``None``
        when fenced transactions of older terms still hold a row after ``wait_s``."""
        ...

    async def end_fenced(self, table: TermTable, keys: list[tuple[int, int]]) -> FencedSessions:
        """End the fenced transactions of older terms of ``keys`` (see
        ``FencingSession``)."""
        ...

    async def group_snapshot(self, prefix: str, trusted_roles: Sequence[str] = ()) -> list[Any]:
        """Rows ``(application_name, pid, key1_oid, key2_oid, granted, trusted)``: one
        for every two-key advisory lock held or waited for (by any session), and one
        with NULL keys for every session whose ``application_name`` starts with
        ``prefix``; ``trusted``: the session's role is this session's own, a superuser,
        or one of ``trusted_roles``."""
        ...

    async def notify(self, channel: str, payload: str) -> None:
        """``pg_notify(channel, payload)``."""
        ...

    async def holds(self, key1: int, key2: int) -> bool:
        """As [`LockSession.holds`][pgleaderlock.LockSession.holds]."""
        ...

    async def listen(self, channel: str) -> None:
        """``LISTEN channel`` (the session does nothing else afterwards but
        ``notifications`` and ``ping``)."""
        ...

    async def notifications(self, timeout_s: float) -> list[tuple[int, str]]:
        """The notifications received, as (the sending backend's pid, payload): those
        already in, or else the first to come within ``timeout_s`` (an empty list if
        none). Raises once the session is lost."""
        ...

    async def ping(self) -> None:
        """Check that the session answers (raises if not)."""
        ...
