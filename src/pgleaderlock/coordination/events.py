"""What a member's loop is told, one event at a time (``Engine.events``).

Most events end with a fresh look at the group (a tick: snapshot, take, ask): `Look`,
a name added, a member gone. The others are handled alone.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Literal

from .protocol import Message

__all__ = ["Broken", "GroupEvent", "Look", "MemberGone", "NameEvent", "Received", "Stop"]


@dataclass(frozen=True)
class Look:
    """Look at the group again: the tick came, someone said that it changed, or this
    member (re)``joined`` (its hold session leads)."""

    why: Literal["tick", "join", "leave", "released", "changed", "joined"] = "tick"


@dataclass(frozen=True)
class NameEvent:
    """Something happened to one of this member's names: ``added`` while running (then
    a look), its worker ``crashed`` too often (give the name away), or ``removed``
    (stop competing, release it, then resolve ``done``)."""

    what: Literal["added", "crashed", "removed"]
    name: str
    done: asyncio.Future[None] | None = field(default=None, compare=False)


@dataclass(frozen=True)
class MemberGone:
    """A member is gone: its names are free (then a look). ``seen_here``: this
    member's ring watch saw it die, and tells the group (``told``: it has already)."""

    member: str
    seen_here: bool = False
    told: bool = False


@dataclass(frozen=True)
class Received:
    """A message from a member of the group (checked: see ``Mailbox._sent_by_member``)."""

    message: Message


@dataclass(frozen=True)
class Broken:
    """A lock of the member (its member lock, or in dedicated mode a name's) stopped on
    an error retrying cannot mend: the member stops with it."""

    error: BaseException


@dataclass(frozen=True)
class Stop:
    """``Coordinator.shutdown()``."""


GroupEvent = Look | NameEvent | MemberGone | Received | Broken | Stop


def looks(event: GroupEvent) -> bool:
    """Does the loop look at the group after ``event``?"""
    return isinstance(event, Look | MemberGone) or (
        isinstance(event, NameEvent) and event.what == "added"
    )
