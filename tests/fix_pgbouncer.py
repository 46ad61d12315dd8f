"""The PgBouncer fixtures (a ``pytest_plugins`` module of ``tests/conftest.py``), on
:class:`support.pgbouncer.PgBouncer`.

- ``pgbouncer_factory`` (session): ``pgbouncer_factory("transaction")`` gives the shared
  instance of that mode, in front of the shared test server (``pg_dsn``), started on
  first use and stopped at the end of the run. Do not kill or restart it.
- ``pgbouncer`` (per test, parametrized ``[session]``, ``[transaction]``,
  ``[statement]``): the shared instance of each mode in turn.
- ``make_pgbouncer`` (per test): ``make_pgbouncer(pool_mode, backend_dsn=None, **kw)``
  starts a private instance (in front of ``pg_dsn`` by default, or of a
  ``throwaway_pg``) that the test may kill or restart; closed at teardown.

When no ``pgbouncer`` binary is installed they skip, with the reason (see
``support.pgbouncer``).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import pytest

from support.pgbouncer import POOL_MODES, PgBouncer, PoolMode, pgbouncer_unavailable_reason


def _skip_if_unavailable() -> None:
    reason = pgbouncer_unavailable_reason()
    if reason is not None:
        pytest.skip(reason)


@pytest.fixture(scope="session")
def pgbouncer_factory(pg_dsn: str) -> Iterator[Callable[[PoolMode], PgBouncer]]:
    """``pgbouncer_factory(mode)``: the run's shared PgBouncer of that pool mode in front
    of the shared test server, started on first use. Never kill or restart it."""
    shared: dict[PoolMode, PgBouncer] = {}

    def get(pool_mode: PoolMode) -> PgBouncer:
        _skip_if_unavailable()
        if pool_mode not in shared:
            bouncer = PgBouncer(pg_dsn, pool_mode)
            bouncer.start()
            shared[pool_mode] = bouncer
        return shared[pool_mode]

    try:
        yield get
    finally:
        for bouncer in shared.values():
            bouncer.close()


@pytest.fixture(params=POOL_MODES)
def pgbouncer(
    request: pytest.FixtureRequest, pgbouncer_factory: Callable[[PoolMode], PgBouncer]
) -> PgBouncer:
    """The shared PgBouncer of each pool mode in turn (``[session]``, ``[transaction]``,
    ``[statement]``)."""
    mode: PoolMode = request.param
    return pgbouncer_factory(mode)


@pytest.fixture
def make_pgbouncer(pg_dsn: str) -> Iterator[Callable[..., PgBouncer]]:
    """``make_pgbouncer(pool_mode, backend_dsn=None, **kwargs)``: a started private
    PgBouncer (``kwargs`` go to :class:`PgBouncer`) that the test may stop, kill or
    restart; in front of the shared server unless ``backend_dsn`` is given. Closed at
    teardown, even when the test fails."""
    made: list[PgBouncer] = []

    def make(
        pool_mode: PoolMode = "session", backend_dsn: str | None = None, **kwargs: object
    ) -> PgBouncer:
        _skip_if_unavailable()
        bouncer = PgBouncer(backend_dsn or pg_dsn, pool_mode, **kwargs)  # type: ignore[arg-type]
        made.append(bouncer)
        bouncer.start()
        return bouncer

    try:
        yield make
    finally:
        for bouncer in made:
            bouncer.close()
