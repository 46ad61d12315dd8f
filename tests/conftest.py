"""Shared fixtures: the test database (``pg_dsn``) and private clusters (``throwaway_pg``)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from pgleaderlock.testing.postgres import ThrowawayPostgres, resolve_test_dsn

_PG_DESCRIPTION = pytest.StashKey[str]()


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


@pytest.fixture
def throwaway_pg() -> Iterator[ThrowawayPostgres]:
    """A private, started PostgreSQL cluster that the test may stop, kill or restart."""
    with ThrowawayPostgres() as pg:
        yield pg


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    description = terminalreporter.config.stash.get(_PG_DESCRIPTION, None)
    if description is not None:
        terminalreporter.write_sep("-", f"pgleaderlock test database: {description}")
