"""The ring watch: each member waits on the server for the next member's lock, around
the ring of members; when it is granted, that member is gone, known at once."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

from ..lowlevel import SessionSlot, WaitingSession, can, get_logger
from .events import GroupEvent, MemberGone
from .membership import Membership
from .protocol import Key, member_key
from .session import Sessions

__all__ = ["RingWatch"]

log = get_logger("pgleaderlock.coordination")

WATCH_WAIT_S = 0.5
"""How long one wait of the ring watch lasts before it looks at the ring again (a new
member is watched from then on)."""


class RingWatch:
    """Watches the next member of the ring, on a session of its own.

    Args:
        membership: the group's members as last seen (told of a member gone).
        sessions: opens the watch session.
        post: puts a `MemberGone` on the member's loop.
        fields: added to every log record.
    """

    def __init__(
        self,
        membership: Membership,
        sessions: Sessions,
        post: Callable[[GroupEvent], None],
        fields: dict[str, Any],
    ) -> None:
        self.group, self.member = membership.group, membership.member
        self._membership = membership
        self._sessions = sessions
        self._post = post
        self._fields = fields
        self._watched: Key | None = None  # the member lock the watch session waits for

    async def watch_forever(self) -> None:
        """Wait on the server for the next member's lock, around the ring of members;
        when it is granted, that member is gone: tell the loop (which tells the group)."""
        slot = self._sessions.slot("watch")
        try:
            while True:
                await self._watch_once(slot)
        finally:
            await slot.close()

    async def _watch_once(self, slot: SessionSlot) -> None:
        ring = sorted(self._membership.members | {self.member})
        successor = ring[(ring.index(self.member) + 1) % len(ring)]
        if successor == self.member:
            await slot.close()  # alone: nobody to watch
            await asyncio.sleep(WATCH_WAIT_S)
            return
        key = member_key(self.group, successor)
        if key != self._watched:
            # A wait on the server may outlive the call that started it (see
            # BaseSession.wait_lock): a new successor gets a new session.
            await slot.close()
            self._watched = key
        sessions = self._sessions
        try:
            session = slot.session or await sessions.open(slot)
            if not can(session, WaitingSession):
                await asyncio.sleep(WATCH_WAIT_S)
                return
            wait = _wait(session, key)
            bound = WATCH_WAIT_S + sessions.settings.config.command_timeout_s
            if await sessions.bounded(slot, wait, bound):
                await sessions.bounded(slot, _unlock(session, key))
                log.info("member_died", dead=successor, **self._fields)
                self._membership.gone(successor)
                self._post(MemberGone(successor, seen_here=True))
        except Exception as exc:
            log.warning("watch_failed", error=repr(exc), **self._fields)
            await slot.close()
            await asyncio.sleep(WATCH_WAIT_S)


async def _wait(session: Any, key: Key) -> bool:
    granted: bool = await session.wait_lock(key[0], key[1], WATCH_WAIT_S)
    return granted


async def _unlock(session: Any, key: Key) -> None:
    await session.unlock(*key)
