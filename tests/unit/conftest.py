from __future__ import annotations

from collections.abc import AsyncIterator, Callable

import pytest

from pgleaderlock import LeaderLock
from pgleaderlock.testing.fake import FakeServer
from support.locks import fake_locks


@pytest.fixture
def server() -> FakeServer:
    return FakeServer()


@pytest.fixture
async def make_lock(server: FakeServer) -> AsyncIterator[Callable[..., LeaderLock]]:
    """Locks on the fake server with fast timings; all shut down after the test."""
    async with fake_locks(server) as make:
        yield make
