"""A member's side of the balance protocol (the rules are `balance`'s): the tick that
takes free names and asks for more, the answer to another member's request, and the
names not this member's to take meanwhile (handed to another, or given away)."""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Mapping
from typing import Any, Protocol

from ..lowlevel import get_logger
from . import balance
from .events import GroupEvent, Look
from .mailbox import Mailbox
from .membership import Membership
from .protocol import Key, Message

__all__ = ["Balancer", "Names"]

log = get_logger("pgleaderlock.coordination")

RECENT_GRANT_S = 1.0
"""How long a name granted to another member is left for that member to take."""
ANSWER_WAIT_S = 2.0
"""How long a member waits for the answer to a request before it asks that member
again (an answer normally comes within milliseconds: a grant, or an empty ``done``)."""


class Names(Protocol):
    """What the balancer asks of the session mode: how this member leads names."""

    def held(self) -> set[Key]:
        """The keys this member leads now."""
        ...

    def to_take(self, view: balance.View) -> list[Key]:
        """The free names this member should take now."""
        ...

    async def take(self, keys: list[Key], *, handoff: bool) -> list[Key]:
        """Take ``keys`` (free, or granted to this member); return those now led here
        (with dedicated sessions: none known yet, the locks compete)."""
        ...

    async def give(self, keys: list[Key], to: str) -> int:
        """Hand ``keys`` to member ``to``; return how many were handed over."""
        ...

    async def standby(self, view: balance.View) -> bool:
        """Decide, from ``view``, which names this member stands by for; True if that
        is not settled yet."""
        ...

    def pending(self) -> bool:
        """Something waits for a later tick."""
        ...


class Balancer:
    """Takes, asks for and gives names, so that the group stays even.

    Args:
        names: the session mode (takes and gives names).
        registered: the names registered here, by key (read, never changed here).
        membership: reads the group's view.
        mailbox: sends requests and answers.
        post: puts an event on the member's loop.
        fields: added to every log record.
    """

    def __init__(
        self,
        names: Names,
        registered: Mapping[Key, str],
        membership: Membership,
        mailbox: Mailbox,
        post: Callable[[GroupEvent], None],
        fields: dict[str, Any],
    ) -> None:
        self.member = membership.member
        self._names = names
        self._registered = registered
        self._membership = membership
        self._mailbox = mailbox
        self._post = post
        self._fields = fields
        # key -> (until (monotonic), for whom): not this member's to take meanwhile; ""
        # for anyone else (a name given away), else the member it was handed to
        self.excluded: dict[Key, tuple[float, str]] = {}
        self.moves = 0  # names handed to other members, for statistics
        self.unsettled = True
        self.outside = False  # some names are held outside the group
        self._asked: dict[str, float] = {}  # member -> until: a request awaits its answer

    def note(self, message: Message) -> None:
        """What must count before the loop gets to ``message``: names handed to another
        member are not this one's to take, even in a snapshot read meanwhile."""
        if message.kind in ("handoff", "grant") and message.to not in ("", self.member):
            until = time.monotonic() + RECENT_GRANT_S
            self.excluded.update(dict.fromkeys(message.keys, (until, message.to)))

    def answered(self, member: str) -> None:
        """``member`` answered this member's request."""
        self._asked.pop(member, None)

    def forget_requests(self) -> None:
        """Answers may have been missed: ask again."""
        self._asked.clear()

    async def on_request(self, message: Message) -> None:
        """Give what keeps the two members within balance; always answer (an empty
        ``done``), so that the requester may ask again. A request from a member not in
        the last view (a joiner whose "join" is queued behind its request) is weighed
        against a fresh view: the fair share counts the joiner."""
        membership = self._membership
        if message.sender not in membership.members:
            try:
                await membership.snapshot()
            except Exception as exc:  # the last view, then: the next request asks again
                log.warning("group_snapshot_failed", error=repr(exc), **self._fields)
        held = self._names.held()
        seen = membership.view.members.get(message.sender, 0)
        mine, theirs = len(held), max(message.count, seen)
        floor = len(self._registered) // max(1, len(membership.members))
        give: list[Key] = []
        for key in message.keys:
            if key in held and balance.should_grant(mine, theirs, floor):
                give.append(key)
                mine, theirs = mine - 1, theirs + 1
        if give:
            log.info("names_given", to=message.sender, count=len(give), **self._fields)
            self.moves += await self._names.give(give, message.sender)
            self._post(Look("changed"))  # look again: the view moved
        else:
            await self._mailbox.announce(Message("done", self.member, message.sender))

    async def tick(self) -> None:
        """Look at the group: take what is free and this member's, stand by, and ask
        for names while this member leads fewer than another."""
        membership = self._membership
        try:
            view = await membership.snapshot()
        except Exception as exc:
            log.warning("group_snapshot_failed", error=repr(exc), **self._fields)
            self.unsettled = True
            return
        now = time.monotonic()
        self.excluded = {  # over once the receiver took it, or is gone
            k: (until, to)
            for k, (until, to) in self.excluded.items()
            if until > now and (not to or (to in view.members and view.holders.get(k) != to))
        }
        take = [k for k in self._names.to_take(view) if k not in self.excluded]
        taken = await self._names.take(take, handoff=False) if take else []
        if taken:  # no second read of the lock table: the view, as it is now
            holders = {**view.holders, **dict.fromkeys(taken, self.member)}
            view = membership.remember(
                dataclasses.replace(view, holders=holders), membership.view.others
            )
        unsettled = await self._names.standby(view)
        # Ask only while listening: the answer (a grant) would be missed otherwise.
        listening = self._mailbox.listening.is_set()
        asks = balance.requests(view) if listening else {}
        count = view.counts().get(self.member, 0)
        self._asked = {m: until for m, until in self._asked.items() if until > now}
        for giver, keys in asks.items():
            if giver not in self._asked:  # one request at a time per giver
                self._asked[giver] = now + ANSWER_WAIT_S
                await self._mailbox.notify(
                    Message("request", self.member, giver, tuple(keys), count)
                )
        self.unsettled = bool(
            take
            or asks
            or unsettled
            or view.free()
            or self._names.pending()
            or not self._mailbox.listening.is_set()
        )
        self.outside = "" in view.holders.values()
