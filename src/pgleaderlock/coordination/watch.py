"""The ring watch: each member waits on the server for the next member's lock, around
the ring of members; when it is granted, that member is gone, known at once."""

from __future__ import annotations

import asyncio
from typing import Any

from ..lowlevel import SessionSlot, WaitingSession, can, get_logger
from .events import MemberGone
from .membership import Wiring
from .protocol import Key, Message, channel, member_key

__all__ = ["RingWatch"]

log = get_logger("pgleaderlock.coordination")

WATCH_WAIT_S = 0.5
"""How long one wait of the ring watch lasts before it looks at the ring again (a new
member is watched from then on)."""
AFTER_DEATH_S = 0.1
"""After a death, how long the watch waits before it watches the next member: the
survivors are taking the dead member's names, and the next member's watch opens a
session (a connection) of its own. A death meanwhile is seen as it resumes (that lock
is free then)."""


class RingWatch:
    """Watches the next member of the ring, on a session of its own.

    Args:
        wiring: the group's members as last seen (told of a member gone), the watch
            session's opener, the member's loop (told `MemberGone`), the log fields.
    """

    def __init__(self, wiring: Wiring) -> None:
        self._membership, self._sessions, self._post, self._fields = wiring
        self.group, self.member = wiring.membership.group, wiring.membership.member
        self._watched: Key | None = None  # the member lock the watch session waits for
        self._channel = channel(self.group)

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
                self._membership.gone(successor)
                # The loop takes this member's share while this session tells the others.
                self._post(MemberGone(successor, seen_here=True, told=True))
                if not await self._tell(slot, session, successor):
                    self._post(MemberGone(successor, seen_here=True))  # the loop tells them
                log.info("member_died", dead=successor, **self._fields)
                await sessions.bounded(slot, _unlock(session, key))
                await asyncio.sleep(AFTER_DEATH_S)
        except Exception as exc:
            log.warning("watch_failed", error=repr(exc), **self._fields)
            await slot.close()
            await asyncio.sleep(WATCH_WAIT_S)

    async def _tell(self, slot: SessionSlot, session: Any, dead: str) -> bool:
        """Tell the group that ``dead`` is gone, from the watch session, which has just
        seen it: the others take their shares of its names a hop sooner than if the
        member's loop told them, on its hold session. False if that failed."""
        try:
            for payload in Message("left", self.member, dead).payloads():
                await self._sessions.bounded(slot, session.notify(self._channel, payload))
        except Exception as exc:
            log.warning("notify_failed", kind="left", error=repr(exc), **self._fields)
            return False
        return True


async def _wait(session: Any, key: Key) -> bool:
    granted: bool = await session.wait_lock(key[0], key[1], WATCH_WAIT_S)
    return granted


async def _unlock(session: Any, key: Key) -> None:
    await session.unlock(*key)
