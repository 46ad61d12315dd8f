"""A member's messages: what it sends the group (``NOTIFY`` on the member lock's
session), and what it receives (a session of its own that ``LISTEN``s), checked to come
from a member of a trusted role before the loop acts on it."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import time
from collections.abc import Callable
from typing import Any

from ..lowlevel import SessionSlot, get_logger
from .events import GroupEvent, Look, Received
from .membership import Membership
from .protocol import Message, channel
from .session import GroupSession, Sessions

__all__ = ["Mailbox"]

log = get_logger("pgleaderlock.coordination")

STRANGER_S = 60.0
"""How long the listener refuses the messages of a session that is not a trusted
member's without looking at the group's sessions again."""


class Mailbox:
    """Sends and receives the group's messages.

    Args:
        membership: the member lock, whose session sends, and which knows the group's
            sessions (the senders whose messages count).
        sessions: opens the listening session.
        post: puts an event on the member's loop (each message received, and a look
            whenever some may have been missed).
        arrived: told of each message as it arrives, before the loop gets to it.
        missed: told when messages may have been missed (the listening session was
            lost): answers awaited may never come.
        fields: added to every log record.
    """

    def __init__(
        self,
        membership: Membership,
        sessions: Sessions,
        post: Callable[[GroupEvent], None],
        arrived: Callable[[Message], None],
        missed: Callable[[], None],
        fields: dict[str, Any],
    ) -> None:
        self.settings = membership.settings
        self.channel = channel(self.settings.group)
        self.listening = asyncio.Event()
        self._membership = membership
        self._sessions = sessions
        self._post = post
        self._arrived = arrived
        self._missed = missed
        self._fields = fields
        self._senders_read_at = 0.0
        self._strangers: dict[int, float] = {}  # pid -> when found not to be a member's

    # ------------------------------------------------------------------ sending

    async def notify(self, message: Message) -> None:
        """Send ``message`` to the group."""
        for payload in message.payloads():
            await self._membership.call(
                functools.partial(_notify, channel=self.channel, payload=payload)
            )

    async def announce(self, message: Message) -> None:
        """``notify``, for news that nobody's safety depends on: a failure is logged."""
        try:
            await self.notify(message)
        except Exception as exc:
            log.warning("notify_failed", kind=message.kind, error=repr(exc), **self._fields)

    # ------------------------------------------------------------------ receiving

    async def listening_within(self, timeout_s: float) -> None:
        """Wait until `listen_forever` listens, at most ``timeout_s``."""
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(timeout_s):
                await self.listening.wait()

    async def listen_forever(self) -> None:
        """Feed the group's notifications into the loop, reconnecting as needed; a
        quiet session is pinged every ``health_interval_s``."""
        sessions = self._sessions
        slot = sessions.slot("listen")
        config = self.settings.config
        attempt = 0
        while True:
            try:
                session = await sessions.open(slot)
                await sessions.bounded(slot, session.listen(self.channel))
                self.listening.set()
                self._post(Look())  # what was held back may go now
                attempt = 0
                while True:
                    wait = config.health_interval_s
                    received = await sessions.bounded(
                        slot, session.notifications(wait), wait + config.command_timeout_s
                    )
                    received_at = time.monotonic()
                    for pid, payload in received:
                        message = Message.parse(payload)
                        if message is not None and await self._sent_by_member(
                            slot, session, pid, message, received_at
                        ):
                            self._arrived(message)
                            self._post(Received(message))
                    if not received:
                        await sessions.bounded(slot, session.ping(), config.health_timeout_s)
            except asyncio.CancelledError:
                await slot.close()
                raise
            except Exception as exc:
                attempt += 1
                log.warning("listen_failed", error=repr(exc), attempt=attempt, **self._fields)
            self.listening.clear()
            await slot.close()
            self._missed()  # their answers may have been missed: ask again
            self._post(Look())  # notifications may have been missed
            await asyncio.sleep(min(self.settings.balance_interval_s * (attempt - 1), 5.0))

    async def _sent_by_member(
        self,
        slot: SessionSlot,
        session: GroupSession,
        pid: int,
        message: Message,
        received_at: float,
    ) -> bool:
        """Whether ``message`` comes from its sender: from a session of the sender
        member (by its name) whose role is trusted. Any role may ``NOTIFY`` on the
        group's channel; a message from anyone else is refused, and its session's
        messages for ``STRANGER_S`` with it. A sender not seen yet (a member that just
        joined) is looked for in the group's sessions once more, on the listening
        session, unless they were read after the message came: a session's name is
        visible from its start."""
        membership = self._membership
        if membership.senders.get(pid) == message.sender:
            return True
        now = time.monotonic()
        stranger_since = self._strangers.get(pid)
        if stranger_since is not None and now - stranger_since < STRANGER_S:
            return False
        if self._senders_read_at < received_at:
            self._senders_read_at = now
            membership.senders = membership.members_by_pid(
                await self._sessions.bounded(slot, membership.read_group(session))
            )
            if membership.senders.get(pid) == message.sender:
                return True
        if len(self._strangers) >= 1024:
            self._strangers = {p: at for p, at in self._strangers.items() if now - at < STRANGER_S}
        self._strangers[pid] = now
        log.warning("message_refused", pid=pid, kind=message.kind, sender=message.sender,
                    **self._fields)  # fmt: skip
        return False


async def _notify(session: GroupSession, *, channel: str, payload: str) -> None:
    await session.notify(channel, payload)
