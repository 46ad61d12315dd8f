"""Fixtures of the server tests: ``group`` (a group name of the test's own) and
``make_coord`` (Coordinators of that group with fast timings, shut down at teardown),
for tests/server/test_coordinator*.py."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from typing import Any

import pytest

from pgleaderlock import Coordinator
from support.coordinators import FAST, unique
from support.timings import lock_args


@pytest.fixture
def group() -> str:
    return unique("g")


@pytest.fixture
async def make_coord(pg_dsn: str, group: str) -> AsyncIterator[Callable[..., Coordinator]]:
    """``make_coord(**overrides)``: a Coordinator of the test's group with FAST timings;
    every one made is shut down at teardown."""
    made: list[Coordinator] = []

    def make(**kwargs: Any) -> Coordinator:
        coord = Coordinator(
            kwargs.pop("dsn", pg_dsn), **lock_args({"group": group, **FAST, **kwargs})
        )
        made.append(coord)
        return coord

    try:
        yield make
    finally:
        await asyncio.gather(*(c.shutdown() for c in made), return_exceptions=True)
