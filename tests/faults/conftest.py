"""Fixtures of the fault-injection suite, and the table of figures it prints at the end.

Every test records the leadership beliefs of its candidates in a ``BeliefLog``
(``beliefs`` fixture) and ends with ``beliefs.report().assert_safe()``: no two beliefs
overlap, except right after an external ``pg_terminate_backend`` of the old leader, where
the overlap must stay under ``TERMINATE_OVERLAP_LIMIT_S``.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from typing import IO, Any

import psycopg
import pytest

from pgleaderlock import FixedInterval, LeaderLock, ShutdownError
from pgleaderlock.testing.beliefs import BeliefLog
from support.netns import NetnsLink, NetnsUnavailableError, netns_unavailable_reason

Admin = psycopg.AsyncConnection[tuple[Any, ...]]

FAST: dict[str, Any] = {
    "retry_strategy": FixedInterval(0.05),
    "health_interval_s": 0.5,
    "health_timeout_s": 0.5,
    "connect_timeout_s": 2.0,
    "command_timeout_s": 2.0,
    "load_plugins": False,
}
"""Short timings: demotion bound D = 1 s, tcp_user_timeout U = 2 s."""

_FIGURES = pytest.StashKey[list[tuple[str, str, str]]]()


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
    made: list[LeaderLock] = []

    def make(dsn: str | None, keys: tuple[int, int], name: str, **kwargs: Any) -> LeaderLock:
        lock = LeaderLock(dsn, *keys, **{**FAST, "name": name, **kwargs})
        beliefs.attach(lock, name)
        made.append(lock)
        return lock

    try:
        yield make
    finally:
        results = await asyncio.gather(
            *(lock.shutdown(timeout_s=15) for lock in made), return_exceptions=True
        )
        for lock, result in zip(made, results, strict=True):
            if isinstance(result, ShutdownError):
                beliefs.end(lock.name or "?", "stop")


@pytest.fixture
def figures(
    request: pytest.FixtureRequest, record_property: Callable[[str, object], None]
) -> Callable[[str, float, str], None]:
    """``figures(metric, value, unit)``: a measured figure (``unit="ms"`` takes seconds and
    shows milliseconds), shown in the test's output,
    recorded as a JUnit property, and printed in the suite's final table."""
    rows = request.config.stash.setdefault(_FIGURES, [])

    def add(metric: str, value: float, unit: str = "s") -> None:
        if unit == "ms":
            shown = f"{value * 1000:.1f} ms"
        elif float(value).is_integer():
            shown = f"{int(value)} {unit}"
        else:
            shown = f"{value:.3f} {unit}"
        rows.append((request.node.name, metric, shown))
        record_property(metric, value)
        print(f"{metric}: {shown}")

    return add


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    rows = terminalreporter.config.stash.get(_FIGURES, None)
    if not rows:
        return
    terminalreporter.write_sep("-", "fault suite figures")
    width_test = max(len(r[0]) for r in rows)
    width_metric = max(len(r[1]) for r in rows)
    for test, metric, value in rows:
        terminalreporter.write_line(f"{test:<{width_test}}  {metric:<{width_metric}}  {value}")


@pytest.fixture
def children_log(tmp_path: Path) -> Iterator[IO[str]]:
    """Where child processes' stderr (the library's warnings) goes; its path is printed."""
    path = tmp_path / "children.log"
    print(f"children's stderr: {path}")
    with path.open("w") as log:
        yield log


@pytest.fixture
def netns_link() -> Iterator[NetnsLink]:
    """A namespace + veth link on a private /30; skipped when netns cannot be used."""
    reason = netns_unavailable_reason()
    if reason is not None:
        pytest.skip(reason)
    link = NetnsLink()
    try:
        link.start()
    except NetnsUnavailableError as exc:
        pytest.skip(f"network namespaces unavailable: {exc}")
    try:
        yield link
    finally:
        link.close()
