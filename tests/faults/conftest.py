"""Fixtures of the fault-injection suite; its ``figures`` make the "fault suite figures" table.

Every test records the leadership beliefs of its candidates in a ``BeliefLog``
(``beliefs`` fixture, in tests/fix_locks.py with ``pg_lock``) and ends with ``beliefs.report().assert_safe()``: no two beliefs
overlap, except right after an external ``pg_terminate_backend`` of the old leader, where
the overlap must stay under ``TERMINATE_OVERLAP_LIMIT_S``.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import tempfile
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any

import psycopg
import pytest

from pgleaderlock import LeaderLock
from pgleaderlock.testing.postgres import ThrowawayPostgres
from support.fixture_types import LockPids, MakeRecorder
from support.server import admin_session, lock_holders
from support.timings import FAULT_TIMINGS

if TYPE_CHECKING:
    from conftest import Recorder
    from fix_locks import PgLock

Admin = psycopg.AsyncConnection[tuple[Any, ...]]

FAST: dict[str, Any] = FAULT_TIMINGS
"""Short timings: demotion bound D = 1 s, tcp_user_timeout U = 2 s."""


@pytest.fixture
def json_log_level() -> int | None:
    """The whole fault run logs at DEBUG, so every record the library writes under
    faults goes through the JSON check of ``json_log_check`` (tests/conftest.py)."""
    return logging.DEBUG


@dataclasses.dataclass
class Candidates:
    """The locks of a test on one server: ``pg_lock`` on the test's ``keys``, recorded
    if asked, and who holds ``keys`` there."""

    dsn: str
    lock_holders: LockPids
    keys: tuple[int, int]
    pg_lock: PgLock
    recorder: MakeRecorder

    def lock(self, name: str, dsn: str | None = None, **overrides: Any) -> LeaderLock:
        """``pg_lock`` named ``name`` on ``keys``, through ``dsn`` if given, else to the
        server."""
        dsn = self.dsn if dsn is None else dsn
        return self.pg_lock(dsn=dsn, keys=self.keys, name=name, **overrides)

    def recorded(
        self, name: str, dsn: str | None = None, **overrides: Any
    ) -> tuple[LeaderLock, Recorder]:
        """``lock(...)`` and the ``Recorder`` of its callbacks."""
        lock = self.lock(name, dsn, **overrides)
        return lock, self.recorder(lock)

    async def leader_and_follower(
        self,
        leader_dsn: str | None = None,
        leader: dict[str, Any] | None = None,
        follower: dict[str, Any] | None = None,
    ) -> tuple[LeaderLock, LeaderLock, Recorder, Recorder]:
        """Locks "a" (with ``leader`` overrides, through ``leader_dsn`` if given) and "b"
        (with ``follower`` overrides), recorded: "a" leads, then "b" follows."""
        a, rec_a = self.recorded("a", leader_dsn, **(leader or {}))
        b, rec_b = self.recorded("b", **(follower or {}))
        await rec_b.follow(a, 10, 10)
        return a, b, rec_a, rec_b

    async def holders(self) -> list[int]:
        """Backend pids holding ``keys`` on the server."""
        return await self.lock_holders(*self.keys)

    async def assert_leads(self, lock: LeaderLock, timeout_s: float = 5.0) -> None:
        """``lock`` leads within ``timeout_s``, and the server agrees: its backend alone
        holds ``keys``."""
        assert await lock.wait_for_leadership(timeout_s)
        assert await self.holders() == [lock.backend_pid]


@pytest.fixture
def candidates_on(
    keys: tuple[int, int],
    pg_lock: PgLock,
    recorder: MakeRecorder,
) -> Callable[[str, Callable[[int, int], Awaitable[list[int]]]], Candidates]:
    """``candidates_on(dsn, holders)``: ``Candidates`` on the server at ``dsn``, where
    ``holders(key1, key2)`` tells who holds a lock."""
    return functools.partial(Candidates, keys=keys, pg_lock=pg_lock, recorder=recorder)


@pytest.fixture
def candidates(
    pg_dsn: str,
    holders: LockPids,
    candidates_on: Callable[..., Candidates],
) -> Candidates:
    """``Candidates`` on the shared server."""
    return candidates_on(pg_dsn, holders)


@pytest.fixture
def throwaway_candidates(
    throwaway_pg: ThrowawayPostgres, candidates_on: Callable[..., Candidates]
) -> Candidates:
    """``Candidates`` on the test's ``throwaway_pg``; ``holders()`` connects to it each
    time (it may have been restarted since)."""

    async def holders(key1: int, key2: int) -> list[int]:
        async with await psycopg.AsyncConnection.connect(
            throwaway_pg.dsn, autocommit=True
        ) as admin:
            return await lock_holders(admin, key1, key2)

    return candidates_on(throwaway_pg.dsn, holders)


@pytest.fixture
def figures_table() -> str:
    """This folder's ``figures`` are listed in the "fault suite figures" table."""
    return "fault suite figures"


@pytest.fixture
def children_log(tmp_path: Path) -> Iterator[IO[str]]:
    """Where child processes' stderr (the library's warnings) goes; its path is printed."""
    path = tmp_path / "children.log"
    print(f"children's stderr: {path}")
    with path.open("w") as log:
        yield log


# ---------------------------------------------------------------- Coordinator groups
# (tests/faults/test_coordinator_*.py, support/coordinator_group.py)


@pytest.fixture(scope="module")
def module_pg() -> Iterator[ThrowawayPostgres]:
    """One throwaway cluster for the module's tests that do not restart it."""
    with ThrowawayPostgres(max_connections=300) as pg:
        yield pg


@pytest.fixture
def stderr() -> Iterator[IO[str]]:
    """The replicas' stderr (their warnings); its tail goes into failure messages."""
    with tempfile.TemporaryFile("w+") as f:
        yield f


@pytest.fixture
async def module_admin(module_pg: ThrowawayPostgres) -> AsyncIterator[Admin]:
    """An admin session on ``module_pg``."""
    async with admin_session(module_pg.dsn) as conn:
        yield conn
