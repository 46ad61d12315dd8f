"""Connection options that can only be wrong at connect are reported once and stop the
lock (like the permanent errors of tests/deploy/test_permanent_errors.py), and
``lock.stop_error`` says why."""

from __future__ import annotations

import pytest

from pgleaderlock import ConfigurationError, LeaderLock, LockOptions, LockState, Session

pytestmark = [pytest.mark.integration, pytest.mark.timeout(30)]


@pytest.mark.parametrize(
    ("backend", "suffix", "match"),
    [
        ("psycopg", "?sslmode=sometimes", "sslmode"),
        ("asyncpg", "?no_such_parameter=1", "no_such_parameter"),
    ],
)
async def test_a_bad_connection_option_stops_the_lock(
    pg_dsn: str, backend: str, suffix: str, match: str
) -> None:
    url = pg_dsn if pg_dsn.startswith("postgres") else f"postgresql:///?{pg_dsn}"
    dsn = url.split("?")[0] + suffix
    lock = LeaderLock(
        dsn, 1, 2, options=LockOptions(session=Session(backend=backend), load_plugins=False)
    )
    assert lock.stop_error is None
    async with lock:
        with pytest.raises(ConfigurationError, match=match):
            await lock.wait_for_leadership(10)
        assert lock.state is LockState.STOPPED
    assert isinstance(lock.stop_error, ConfigurationError)
