"""Fixtures of the fault-injection suite; its ``figures`` make the "fault suite figures" table.

Every test records the leadership beliefs of its candidates in a ``BeliefLog``
(``beliefs`` fixture) and ends with ``beliefs.report().assert_safe()``: no two beliefs
overlap, except right after an external ``pg_terminate_backend`` of the old leader, where
the overlap must stay under ``TERMINATE_OVERLAP_LIMIT_S``.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from typing import IO, Any

import psycopg
import pytest

from pgleaderlock import LeaderLock, ShutdownError
from pgleaderlock.testing.beliefs import BeliefLog
from support.locks import kept
from support.timings import FAULT_TIMINGS

Admin = psycopg.AsyncConnection[tuple[Any, ...]]

FAST: dict[str, Any] = FAULT_TIMINGS
"""Short timings: demotion bound D = 1 s, tcp_user_timeout U = 2 s."""


@pytest.fixture
def json_log_level() -> int | None:
    """The whole fault run logs at DEBUG, so every record the library writes under
    faults goes through the JSON check of ``json_log_check`` (tests/conftest.py)."""
    return logging.DEBUG


@pytest.fixture
def beliefs() -> BeliefLog:
    return BeliefLog()


@pytest.fixture
async def make_lock(beliefs: BeliefLog) -> AsyncIterator[Callable[..., LeaderLock]]:
    """``make_lock(dsn, keys, name, **overrides)``: a LeaderLock with FAST timings whose
    beliefs are recorded as ``name``. Every lock made is shut down at teardown."""

    def build(dsn: str | None, keys: tuple[int, int], name: str, **kwargs: Any) -> LeaderLock:
        lock = LeaderLock(dsn, *keys, **{**FAST, "name": name, **kwargs})
        beliefs.attach(lock, name)
        return lock

    def failed(lock: LeaderLock, exc: BaseException) -> None:
        if isinstance(exc, ShutdownError):
            beliefs.end(lock.name or "?", "stop")

    async with kept(build, on_error=failed) as make:
        yield make


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
