"""`Semaphore`: at most N holders of one name, each on one of N advisory locks (slots).

A semaphore *is* a [`LeaderLock`][pgleaderlock.LeaderLock] (same machine, runner, session,
callbacks, probes, lease, drain, fencing and integrations) whose acquisition takes one of
N locks instead of one: its [`SlotKeyring`][pgleaderlock.core.semaphore.SlotKeyring] tries
the slots' keys ([`slot_keys`][pgleaderlock.slot_keys]) in turn, from a random slot, and
the session then holds that slot's lock until it releases or loses it. PostgreSQL
guarantees at most one session per slot, so at most N sessions hold one.

A follower cannot wait on the server for "any of N locks" (a backend waits for one lock;
and a session whose wait outlives its call may run no other statement, see
``BaseSession.wait_lock``). So while a ``"wait"`` follower spends a retry delay, it tries
every slot again each ``rescan_s`` (N ``pg_try_advisory_lock`` round trips) instead:
a freed slot is found within ``rescan_s``, whichever it is. With ``slots=1`` it waits
on the server, as a lock does. See the [Semaphores guide](../guides/semaphores.md).
"""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Sequence
from typing import Any, Self, Unpack, cast

from .config import positive
from .errors import ConfigurationError
from .keyring import Keyring
from .keys import lock_keys, slot_keys
from .lock import LeaderLock
from .options import LockArguments, without_deprecated
from .session import LockSession, WaitingSession

__all__ = ["DEFAULT_RESCAN_S", "HANDOVER_RESCANS", "Semaphore", "SlotKeyring"]

DEFAULT_RESCAN_S = 0.01
"""How often a waiting follower tries every slot again (see ``rescan_s``)."""

HANDOVER_RESCANS = 2
"""When its hold ends (``step_down()``, or a lost session), a semaphore leaves the slot it
held to the waiting followers for this many ``rescan_s`` before it asks for it again."""


class SlotKeyring:
    """Takes one of several locks (a semaphore's slots).

    Args:
        keys: each slot's ``(key1, key2)``.
        rescan_s: while a follower waits, how often it tries every slot again.
    """

    def __init__(self, keys: Sequence[tuple[int, int]], rescan_s: float) -> None:
        self.keys = tuple(keys)
        self.index: int | None = None
        """The slot the session holds (or last held)."""
        self.rescan_s = rescan_s
        self._rng = random.Random()
        self._holding = False  # granted, and no attempt since (the hold may go on)
        self._released: tuple[int, float] | None = None  # which slot, when (monotonic)

    @property
    def held(self) -> tuple[int, int]:
        return self.keys[self.index or 0]

    @property
    def waits_on_server(self) -> bool:
        """One slot waits on the server; several are tried in turn (statements)."""
        return len(self.keys) == 1

    def _handed_over(self) -> int | None:
        """The slot this session held until recently, left to the waiting followers for
        ``HANDOVER_RESCANS`` rescans from the first attempt after the hold ended
        (released, or lost): a semaphore that loses its session (terminated backend)
        reconnects in milliseconds, before a follower's next rescan, and would take its
        slot straight back; a lock's follower that waits on the server gets it first."""
        if self._holding:
            self._holding = False
            if self.index is not None:
                self._released = (self.index, time.monotonic())
        released = self._released
        if released is None or len(self.keys) == 1:
            return None
        if time.monotonic() - released[1] >= HANDOVER_RESCANS * self.rescan_s:
            self._released = None
            return None
        return released[0]

    async def try_lock(self, session: LockSession) -> bool:
        """Try every slot once, from a random one (so that many candidates spread over
        the slots, instead of all asking the first); stop at the first granted."""
        count = len(self.keys)
        first = self._rng.randrange(count)
        skip = self._handed_over()
        for step in range(count):
            index = (first + step) % count
            if index == skip:
                continue
            if await session.try_lock(*self.keys[index]):
                self.index, self._holding = index, True
                return True
        return False

    async def wait_lock(self, session: WaitingSession, wait_s: float) -> bool:
        """One slot: wait on the server. Several: try every slot each ``rescan_s`` until
        one is granted or ``wait_s`` has passed."""
        if len(self.keys) == 1:
            granted = bool(await session.wait_lock(*self.keys[0], wait_s))
            if granted:
                self.index, self._holding = 0, True
            return granted
        deadline = time.monotonic() + wait_s
        while not await self.try_lock(cast(LockSession, session)):  # a waiting one is both
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return False
            await asyncio.sleep(min(self.rescan_s, remaining))
        return True


class Semaphore(LeaderLock):
    """At most ``slots`` holders at once: a [`LeaderLock`][pgleaderlock.LeaderLock] whose
    session holds one of ``slots`` advisory locks.

    Everything a `LeaderLock` has works the same way: `start()`, `wait_for_leadership()`,
    `step_down()`, `shutdown()`, the context manager, the callbacks (`on_acquired` when a
    slot is taken, `on_lost`, `on_released`, ...), probes, `lease_s`, `drain_s`,
    fencing, [`LeaderTasks`][pgleaderlock.LeaderTasks], the FastAPI lifespan. "Leader"
    means "holds a slot": `is_leader` is True for up to ``slots`` semaphores of one
    name at a time, [`slot`][pgleaderlock.Semaphore.slot] says which one.

    Each slot is its own advisory lock, with keys from
    [`slot_keys(name, slots)`][pgleaderlock.slot_keys] (never those of another name), so
    `pgleaderlock status --all` shows who holds which slot. With ``Fencing(enabled=True)`` each
    slot has its own term: [`term`][pgleaderlock.LeaderLock.term] is the held slot's, and
    [`fence`][pgleaderlock.LeaderLock.fence] fences against the holder of that slot only.

    A holder whose hold ends (``step_down()``, a lost session) leaves its slot to the
    waiting followers for ``HANDOVER_RESCANS`` rescans before it asks for it again.

    Every semaphore of a name must give the same ``slots``: one that counts fewer slots
    never takes the others, one that counts more lets more holders in.

    Args:
        dsn: as for `LeaderLock`.
        name: the semaphore's name; the same name (and ``slots``) in every process.
        slots: how many holders at most (N), from 1 to 1,024
            (``pgleaderlock.core.keys.MAX_SLOTS``: each holder is a session
            of its own, and a waiting follower tries every slot at each rescan).
        rescan_s: in ``follower_mode="wait"`` (the default), a follower spends each
            retry delay trying every slot again every ``rescan_s`` seconds (``slots``
            ``pg_try_advisory_lock`` calls each time), so a freed slot is taken within
            about ``rescan_s``. Lower is faster failover for more queries; see the
            [guide](../guides/semaphores.md). Unused with ``slots=1``, which waits on the
            server, and with ``follower_mode="poll"``, which tries every slot once per
            retry delay.
        **arguments: `LeaderLock`'s keyword arguments (``retry_strategy``,
            ``health_interval_s``, ``reconnect_grace_s``, ``auto_reacquire``,
            ``shutdown_event``, ``connect_fn``, ``options``, and the flat keywords of
            0.1, with a ``DeprecationWarning``), with its defaults. Its ``options``'
            [`Participation`][pgleaderlock.Participation] may not set ``metadata``,
            ``priority`` or ``eligible`` (they are about one lock's leader).

    Raises:
        ConfigurationError: a bad name, ``slots`` or ``rescan_s``, or as `LeaderLock`.
    """

    def __init__(
        self,
        dsn: str | Any | None,
        name: str,
        *,
        slots: int,
        rescan_s: float = DEFAULT_RESCAN_S,
        **arguments: Unpack[LockArguments],
    ) -> None:
        rescan_s = positive("rescan_s", rescan_s)
        for taken in ("key1", "key2", "name"):
            if taken in arguments:
                raise ConfigurationError(f"a Semaphore's {taken} comes from its name")
        arguments = without_deprecated(arguments, owner="Semaphore")
        self._ring = SlotKeyring(slot_keys(name, slots), rescan_s)
        super().__init__(dsn, *lock_keys(name), name=name, **arguments)
        self._log_fields["slots"] = slots

    def _keyring(self) -> Keyring:
        return self._ring

    @classmethod
    def from_name(  # type: ignore[override]  # a semaphore needs its slots
        cls,
        name: str,
        dsn: str | Any | None = None,
        *,
        slots: int,
        rescan_s: float = DEFAULT_RESCAN_S,
        **arguments: Unpack[LockArguments],
    ) -> Self:
        """``Semaphore(dsn, name, slots=..., ...)``: the same arguments."""
        arguments = without_deprecated(arguments, owner="Semaphore.from_name")
        return cls(dsn, name, slots=slots, rescan_s=rescan_s, **arguments)

    @property
    def slots(self) -> int:
        """How many holders at most (N)."""
        return len(self._ring.keys)

    @property
    def slot(self) -> int | None:
        """The slot this semaphore holds (``0 .. slots - 1``) while LEADER, else
        ``None``."""
        return self._ring.index if self.is_leader else None

    @property
    def slot_keys(self) -> tuple[tuple[int, int], ...]:
        """Every slot's ``(key1, key2)``, by slot."""
        return self._ring.keys

    @property
    def held_keys(self) -> tuple[int, int] | None:
        """The keys of the held slot while LEADER, else ``None``. (The `keys` of a
        semaphore are those of its name, which no session locks.)"""
        return None if self.slot is None else self._ring.held

    @property
    def rescan_s(self) -> float:
        """How often a waiting follower tries every slot again."""
        return self._ring.rescan_s

    def __repr__(self) -> str:
        slot = "" if self.slot is None else f" slot={self.slot}"
        return f"<Semaphore name={self.name!r} slots={self.slots}{slot} state={self.state.value}>"

    def _fence_keys(self) -> tuple[int, int] | None:
        """Fencing is per slot: a [`Leadership`][pgleaderlock.Leadership] of a semaphore
        (and so [`fence`][pgleaderlock.LeaderLock.fence]) fences against the held slot's
        term: the next holder of *this slot* waits for the transaction; holders of other
        slots do not (they have terms of their own). Not holding a slot:
        ``FencedError``."""
        return self.held_keys
