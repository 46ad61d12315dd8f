"""Shared fixtures: the test database (``pg_dsn``), private clusters (``throwaway_pg``),
measured ``figures`` and a cuttable ``netns_link``."""

from __future__ import annotations

import asyncio
import json
import logging
import signal
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

import pgleaderlock
from pgleaderlock import LeaderLock, LockState
from pgleaderlock.testing.postgres import ThrowawayPostgres
from support.fixture_types import Figures, MakeLock, MakeRecorded, MakeRecorder
from support.netns import NetnsLink, NetnsUnavailableError, netns_unavailable_reason
from support.server import Admin, resolve_test_dsn

# Fixture modules shared by several folders (each documents its fixtures), after
# psycopg's tests/fix_*.py: every fixture name is defined once.
pytest_plugins = ["fix_db", "fix_locks", "fix_pgbouncer", "fix_roles"]

_PG_DESCRIPTION = pytest.StashKey[str]()
_JSON_LOG_RECORDS = pytest.StashKey[list[int]]()  # records checked, records that failed
_FIGURES = pytest.StashKey[dict[str, list[tuple[str, str, str]]]]()  # table: test, metric, value


@pytest.fixture(scope="session")
def pg_dsn(request: pytest.FixtureRequest) -> Iterator[str]:
    """DSN of the shared test server, chosen by ``resolve_test_dsn()`` once per session.

    Never stop, restart or kill this server; use ``throwaway_pg`` for that.
    """
    dsn, cleanup, description = resolve_test_dsn()
    config = request.config
    config.stash[_PG_DESCRIPTION] = description
    reporter = config.pluginmanager.get_plugin("terminalreporter")
    capture = config.pluginmanager.get_plugin("capturemanager")
    if reporter is not None and capture is not None:
        with capture.global_and_fixture_disabled():  # show it live, not as captured output
            reporter.ensure_newline()
            reporter.write_line(f"pgleaderlock test database: {description}")
    try:
        yield dsn
    finally:
        cleanup()


def pytest_configure(config: pytest.Config) -> None:
    """The processes the tests start behave as from a terminal, where Ctrl-C works. A
    shell starts a background job (as `make test` starts its lanes) with SIGINT
    ignored, and a child inherits that: a program that quits on KeyboardInterrupt
    (``status --watch``, the quick start) would then never see its Ctrl-C. With a
    handler installed here, children start with SIGINT at its default again."""
    if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
        signal.signal(signal.SIGINT, signal.default_int_handler)


@pytest.fixture
def throwaway_pg() -> Iterator[ThrowawayPostgres]:
    """A private, started PostgreSQL cluster that the test may stop, kill or restart."""
    with ThrowawayPostgres() as pg:
        yield pg


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    description = terminalreporter.config.stash.get(_PG_DESCRIPTION, None)
    if description is not None:
        terminalreporter.write_sep("-", f"pgleaderlock test database: {description}")
    for table, rows in terminalreporter.config.stash.get(_FIGURES, {}).items():
        if not rows:  # its test failed before it measured anything
            continue
        terminalreporter.write_sep("-", table)
        width_test = max(len(r[0]) for r in rows)
        width_metric = max(len(r[1]) for r in rows)
        for test, metric, value in rows:
            terminalreporter.write_line(f"{test:<{width_test}}  {metric:<{width_metric}}  {value}")
    records, failed = terminalreporter.config.stash.get(_JSON_LOG_RECORDS, [0, 0])
    if records:
        terminalreporter.write_sep(
            "-",
            f"JSON log check: {records} pgleaderlock log records formatted as JSON, {failed} failed",
        )


# ---------------------------------------------------------------- measured figures


@pytest.fixture
def figures_table() -> str:
    """The title of the table at the end of the run that lists this test's ``figures``."""
    return "measured figures"


@pytest.fixture
def figures(
    figures_table: str,
    request: pytest.FixtureRequest,
    record_property: Callable[[str, object], None],
) -> Figures:
    """``figures(metric, value, unit="s")``: a measured figure (``unit="ms"`` takes
    seconds and shows milliseconds), printed in the test's output, recorded as a JUnit
    property and listed in the ``figures_table`` table at the end of the run."""
    rows = request.config.stash.setdefault(_FIGURES, {}).setdefault(figures_table, [])

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


# ---------------------------------------------------------------- network namespaces


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


# ---------------------------------------------------------------- JSON log records

_PACKAGE_DIR = str(Path(pgleaderlock.__file__).resolve().parent)

_FORMATTER = logging.Formatter()

PROCESS_EVENTS = frozenset({"plugin_load_failed"})
"""Events about the process rather than one lock: their records carry no ``lock``."""


class JsonLogCheck(logging.Handler):
    """Formats every record of the ``pgleaderlock`` logger as one JSON object, as a JSON
    log formatter would, and keeps what went wrong: a value ``json.dumps`` cannot
    serialise, or a record written by the library without its ``event`` and ``lock``
    fields. Records may come from any thread (a ThreadedLeaderLock's)."""

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.problems: list[str] = []
        self.records = 0
        self._mutex = threading.Lock()

    def emit(self, record: logging.LogRecord) -> None:
        try:
            problem = self._check(record)
        except Exception as exc:  # the formatter raised: exactly what must not happen
            problem = f"{record.name}: {record.getMessage()!r}: {type(exc).__name__}: {exc}"
        with self._mutex:
            self.records += 1
            if problem is not None:
                self.problems.append(problem)

    def _check(self, record: logging.LogRecord) -> str | None:
        fields = getattr(record, "pgleaderlock", None)
        line = {
            "time": record.created,
            "level": record.levelname,
            "logger": record.name,
            "message": record.getMessage(),
            **(fields if isinstance(fields, dict) else {}),
        }
        if record.exc_info:
            line["exception"] = _FORMATTER.formatException(record.exc_info)
        json.dumps(line)
        if not record.pathname.startswith(_PACKAGE_DIR):
            return None  # written by a test, not by the library
        if not isinstance(fields, dict) or not isinstance(fields.get("event"), str):
            return f"{record.name}: {record.getMessage()!r}: no event field"
        if "lock" not in fields and fields["event"] not in PROCESS_EVENTS:
            return f"{record.name}: {record.getMessage()!r}: no lock field"
        return None


@pytest.fixture
def json_log_level() -> int | None:
    """The ``pgleaderlock`` logger's level during a test under ``json_log_check``; None
    leaves it as it is (WARNING and up reach the handler). tests/faults sets DEBUG."""
    return None


@pytest.fixture(autouse=True)
def json_log_check(
    json_log_level: int | None, request: pytest.FixtureRequest
) -> Iterator[JsonLogCheck]:
    """Every test: each record the library logs is formatted as JSON
    (``json.dumps`` of ``record.pgleaderlock`` and the standard fields) and must carry
    ``event`` and ``lock``; the test fails at teardown if one did not, or could not be
    formatted."""
    logger = logging.getLogger("pgleaderlock")
    handler = JsonLogCheck()
    level = logger.level
    logger.addHandler(handler)
    if json_log_level is not None:
        logger.setLevel(json_log_level)
    try:
        yield handler
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)
    totals = request.config.stash.setdefault(_JSON_LOG_RECORDS, [0, 0])
    totals[0] += handler.records
    totals[1] += len(handler.problems)
    if handler.problems:
        shown = "\n".join(handler.problems[:20])
        pytest.fail(
            f"{len(handler.problems)} of {handler.records} log records failed the JSON "
            f"check:\n{shown}",
            pytrace=False,
        )


class Recorder:
    """Registers a callback for every event of a lock and records them in order."""

    def __init__(self, lock: LeaderLock) -> None:
        self.lock = lock
        self.events: list[tuple[str, object]] = []
        self._changed = asyncio.Condition()
        lock.on_acquired(lambda: self._add("acquired"))
        lock.on_released(lambda: self._add("released"))
        lock.on_lost(lambda: self._add("lost"))
        lock.on_acquire_failed(lambda: self._add("acquire_failed"))
        lock.on_stopped(lambda: self._add("stopped"))
        lock.on_error(lambda exc: self._add("error", exc))
        lock.on_state_change(lambda a, b: self._add("state", (a, b)))

    async def _add(self, name: str, arg: object = None) -> None:
        self.events.append((name, arg))
        async with self._changed:
            self._changed.notify_all()

    def names(self, *, states: bool = False) -> list[str]:
        return [n for n, _ in self.events if states or n != "state"]

    def states(self) -> list[LockState]:
        return [arg[1] for n, arg in self.events if n == "state"]  # type: ignore[index]

    def errors(self) -> list[BaseException]:
        return [arg for n, arg in self.events if n == "error"]  # type: ignore[misc]

    async def wait(self, predicate: Callable[[], object], timeout: float = 5.0) -> None:
        async with asyncio.timeout(timeout), self._changed:
            await self._changed.wait_for(predicate)

    async def wait_event(self, name: str, count: int = 1, timeout: float = 5.0) -> None:
        await self.wait(lambda: self.names().count(name) >= count, timeout)

    async def wait_state(self, state: LockState, timeout: float = 5.0) -> None:
        await self.wait(lambda: self.lock.state is state, timeout)

    async def follow(
        self, leader: LeaderLock, lead_timeout: float = 5.0, timeout: float = 5.0
    ) -> None:
        """Start ``leader`` and wait until it leads, then start this lock and wait until
        it follows (an attempt failed)."""
        await leader.start()
        assert await leader.wait_for_leadership(lead_timeout)
        await self.lock.start()
        await self.wait_event("acquire_failed", timeout=timeout)


@pytest.fixture
def recorder() -> MakeRecorder:
    """``recorder(lock)`` records every callback of ``lock`` in order."""
    return Recorder


@pytest.fixture
def recorded(make_lock: MakeLock, recorder: MakeRecorder) -> MakeRecorded:
    """``recorded(**options)``: a ``make_lock`` lock, and the ``recorder`` of its callbacks
    (``lock, rec = recorded()``)."""

    def make(**options: Any) -> tuple[LeaderLock, Recorder]:
        lock = make_lock(**options)
        return lock, recorder(lock)

    return make


# ---------------------------------------------------------------- the shared server
# admin, sync_admin, schema, keys, lock_name, holders, waiters, terminate: tests/fix_db.py

__all__ = ["Admin", "JsonLogCheck", "Recorder"]
