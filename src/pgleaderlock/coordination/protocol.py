"""How a group's replicas find and talk to each other, through PostgreSQL alone.

No table: every session a Coordinator opens is named
``pgl:<group>:<member>:<role>`` (its ``application_name``), so ``pg_stat_activity``
lists the group's live members, and ``pg_locks`` shows which member holds (or waits for)
which name's lock; both are visible to every role. Replicas tell each other what they
do with ``NOTIFY`` on the group's channel: short JSON messages, lost by nobody who
listens, and never needed for safety (the locks decide who leads).
"""

from __future__ import annotations

import functools
import hashlib
import json
import re
import secrets
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Literal, get_args

from ..lowlevel import ConfigurationError, check_name, lock_keys

__all__ = [
    "Key",
    "Message",
    "app_name",
    "channel",
    "check_group",
    "checkpoint_name",
    "member_key",
    "name_keys",
    "new_member_id",
    "parse_app_name",
    "prefix",
]

Key = tuple[int, int]
"""A lock's two keys."""

Role = Literal["hold", "watch", "listen", "lock", "util"]

_GROUP = re.compile(r"^[A-Za-z0-9_.-]{1,32}$")
_PAYLOAD_MAX = 7900  # pg_notify takes 8000 bytes


def check_group(group: object) -> str:
    """A group name: 1-32 letters, digits, ``_``, ``.``, ``-`` (it goes into every
    session's ``application_name``, which PostgreSQL cuts at 63 bytes).

    Raises:
        ConfigurationError: anything else.
    """
    if not isinstance(group, str) or not _GROUP.fullmatch(group):
        raise ConfigurationError(
            f"group must be 1-32 letters, digits, '_', '.' or '-', got {group!r}"
        )
    return group


def new_member_id() -> str:
    """A member's id: random, so that a restarted process is a new member."""
    return secrets.token_hex(6)


def prefix(group: str) -> str:
    """The ``application_name`` prefix of every session of ``group``."""
    return f"pgl:{group}:"


def app_name(group: str, member: str, role: Role) -> str:
    """The ``application_name`` of a member's session."""
    return f"pgl:{group}:{member}:{role}"


def parse_app_name(name: str, group: str) -> tuple[str, str] | None:
    """``(member, role)`` of a session of ``group``, or ``None``."""
    head = prefix(group)
    if not name.startswith(head):
        return None
    member, _, role = name[len(head) :].partition(":")
    return (member, role) if member and role else None


def channel(group: str) -> str:
    """The group's NOTIFY channel (a plain identifier whatever the group's name)."""
    return "pgleaderlock_" + hashlib.md5(group.encode(), usedforsecurity=False).hexdigest()[:16]


def name_keys(group: str, name: str) -> Key:
    """The lock of ``name`` in ``group``: [`lock_keys`][pgleaderlock.lock_keys] of
    ``"<group>:<name>"``. A group is a namespace: two groups that both register a name
    never share its lock, its fencing term or its checkpoint. (A group's name has no
    ``:``, so the two parts never run into each other.) In SQL::

        SELECT ('x' || substr(md5('G:name'), 1, 8))::bit(32)::int AS key1,
               ('x' || substr(md5('G:name'), 9, 8))::bit(32)::int AS key2
    """
    return lock_keys(checkpoint_name(group, check_name(name, "a worker's name")))


def checkpoint_name(group: str, name: str) -> str:
    """How ``name`` of ``group`` is stored in the checkpoint table
    (``subscription_name``), and what its lock's keys are derived from: ``<group>:<name>``."""
    return f"{group}:{name}"


@functools.lru_cache(maxsize=1024)
def member_key(group: str, member: str) -> Key:
    """The lock a member holds while it is alive, on its hold (shared) or util
    (dedicated) session: other members count it as alive while it does, and (shared)
    wait for it to learn of its death at once."""
    return lock_keys(f"pgleaderlock-member:{group}:{member}")


Kind = Literal["join", "leave", "left", "request", "grant", "released", "handoff", "done", "moved"]


@dataclass(frozen=True)
class Message:
    """One notification.

    Attributes:
        kind: ``join`` (a member started), ``leave`` (it is shutting down), ``left`` (a
            watcher saw a member die), ``request`` (``sender`` asks ``to`` for
            ``keys``; ``count`` is how many of the group's names ``sender`` leads),
            ``grant`` (``sender`` released ``keys`` for ``to`` to take), ``released``
            (``keys`` are free for anyone: removed or given away), ``handoff``
            (``sender`` is about to release ``keys`` for ``to``: the others leave them
            alone, and with dedicated sessions stop waiting for them), ``done`` (a
            dedicated hand-off is over, or a request is answered with nothing),
            ``moved`` (``sender`` leads other names than before: the server granted it
            names, a dead member's say, or took some away; the others look again).
        sender: the member that sent it.
        to: the member it is for, or ``""`` for all.
        keys: the names' keys it is about.
        count: see ``request``.
    """

    kind: Kind
    sender: str
    to: str = ""
    keys: tuple[Key, ...] = field(default=())
    count: int = 0

    def payloads(self) -> Iterator[str]:
        """The message as one or more payloads, each within ``pg_notify``'s limit."""
        keys = list(self.keys)
        while True:
            body: dict[str, object] = {"k": self.kind, "s": self.sender}
            if self.to:
                body["t"] = self.to
            if self.count:
                body["c"] = self.count
            chunk: list[list[int]] = []
            size = len(json.dumps(body)) + 16
            while keys and size + 26 < _PAYLOAD_MAX:
                k1, k2 = keys.pop(0)
                chunk.append([k1, k2])
                size += len(str(k1)) + len(str(k2)) + 5
            if chunk:
                body["x"] = chunk
            yield json.dumps(body, separators=(",", ":"))
            if not keys:
                return

    @classmethod
    def parse(cls, payload: str) -> Message | None:
        """The message in ``payload``, or ``None`` for anything else."""
        try:
            body = json.loads(payload)
            if not isinstance(body, dict):
                return None
            keys = tuple((int(k[0]), int(k[1])) for k in body.get("x", ()))
            kind = body["k"]
            if kind not in get_args(Kind):
                return None
            return cls(kind, str(body["s"]), str(body.get("t", "")), keys, int(body.get("c", 0)))
        except (ValueError, KeyError, TypeError, IndexError):
            return None
