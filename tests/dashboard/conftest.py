"""Fixtures of the dashboard tests: a dashboard served over HTTP on 127.0.0.1 by uvicorn
on a thread of the test process (``serve``), server-sent-event clients
(``event_clients``), a database of the test's own (``fresh_db``) and Debian's Chromium
(``chromium_path``; launch it with `support.chromium.launch_options`, loopback only).
The plumbing behind them is `support.dashboard`'s, which the benchmark uses too; when no
Chromium is installed the browser tests skip with the reason (`support.chromium`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from pgleaderlock.dashboard import Dashboard
from support.chromium import require_chromium
from support.dashboard import EventClient, Served, event_clients_of, own_database, served


@pytest.fixture
def chromium_path() -> Path:
    """Debian's Chromium, for Playwright's ``executable_path`` (the test skips, with the
    reason, where none is installed)."""
    return require_chromium()


@pytest.fixture
def serve() -> Callable[..., contextlib.AbstractContextManager[Served]]:
    """``serve(dsn, **options)``: a `Dashboard` of ``dsn``, served (a context manager)."""

    @contextlib.contextmanager
    def make(dsn: str, **options: Any) -> Iterator[Served]:
        with served(Dashboard(dsn, **options)) as running:
            yield running

    return make


@pytest.fixture
def event_clients() -> Callable[..., contextlib.AbstractAsyncContextManager[list[EventClient]]]:
    """``event_clients(url, count)``: ``count`` pages following the dashboard's events."""
    return event_clients_of


@pytest.fixture
def fresh_db(pg_dsn: str) -> Iterator[str]:
    """A database of the test's own on the shared server (so that other tests' locks
    are not on the page), dropped afterwards."""
    with own_database(pg_dsn, "dash") as dsn:
        yield dsn
