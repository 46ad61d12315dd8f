"""Fixtures of the deployment suite (real poolers, standbys, failover).

Replication (``support.replication``, ``support.blackhole``):

- ``replication_pair`` (session): one primary + streaming standby shared by the tests
  that only read, lock or write rows. Never promote, crash or stop it.
- ``make_replication_pair`` (function): ``make_replication_pair(**kwargs)`` starts a fresh
  ``PrimaryStandby(**kwargs)`` (about 1.3 s; from async code use
  ``await asyncio.to_thread(make_replication_pair)``); the test may promote, crash or stop
  it. Every pair made is closed at teardown.
- ``blackhole``: a ``BlackHole`` listener that never answers.

``backend`` runs a test once per driver (psycopg, asyncpg).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from support.blackhole import BlackHole
from support.replication import PrimaryStandby


@pytest.fixture(params=["psycopg", "asyncpg"])
def backend(request: pytest.FixtureRequest) -> str:
    """The driver under test: each test that asks for it runs once per backend."""
    name: str = request.param
    return name


# ---------------------------------------------------------------- replication


@pytest.fixture(scope="session")
def replication_pair() -> Iterator[PrimaryStandby]:
    """A shared primary + streaming standby. Do not promote, crash or stop it."""
    with PrimaryStandby() as pair:
        yield pair


@pytest.fixture
def make_replication_pair() -> Iterator[Callable[..., PrimaryStandby]]:
    """``make_replication_pair(**kwargs)``: a fresh, started ``PrimaryStandby``."""
    with contextlib.ExitStack() as made:

        def make(**kwargs: Any) -> PrimaryStandby:
            return made.enter_context(PrimaryStandby(**kwargs))

        yield make


@pytest.fixture
def blackhole() -> Iterator[BlackHole]:
    """A loopback listener that accepts TCP connections and never answers a byte."""
    with BlackHole() as hole:
        yield hole


# ---------------------------------------------------------------- measured figures


@pytest.fixture
def figures_table() -> str:
    """This folder's ``figures`` are listed in the "deployment figures" table."""
    return "deployment figures"
