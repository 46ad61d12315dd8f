"""What a [`Coordinator`][pgleaderlock.Coordinator] needs of a session, beyond a lock's:
many locks at once, a view of a group's sessions and locks, and notifications; and how
a member opens the sessions it keeps besides its member lock's (listen, watch).

The built-in backends implement it (``pgleaderlock.backends.BaseSession``); a third-party
backend that does not can still serve locks, not a Coordinator.
"""

from __future__ import annotations

from collections.abc import Awaitable, Sequence
from typing import Any, Protocol, TypeVar, cast, runtime_checkable

from ..lowlevel import (
    ConfigurationError,
    ConnectOptions,
    FencedSessions,
    SessionSlot,
    TableSession,
    TermTable,
    bounded,
    can,
    get_logger,
    session_settings,
)
from .protocol import Role, app_name
from .settings import Settings

__all__ = ["GroupSession", "Sessions", "group_session"]

log = get_logger("pgleaderlock.coordination")

T = TypeVar("T")


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


def group_session(session: object) -> GroupSession:
    """``session``, which must be able to serve a group.

    Raises:
        ConfigurationError: its backend has no ``GroupSession`` capability.
    """
    if not can(session, GroupSession):
        raise ConfigurationError(
            f"{type(session).__name__} sessions cannot serve a Coordinator "
            "(no GroupSession capability)"
        )
    return cast(GroupSession, session)


class Sessions:
    """Opens a member's sessions of a ``role`` (connected, checked, bounded as a
    lock's), and bounds the calls on them."""

    def __init__(self, settings: Settings, fields: dict[str, Any]) -> None:
        self.settings = settings
        self._fields = fields

    def options(self, role: Role) -> ConnectOptions:
        settings = self.settings
        return ConnectOptions(
            application_name=app_name(settings.group, settings.member, role),
            connect_timeout_s=settings.config.connect_timeout_s,
            server_settings=session_settings(settings.config),
            lease_s=settings.config.lease_s,
            claim_s=settings.config.claim_s,
        )

    def slot(self, role: Role) -> SessionSlot:
        return SessionSlot(
            backend=self.settings.backend,
            dsn=self.settings.dsn,
            options=self.options(role),
            connect_fn=self.settings.connect_fn,
            log=log,
            fields=self._fields,
        )

    async def open(self, slot: SessionSlot) -> GroupSession:
        """Open a checked session (bounded); it must be able to serve a group."""
        budget = self.settings.config.connect_budget_s or 30.0
        session = await self.bounded(slot, slot.open(), budget)
        try:
            return group_session(session)
        except ConfigurationError:
            await slot.close()
            raise

    def bounded(
        self, slot: SessionSlot, call: Awaitable[T], timeout_s: float | None = None
    ) -> Awaitable[T]:
        """``call`` on ``slot``'s session within ``timeout_s`` (default
        ``command_timeout_s``), as a lock's calls are: the core's
        [`bounded`][pgleaderlock.core.calls.bounded] (the session is dropped before the
        call is cancelled).

        Raises:
            TimeoutError: the call took longer.
        """
        return bounded(call, timeout_s or self.settings.config.command_timeout_s, slot.abort)
