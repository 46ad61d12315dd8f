"""The lifecycle task's one session: opened through a backend or ``connect_fn``, closed
within a bound, aborted synchronously, watched while idle.

A slot holds at most one [`LockSession`][pgleaderlock.LockSession]. It decides nothing:
the machine says when to open, close or watch, and the runner asks the slot.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any, cast

from ._logging import StructuredLogger
from .registry import wrap_connection
from .session import (
    AbortableSession,
    Backend,
    ConnectOptions,
    LockSession,
    SessionFactory,
    WatchableSession,
)

__all__ = ["SessionSlot", "can"]

CLOSE_TIMEOUT_S = 5.0

_CAPABILITIES: dict[tuple[type, type], bool] = {}


def can(session: object, capability: type) -> bool:
    """``isinstance(session, capability)`` for the optional session capabilities, cached
    per class: a runtime protocol check costs microseconds on every call otherwise."""
    key = (type(session), capability)
    found = _CAPABILITIES.get(key)
    if found is None:
        found = _CAPABILITIES[key] = isinstance(session, capability)
    return found


class SessionSlot:
    """Where the lock's current session lives.

    Args:
        backend: opens sessions with `dsn` and `options`; `None` with `connect_fn`.
        dsn: the DSN (or engine) the backend accepts.
        options: what every session is opened with.
        connect_fn: the user's factory; its result is wrapped into a
            [`LockSession`][pgleaderlock.LockSession]. Overrides `backend`.
        log: the lock's logger.
        fields: added to every log record.
    """

    def __init__(
        self,
        *,
        backend: Backend | None,
        dsn: Any,
        options: ConnectOptions,
        connect_fn: SessionFactory | None,
        log: StructuredLogger,
        fields: dict[str, Any],
    ) -> None:
        self._backend, self._dsn, self._options = backend, dsn, options
        self._connect_fn = connect_fn
        self._log, self._fields = log, fields
        self.session: LockSession | None = None

    @property
    def backend_pid(self) -> int | None:
        return self.session.backend_pid if self.session is not None else None

    async def open(self) -> LockSession:
        """Open a session and keep it (the caller bounds the time this takes)."""
        if self._connect_fn is not None:
            session = wrap_connection(await self._connect_fn())
        else:
            assert self._backend is not None
            session = await self._backend.connect(self._dsn, self._options)
        self.session = session
        self._log.debug(
            "session_opened",
            backend_pid=session.backend_pid,
            application_name=self._options.application_name,
            **self._fields,
        )
        return session

    async def close(self) -> None:
        """Close the session, if any (which frees its locks on the server)."""
        session, self.session = self.session, None
        if session is None:
            return
        try:
            async with asyncio.timeout(CLOSE_TIMEOUT_S):
                await session.close()
        except Exception as exc:  # close() must not raise; be defensive anyway
            self._log.warning("session_close_failed", error=repr(exc), **self._fields)

    def abort(self) -> None:
        """Drop the session's connection synchronously (see
        [`AbortableSession`][pgleaderlock.backends.AbortableSession])."""
        session = self.session
        if session is not None and can(session, AbortableSession):
            try:
                cast(AbortableSession, session).abort()
            except Exception as exc:  # abort() must not raise; be defensive anyway
                self._log.warning("session_abort_failed", error=repr(exc), **self._fields)

    def watch(self, callback: Callable[[], None]) -> None:
        """Call ``callback`` once the idle session's socket becomes readable, if the
        session can be watched (any call on the session removes the watch)."""
        session = self.session
        if session is not None and can(session, WatchableSession):
            cast(WatchableSession, session).watch(callback)
