"""``SessionSlot``: a session is never left open on the server for nobody."""

from __future__ import annotations

import asyncio

import pytest

from pgleaderlock.core._logging import get_logger
from pgleaderlock.core.session import ConnectOptions
from pgleaderlock.core.slot import OPEN_GRACE_S, SessionSlot
from pgleaderlock.testing.fake import FakeServer
from support.poll import eventually


def slot_for(connect: object) -> SessionSlot:
    return SessionSlot(
        backend=None,
        dsn=None,
        options=ConnectOptions(application_name="test", connect_timeout_s=5.0),
        connect_fn=connect,  # type: ignore[arg-type]
        log=get_logger("pgleaderlock.test"),
        fields={},
    )


async def test_a_session_opened_for_nobody_is_closed_once_made() -> None:
    """An open cut short while the connection is being made (a shutdown cancels the
    task, a timeout fires) lets a connection that is about to be made finish, and
    closes it: cut off half-made, a driver may leave it open on the server until the
    garbage collector finds it (a watch session left after a Coordinator's shutdown
    came from this)."""
    server = FakeServer()
    release = asyncio.Event()

    connecting = asyncio.Event()

    async def slow_connect() -> object:
        connecting.set()
        await release.wait()
        return await server.connect()

    slot = slot_for(slow_connect)
    opening = asyncio.ensure_future(slot.open())
    await asyncio.wait_for(connecting.wait(), 5)
    opening.cancel()
    asyncio.get_running_loop().call_later(OPEN_GRACE_S / 5, release.set)
    with pytest.raises(asyncio.CancelledError):
        await opening
    assert len(server.sessions) == 1  # made within the grace...
    assert server.open_sessions == []  # ...and closed before open() ended
    assert slot.session is None


async def test_an_open_that_hangs_is_cut_off_after_the_grace() -> None:
    server = FakeServer()
    server.hang("connect")
    slot = slot_for(server.connect)
    opening = asyncio.ensure_future(slot.open())
    await eventually(lambda: server.calls["connect"] >= 1, 5, "the open reaches the connect")
    opening.cancel()
    async with asyncio.timeout(OPEN_GRACE_S + 5):  # bounded: not as long as the hang
        with pytest.raises(asyncio.CancelledError):
            await opening
    server.release_hangs()
    await asyncio.sleep(0.01)  # kept: the time a connect left running would need to end
    assert server.sessions == []  # the connect was cut off, not left to finish


class Probed:
    """A session that counts its probes: ``holds()`` (pg_locks) and the cheap one; its
    table checks; and fails its next call with a missing table when told."""

    backend_pid = 1

    def __init__(self) -> None:
        self.asked: list[str] = []
        self.missing_next = False

    async def try_lock(self, key1: int, key2: int) -> bool:
        return True

    async def unlock(self, key1: int, key2: int) -> bool:
        return True

    async def holds(self, key1: int, key2: int) -> bool:
        self.asked.append("pg_locks")
        return True

    def start_probe(self) -> asyncio.Future[None]:
        self.asked.append("cheap")
        future = asyncio.get_running_loop().create_future()
        future.set_result(None)
        return future

    async def prepare_table(self, table: object) -> None:
        self.asked.append("table")

    async def bump(self) -> int:
        if self.missing_next:
            self.missing_next = False
            error = ConnectionError("bump: UndefinedTable")
            error.__cause__ = type("UndefinedTable", (Exception,), {"sqlstate": "42P01"})()
            raise error
        return 7

    async def close(self) -> None:
        pass


async def probe(slot: SessionSlot) -> None:
    started = slot.start_probe()
    if started is None:
        assert await slot.holds(1, 2)
    else:
        await started


async def test_the_core_asks_pg_locks_once_per_grant_then_probes_cheaply() -> None:
    """Which probe runs is the core's choice, the same for every backend: after each
    grant (and on a new session) ``holds()`` asks ``pg_locks`` once; once it said the
    lock stays, the cheap probe serves until the next grant."""
    sessions: list[Probed] = []

    async def connect() -> Probed:
        sessions.append(Probed())
        return sessions[-1]

    slot = slot_for(connect)
    await slot.open()
    for _ in range(3):
        await probe(slot)
    slot.granted()
    for _ in range(2):
        await probe(slot)
    assert sessions[0].asked == ["pg_locks", "cheap", "cheap", "pg_locks", "cheap"]
    await slot.close()
    await slot.open()  # a new session: nothing known of it
    await probe(slot)
    assert sessions[1].asked == ["pg_locks"]


async def test_a_table_is_checked_once_per_session_and_again_when_it_went_missing() -> None:
    from pgleaderlock.core.tables import TermTable

    sessions: list[Probed] = []

    async def connect() -> Probed:
        sessions.append(Probed())
        return sessions[-1]

    table = TermTable("public", "pgleaderlock_terms")
    slot = slot_for(connect)
    session = await slot.open()
    assert isinstance(session, Probed)
    assert await slot.with_table(table, session.bump) == 7
    assert await slot.with_table(table, session.bump) == 7
    assert session.asked == ["table"]  # once for this session
    session.missing_next = True  # dropped by an operator meanwhile
    assert await slot.with_table(table, session.bump) == 7
    assert session.asked == ["table", "table"]  # checked (created) again, then the call
    await slot.close()
    second = await slot.open()
    await slot.with_table(table, second.bump)  # type: ignore[attr-defined]
    assert sessions[1].asked == ["table"]


class _Interrupt(BaseException):
    """Stands for KeyboardInterrupt or SystemExit, which asyncio would carry out of the
    event loop (and out of the test) instead of into the task."""


async def test_an_interrupt_while_an_abandoned_open_finishes_is_not_lost() -> None:
    """The caller gave up on an open (a timeout, a shutdown); the connection being made
    gets ``OPEN_GRACE_S`` to finish and be closed. An interrupt meanwhile
    (``KeyboardInterrupt``, ``SystemExit``) propagates: it used to be swallowed and the
    caller's cancellation raised instead, so a Ctrl-C or a ``sys.exit()`` from a signal
    handler arriving then was lost."""
    gate = asyncio.Event()

    connecting = asyncio.Event()

    async def connect() -> object:
        connecting.set()
        await gate.wait()
        raise _Interrupt

    slot = SessionSlot(
        backend=None,
        dsn=None,
        options=ConnectOptions("interrupt", 1.0),
        connect_fn=connect,
        log=get_logger(),
        fields={},
    )
    opening = asyncio.ensure_future(slot.open())
    await asyncio.wait_for(connecting.wait(), 5)
    opening.cancel()  # the caller gives up
    await asyncio.sleep(0.01)  # kept: the order under test, the cancellation reaches open() first
    gate.set()  # the connect ends, with an interrupt
    with pytest.raises(_Interrupt):
        await opening
