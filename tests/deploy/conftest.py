"""Fixtures of the deployment suite (real poolers, standbys, failover).

Replication (``support.replication``, ``support.blackhole``):

- ``replication_pair`` (session): one primary + streaming standby shared by the tests
  that only read, lock or write rows. Never promote, crash or stop it.
- ``make_replication_pair`` (function): ``make_replication_pair(**kwargs)`` starts a fresh
  ``PrimaryStandby(**kwargs)`` (about 1.3 s; from async code use
  ``await asyncio.to_thread(make_replication_pair)``); the test may promote, crash or stop
  it. Every pair made is closed at teardown.
- ``blackhole``: a ``BlackHole`` listener that never answers.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from support.blackhole import BlackHole
from support.replication import PrimaryStandby

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

_DEPLOY_FIGURES = pytest.StashKey[list[tuple[str, str, str]]]()


@pytest.fixture
def figures(
    request: pytest.FixtureRequest, record_property: Callable[[str, object], None]
) -> Callable[..., None]:
    """``figures(metric, seconds, unit="s")``: a measured figure (``unit="ms"`` shows
    milliseconds), printed in the test's output, recorded as a JUnit property and listed
    in the "deployment figures" table at the end of the run."""
    rows = request.config.stash.setdefault(_DEPLOY_FIGURES, [])

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
    rows = terminalreporter.config.stash.get(_DEPLOY_FIGURES, None)
    if not rows:
        return
    terminalreporter.write_sep("-", "deployment figures")
    width_test = max(len(r[0]) for r in rows)
    width_metric = max(len(r[1]) for r in rows)
    for test, metric, value in rows:
        terminalreporter.write_line(f"{test:<{width_test}}  {metric:<{width_metric}}  {value}")
