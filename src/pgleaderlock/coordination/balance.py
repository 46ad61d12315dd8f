"""The group's balance, decided by each member for itself: no coordinator of
coordinators, no table. Pure functions, tested without a database.

Every member sees the same things (the group's sessions and locks) and follows the same
rules, so they agree without talking more than a request and a grant:

- a free name is taken by the member that rendezvous hashing (HRW) gives it among the
  live members: deterministic, so members do not race for it, and a member's departure
  spreads its names over the survivors;
- a member that leads at least two names fewer than another asks that one for names
  it also registered, one at a time, until the difference is at most one; the giver
  agrees only while the difference still holds. The sum of squares falls with every
  move, so it ends, each member leading ⌊N/M⌋ or ⌈N/M⌉ of the N names; at that point no
  member asks anything, so a steady group never moves a name.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from .protocol import Key

__all__ = ["View", "Weights", "heirs", "hrw_owner", "hrw_ranked", "requests", "should_grant"]


def _weight(key: Key, member: str) -> int:
    digest = hashlib.md5(f"{key[0]},{key[1]}:{member}".encode(), usedforsecurity=False)
    return int.from_bytes(digest.digest()[:8], "big")


def hrw_owner(key: Key, members: Iterable[str]) -> str | None:
    """The member that rendezvous hashing gives ``key`` (None without members)."""
    return max(members, key=lambda member: (_weight(key, member), member), default=None)


def hrw_ranked(key: Key, members: Iterable[str]) -> list[str]:
    """``members`` in the order rendezvous hashing ranks them for ``key`` (the owner
    first): every member computes the same order."""
    return sorted(members, key=lambda member: (_weight(key, member), member), reverse=True)


class Weights:
    """The rendezvous weights of names, computed once per (name, member) and kept for
    the members of the last view: a member that learns of a death decides which of the
    dead member's names are its own without hashing thousands of names then."""

    def __init__(self) -> None:
        self._by_member: dict[str, dict[Key, int]] = {}

    def keep_only(self, members: Iterable[str]) -> None:
        """Forget the weights of members not in ``members`` (gone)."""
        keep = set(members)
        for member in [m for m in self._by_member if m not in keep]:
            del self._by_member[member]

    def owner(self, key: Key, members: Iterable[str]) -> str | None:
        """As `hrw_owner`, from the kept weights."""
        best: tuple[int, str] | None = None
        for member in members:
            table = self._by_member.get(member)
            if table is None:
                table = self._by_member[member] = {}
            weight = table.get(key)
            if weight is None:
                weight = table[key] = _weight(key, member)
            if best is None or (weight, member) > best:
                best = (weight, member)
        return None if best is None else best[1]


def heirs(view: View, weights: Weights, dead: Iterable[str] | None = None) -> dict[str, list[Key]]:
    """For each other live member of ``view`` (or each of ``dead``): its names that this
    member takes at once when it dies, those whose rendezvous owner among the other
    live members is this member (`hrw_owner` of the survivors)."""
    others = view.members if dead is None else dead
    survivors = {m: view.members - {m} for m in others if m != view.me}
    found: dict[str, list[Key]] = {member: [] for member in survivors}
    for key, holder in view.holders.items():
        rest = survivors.get(holder)
        if rest is not None and weights.owner(key, rest) == view.me:
            found[holder].append(key)
    return found


@dataclass(frozen=True)
class View:
    """What a member knows of its group at one moment.

    Attributes:
        me: this member.
        members: the live members, this one included.
        holders: for each of this member's registered names (by key) that someone
            holds, who: a member, or ``""`` for a session outside the group (a plain
            lock, another group).
        keys: this member's registered names' keys.
    """

    me: str
    members: frozenset[str]
    holders: Mapping[Key, str]
    keys: frozenset[Key]

    def counts(self) -> dict[str, int]:
        """How many of this member's names each member leads."""
        counts = dict.fromkeys(self.members, 0)
        for holder in self.holders.values():
            if holder in counts:
                counts[holder] += 1
        return counts

    def free(self) -> list[Key]:
        """This member's names that nobody holds, in a stable order."""
        return sorted(k for k in self.keys if k not in self.holders)

    def mine_to_take(self) -> list[Key]:
        """The free names whose rendezvous owner among the live members is this one."""
        return [k for k in self.free() if hrw_owner(k, self.members) == self.me]


def requests(view: View) -> dict[str, list[Key]]:
    """What this member asks of whom, to come within one name of every other member.

    Only names this member registered, held by members of the group, are asked for.
    """
    counts = view.counts()
    mine = counts.get(view.me, 0)
    held_by: dict[str, list[Key]] = {}
    for key, holder in sorted(view.holders.items()):
        if holder in counts and holder != view.me:
            held_by.setdefault(holder, []).append(key)
    asks: dict[str, list[Key]] = {}
    while True:
        givers = [m for m in counts if m != view.me and held_by.get(m)]
        if not givers:
            break
        giver = max(givers, key=lambda m: (counts[m], m))
        if counts[giver] - mine < 2:
            break
        asks.setdefault(giver, []).append(held_by[giver].pop())
        counts[giver] -= 1
        mine += 1
    return asks


def should_grant(my_count: int, requester_count: int, floor: int = 0) -> bool:
    """Give one name away: only while it makes the two members more even, and never
    below ``floor`` (the giver's fair share, ⌊N/M⌋: with several members joining at
    once, a request made before the requester saw the others would take too much)."""
    return my_count - requester_count >= 2 and my_count > floor
