"""``SessionSlot``: a session is never left open on the server for nobody."""

from __future__ import annotations

import asyncio

import pytest

from pgleaderlock.core._logging import get_logger
from pgleaderlock.core.session import ConnectOptions
from pgleaderlock.core.slot import OPEN_GRACE_S, SessionSlot
from pgleaderlock.testing.fake import FakeServer


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

    async def slow_connect() -> object:
        await release.wait()
        return await server.connect()

    slot = slot_for(slow_connect)
    opening = asyncio.ensure_future(slot.open())
    await asyncio.sleep(0.01)  # connecting
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
    await asyncio.sleep(0.01)
    opening.cancel()
    async with asyncio.timeout(OPEN_GRACE_S + 5):  # bounded: not as long as the hang
        with pytest.raises(asyncio.CancelledError):
            await opening
    server.release_hangs()
    await asyncio.sleep(0.01)
    assert server.sessions == []  # the connect was cut off, not left to finish
