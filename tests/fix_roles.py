"""Fixtures on a cluster with the roles of ``support.shared_roles`` (loaded by
``pytest_plugins`` in tests/conftest.py): ``roles_cluster`` (one per test module),
``roles_db`` (a database of the test's own on it) and ``closing``."""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from typing import Any

import pytest

from pgleaderlock import LeaderLock
from pgleaderlock.testing.postgres import ThrowawayPostgres
from support.server import prepared_cluster
from support.shared_roles import ROLES, Database


@pytest.fixture(scope="module")
def roles_cluster() -> Iterator[ThrowawayPostgres]:
    """A throwaway cluster with ``ROLES``, for the test module."""
    with prepared_cluster(*ROLES) as pg:
        yield pg


@pytest.fixture
def roles_db(roles_cluster: ThrowawayPostgres) -> Iterator[Database]:
    """A database of the test's own on ``roles_cluster``, migrated as ``Database.made``
    does; dropped afterwards."""
    with Database.made(roles_cluster) as database:
        yield database


@pytest.fixture
async def closing() -> AsyncIterator[list[Any]]:
    """Locks and connections to shut down or close at teardown, in reverse order."""
    things: list[Any] = []
    yield things
    for thing in reversed(things):
        if isinstance(thing, LeaderLock):
            await thing.shutdown()
        else:
            await thing.close()
