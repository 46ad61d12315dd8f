"""The leader watch: tells every replica, followers and observers included, who leads.

One watch per event loop and connection target (DSN, backend) is shared by every lock
of the process that wants to be told (``@lock.on_leader_changed`` or
``eligible=False``). It costs two sessions, whatever the number of locks:

- a *listening* session, ``LISTEN pgleaderlock_leader``: a lock that starts to lead
  announces it with ``NOTIFY`` on its own session, before its ``on_acquired``
  callbacks. A follower's own session cannot listen: in ``follower_mode="wait"`` it is
  blocked inside ``pg_advisory_lock``;
- a *query* session: a notification about a watched lock, and every ``interval_s``
  without one (no change is missed: a leader that died with nobody to follow it
  announces nothing), makes the watch read ``pg_locks``
  ([`LeaderReader`][pgleaderlock.core.leader.LeaderReader]), at most once per
  ``CHECK_GAP_S`` (the notifications received meanwhile make one read). A notification
  is only a reason to look: a forged one (any role may ``NOTIFY``) changes nothing, and
  a flood of them costs at most 20 reads a second per watched lock. The same session
  serves ``lock.leader()`` and holds the observers' participant rows.

A change is delivered to each subscriber as one ``LeaderInfo | None``; a subscriber is
first told the leader as first seen.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

from ._logging import get_logger
from .leader import (
    CHANNEL,
    LeaderInfo,
    LeaderReader,
    Participant,
    ParticipantTable,
    Target,
    _close,
    open_session,
)
from .session import LockSession, QuerySession, TableSession

__all__ = ["LeaderWatch", "Subscription", "watch_for"]

T = TypeVar("T")

log = get_logger()

Deliver = Callable[[LeaderInfo | None], Awaitable[None]]

_UNSEEN: Any = object()

CHECK_GAP_S = 0.05
"""The least time between two looks at ``pg_locks`` prompted by notifications: a flood
of ``NOTIFY``s (which any role may send) costs a watching process at most 20 looks a
second per watched lock, however many arrive; a real change is seen at most this much
later than it would be otherwise (only when a look happened just before)."""


@dataclass(eq=False)
class Subscription:
    """One lock's interest in who leads its keys.

    Attributes:
        keys: the lock's keys.
        deliver: called on the watch's task with each change.
        row: an observer's participant row to hold while subscribed
            (``(identity, name, priority, metadata JSON)``), or ``None``.
    """

    keys: tuple[int, int]
    deliver: Deliver
    row: tuple[str, str | None, int | None, str | None] | None = None
    label: str = ""  # the lock's label, for logs
    poke: Callable[[], None] | None = None  # a notification about its keys, or a tick
    seen: Any = field(default=_UNSEEN)  # the fingerprint it was last told


def _fingerprint(info: LeaderInfo | None) -> object:
    if info is None:
        return None
    return (info.pid, info.identity, info.term)


class LeaderWatch:
    """See the module. Made and shared by [`watch_for`][pgleaderlock.core.watch.watch_for].

    Args:
        target: how to open its sessions.
        table: the participants table.
        interval_s: the periodic re-check (and the listening session's ping).
        timeout_s: bounds each query and connect.
    """

    def __init__(
        self,
        target: Target,
        table: ParticipantTable,
        interval_s: float,
        timeout_s: float,
        on_empty: Callable[[LeaderWatch], None],
    ) -> None:
        self._target, self._table = target, table
        self.interval_s, self.timeout_s = interval_s, timeout_s
        self._on_empty = on_empty
        self._subs: list[Subscription] = []
        self._dirty: set[tuple[int, int]] = set()
        self._wake = asyncio.Event()
        self.task: asyncio.Task[None] | None = None
        self._query: LockSession | None = None
        self._reader: LeaderReader | None = None
        self._query_lock = asyncio.Lock()
        self._rows_written = False
        self._checked_at = 0.0  # monotonic time of the last look (see CHECK_GAP_S)
        self._listen_pid: int | None = None
        self.listening = asyncio.Event()
        """Set while the listening session listens (tests wait for it)."""

    # ------------------------------------------------------------------ subscribers

    @property
    def backend_pids(self) -> tuple[int | None, int | None]:
        """The server pids of its listening and query sessions (``None``: not open)."""
        query = self._query
        return self._listen_pid, None if query is None else query.backend_pid

    @property
    def label(self) -> str:
        """The labels of the locks it watches, for logs."""
        return ",".join(sorted({sub.label for sub in self._subs}))

    def subscribe(self, sub: Subscription) -> None:
        self._subs.append(sub)
        self._dirty.add(sub.keys)
        self._rows_written = self._rows_written and sub.row is None
        if self.task is None or self.task.done():
            self.task = asyncio.get_running_loop().create_task(
                self._run(), name=f"pgleaderlock-watch:{self._target.key[0]}"
            )
        self._wake.set()

    async def unsubscribe(self, sub: Subscription) -> None:
        if sub not in self._subs:
            return
        self._subs.remove(sub)
        if sub.row is not None:
            with contextlib.suppress(Exception):
                await self._remove_row(sub)
        if not self._subs:
            self._on_empty(self)
            await self.close()

    async def close(self) -> None:
        task, self.task = self.task, None
        if task is not None:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
        async with self._query_lock:
            await self._drop_query()

    # ------------------------------------------------------------------ queries

    async def leader(self, keys: tuple[int, int]) -> LeaderInfo | None:
        """Who leads now, read on the query session."""
        async with self._query_lock:
            reader = await self._reader_now()
            return await self._bounded(reader.leader(keys))

    async def participants(self, keys: tuple[int, int]) -> list[Participant]:
        async with self._query_lock:
            reader = await self._reader_now()
            return await self._bounded(reader.participants(keys))

    async def _bounded(self, call: Awaitable[T]) -> T:
        try:
            async with asyncio.timeout(self.timeout_s):
                return await call
        except BaseException:
            await self._drop_query()  # unknown state: a new session next time
            raise

    async def _reader_now(self) -> LeaderReader:
        if self._reader is None or self._query is None:
            async with asyncio.timeout(self.timeout_s):
                self._query = await open_session(self._target, "pgleaderlock:watch")
            self._reader = LeaderReader(self._query, self._table, self.label)
            self._rows_written = False
        if not self._rows_written:
            self._rows_written = True
            await self._write_rows(self._query)
        return self._reader

    async def _drop_query(self) -> None:
        session, self._query, self._reader = self._query, None, None
        if session is not None:
            await _close(session)

    async def _write_rows(self, session: LockSession) -> None:
        """The observers' rows, on the query session (they live as long as it)."""
        rows = [sub for sub in self._subs if sub.row is not None]
        if not rows or not isinstance(session, QuerySession):
            return
        try:
            async with asyncio.timeout(self.timeout_s):
                if isinstance(session, TableSession):
                    await session.prepare_table(self._table)
                for sub in rows:
                    assert sub.row is not None
                    identity, name, priority, metadata = sub.row
                    values = (*sub.keys, identity, name, priority, False, metadata,
                              False, CHANNEL, "")  # fmt: skip
                    await session.query(self._table.upsert(), values)
        except Exception as exc:
            log.warning("observer_row_failed", error=repr(exc), table=self._table.shown,
                        lock=self.label)  # fmt: skip

    async def _remove_row(self, sub: Subscription) -> None:
        async with self._query_lock:
            session = self._query
            if session is None or not isinstance(session, QuerySession) or sub.row is None:
                return
            await self._bounded(session.query(self._table.remove(), (*sub.keys, sub.row[0])))

    # ------------------------------------------------------------------ the task

    async def _run(self) -> None:
        attempt = 0
        while True:
            listen: LockSession | None = None
            recv: asyncio.Task[list[tuple[int, str]]] | None = None
            try:
                async with asyncio.timeout(self.timeout_s):
                    listen = await open_session(self._target, "pgleaderlock:listen")
                    await listen.listen(CHANNEL)  # type: ignore[attr-defined]
                self._listen_pid = listen.backend_pid
                self.listening.set()
                attempt = 0
                self._dirty.update(sub.keys for sub in self._subs)  # missed while away
                checked = time.monotonic()
                while True:
                    self._wake.clear()  # what it was set for is in _dirty
                    # Coalesced: at most one look per CHECK_GAP_S, whatever the number of
                    # notifications (any role may send them); they keep being received
                    # meanwhile, and those about one lock make one look.
                    due = self._checked_at + CHECK_GAP_S - time.monotonic()
                    if self._dirty and due <= 0:
                        await self._check()
                    if time.monotonic() - checked >= self.interval_s:
                        checked = time.monotonic()
                        self._dirty.update(sub.keys for sub in self._subs)
                        continue
                    if recv is None:
                        recv = asyncio.ensure_future(
                            listen.notifications(self.interval_s)  # type: ignore[attr-defined]
                        )
                    woke = asyncio.ensure_future(self._wake.wait())
                    try:
                        await asyncio.wait(
                            {recv, woke},
                            timeout=max(due, 0.0)
                            if self._dirty
                            else self.interval_s + self.timeout_s,
                            return_when=asyncio.FIRST_COMPLETED,
                        )
                    finally:
                        woke.cancel()
                    if not recv.done():
                        if self._wake.is_set() or self._dirty:
                            continue  # a new subscriber, or a look that is due now
                        raise TimeoutError("the listening session did not answer")
                    received, recv = recv.result(), None
                    watched = {sub.keys for sub in self._subs}
                    for _pid, payload in received:
                        keys = _parse(payload)
                        if keys in watched:
                            self._dirty.add(keys)
                    if not received:
                        async with asyncio.timeout(self.timeout_s):
                            await listen.ping()  # type: ignore[attr-defined]
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                attempt += 1
                log.warning("leader_watch_failed", error=repr(exc), attempt=attempt,
                            lock=self.label)  # fmt: skip
            finally:
                self.listening.clear()
                self._listen_pid = None
                if recv is not None:
                    recv.cancel()
                    await asyncio.gather(recv, return_exceptions=True)
                if listen is not None:
                    await _close(listen)
            await asyncio.sleep(min(0.1 * 2**attempt, self.interval_s))

    def _poke(self, keys: tuple[int, int] | None) -> None:
        """Tell the subscribers of ``keys`` (all: ``None``) that something may have
        changed (a lock with a priority then looks whether to hand over)."""
        for sub in list(self._subs):
            if sub.poke is not None and (keys is None or sub.keys == keys):
                try:
                    sub.poke()
                except Exception as exc:  # a bug; the watch goes on
                    log.error("poke_failed", error=repr(exc), lock=sub.label)

    async def _check(self) -> None:
        """Read who leads each dirty lock; tell each subscriber that was told otherwise,
        and poke the subscribers of each lock looked at (a leader with a priority then
        looks whether to hand over)."""
        dirty, self._dirty = self._dirty, set()
        self._checked_at = time.monotonic()
        found: dict[tuple[int, int], LeaderInfo | None] = {}
        try:
            async with self._query_lock:
                reader = await self._reader_now()
                for keys in dirty:
                    found[keys] = await self._bounded(reader.leader(keys))
        except Exception:
            self._dirty.update(dirty)  # look again after the reconnect
            raise
        for keys, info in found.items():
            mark = _fingerprint(info)
            for sub in [s for s in self._subs if s.keys == keys]:
                if sub.seen is _UNSEEN or sub.seen != mark:
                    sub.seen = mark
                    await sub.deliver(info)
            self._poke(keys)


def _parse(payload: str) -> tuple[int, int] | None:
    try:
        first, second = payload.split(",")
        return int(first), int(second)
    except ValueError:
        return None


_WATCHES: dict[tuple[Any, ...], LeaderWatch] = {}


def watch_for(
    target: Target, table: ParticipantTable, interval_s: float, timeout_s: float
) -> LeaderWatch:
    """The watch this event loop shares for ``target`` and ``table`` (made if missing;
    it closes itself once its last subscriber has left)."""
    loop = asyncio.get_running_loop()
    key = (id(loop), target.key, table)
    watch = _WATCHES.get(key)
    if watch is None:

        def forget(done: LeaderWatch) -> None:
            if _WATCHES.get(key) is done:
                del _WATCHES[key]

        watch = _WATCHES[key] = LeaderWatch(target, table, interval_s, timeout_s, forget)
    return watch
