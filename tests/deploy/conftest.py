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

PgBouncer (``support.pooled``, for tests/deploy/test_poolers_*.py): ``pooled_bouncer``, a
private instance in each mode that shares server connections (``[transaction]``,
``[statement]``); ``session_bouncer``, a private one in session mode. The test may kill or
restart either; both are closed at teardown. ``through(bouncer)``: locks of the test's
``backend`` on its ``keys`` through ``bouncer``, with ``holders``, ``recorder`` and
``record_property`` at hand (``support.pooled.Through``).

A database shared with other roles (``support.shared_database``), for
tests/deploy/test_shared_database*.py: ``shared_cluster`` (module: a cluster of the
module's own, with the roles ``attacker``, ``owner``, ``app``, ``worker``), ``shared_db``
(a fresh database of it, where anyone may create in ``public``), and ``coordinators``
(Coordinators with fast timings, shut down at teardown).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable, Iterator
from typing import Any

import psycopg
import pytest

from pgleaderlock import Coordinator
from pgleaderlock.testing.postgres import ThrowawayPostgres
from support.blackhole import BlackHole
from support.fixture_types import LockPids, MakeRecorder
from support.pgbouncer import PgBouncer, PoolMode
from support.pooled import BACKENDS, POOLED, Backend, MakeThrough, Record, Through
from support.replication import PrimaryStandby
from support.server import prepared_cluster
from support.shared_database import COORD_FAST, Database
from support.timings import lock_args


@pytest.fixture(params=BACKENDS)
def backend(request: pytest.FixtureRequest) -> str:
    """The driver under test: each test that asks for it runs once per backend."""
    name: str = request.param
    return name


# ---------------------------------------------------------------- PgBouncer


@pytest.fixture(params=POOLED)
def pooled_bouncer(
    request: pytest.FixtureRequest, make_pgbouncer: Callable[..., PgBouncer]
) -> PgBouncer:
    """A private PgBouncer in transaction mode, then in statement mode (``pool_mode``)."""
    mode: PoolMode = request.param
    return make_pgbouncer(mode)


@pytest.fixture
def session_bouncer(make_pgbouncer: Callable[..., PgBouncer]) -> PgBouncer:
    """A private PgBouncer in session mode, with its stock settings."""
    return make_pgbouncer("session")


@pytest.fixture
def through(
    backend: Backend,
    keys: tuple[int, int],
    recorder: MakeRecorder,
    holders: LockPids,
    record_property: Record,
) -> MakeThrough:
    """``through(bouncer)``: the test's locks through ``bouncer`` (`Through`)."""
    return lambda bouncer: Through(bouncer, backend, keys, recorder, holders, record_property)


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


# ---------------------------------------------------------------- a database shared with other roles


@pytest.fixture(scope="module")
def shared_cluster() -> Iterator[ThrowawayPostgres]:
    """A cluster of the requesting module's own, with the roles ``attacker``, ``owner``,
    ``app`` and ``worker`` (tests/deploy/test_shared_database*.py)."""
    with prepared_cluster(
        "CREATE ROLE attacker LOGIN",
        "CREATE ROLE owner LOGIN",
        "CREATE ROLE app LOGIN",
        "CREATE ROLE worker LOGIN",
    ) as pg:
        yield pg


@pytest.fixture
def shared_db(shared_cluster: ThrowawayPostgres) -> Iterator[Database]:
    """A database like one upgraded from PostgreSQL 14: anyone may create in public."""
    try:
        with Database.fresh(shared_cluster) as database:
            database.run("GRANT CREATE ON SCHEMA public TO PUBLIC")
            yield database
    finally:
        with psycopg.connect(shared_cluster.dsn, autocommit=True) as conn:
            conn.execute("ALTER ROLE attacker NOSUPERUSER")


@pytest.fixture
async def coordinators() -> AsyncIterator[Callable[..., Coordinator]]:
    """``make(dsn, **kwargs)``: a Coordinator with fast timings, shut down at teardown."""
    made: list[Coordinator] = []

    def make(dsn: str, **kwargs: Any) -> Coordinator:
        coord = Coordinator(dsn, **lock_args({**COORD_FAST, **kwargs}))
        made.append(coord)
        return coord

    yield make
    await asyncio.gather(*(c.shutdown() for c in made), return_exceptions=True)
