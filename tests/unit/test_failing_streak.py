"""The escalation of errors that keep a lock from leading (core.machine.failing): which
line each error of a streak gets, when the summaries come, and what they advise."""

from __future__ import annotations

import itertools

import pytest

from pgleaderlock import ConnectionError, ServerRefusedError
from pgleaderlock.core.machine.failing import MAX_SUMMARY_INTERVAL_S, FailingStreak, what_to_check


def test_an_error_every_two_seconds_gives_one_error_line_then_doubling_summaries() -> None:
    streak = FailingStreak(escalate_after_s=30.0)
    error = ConnectionError("connect: failed to resolve host 'db.internal'")
    lines = [(t, streak.error(error, str(error), float(t))) for t in range(0, 4000, 2)]
    errors = [(t, line.message) for t, line in lines if line.level == "error"]
    assert errors[0] == (0, "db_error")
    summaries = [t for t, message in errors[1:] if message == "lock_failing"]
    assert len(errors) == 1 + len(summaries)  # nothing else at ERROR
    assert summaries[:5] == [30, 60, 120, 240, 480]
    gaps = [b - a for a, b in itertools.pairwise(summaries)]
    assert max(gaps) <= MAX_SUMMARY_INTERVAL_S
    fields = dict(next(line for t, line in lines if t == 60).fields)
    assert fields["failing_for_s"] == 60.0
    assert fields["errors"] == 31
    assert "does not resolve" in str(fields["check"])
    assert streak.since == 0.0
    ended = streak.end(4000.0)
    assert ended is not None
    assert ended.message == "failing_ended"
    assert dict(ended.fields)["failed_for_s"] == 4000.0
    assert streak.since is None


def test_a_different_error_is_logged_at_error_and_a_short_streak_ends_quietly() -> None:
    streak = FailingStreak(escalate_after_s=30.0)
    refused = ConnectionError("connect: Connection refused")
    limit = ConnectionError('connect: FATAL: too many connections for role "app"')
    assert streak.error(refused, str(refused), 0.0).level == "error"
    assert streak.error(refused, str(refused), 2.0).level == "debug"
    assert streak.error(limit, str(limit), 4.0).level == "error"
    assert streak.end(5.0) is None  # no summary was logged: nothing to announce


def test_hints_name_what_to_check() -> None:
    assert "CONNECTION LIMIT" in what_to_check(ConnectionError("too many connections for role"))
    assert "listen_addresses" in what_to_check(ConnectionError("Connection refused"))
    assert "password" in what_to_check(ServerRefusedError("password authentication failed"))
    assert "psql" in what_to_check(ConnectionError("something else"))


def test_a_coordinator_passes_escalate_after_s_on_and_checks_it() -> None:
    """A Coordinator's locks escalate like a LeaderLock's, after the bound it is given."""
    from pgleaderlock import Coordinator, LockOptions, Timing
    from pgleaderlock.core.errors import ConfigurationError

    options = LockOptions(timing=Timing(escalate_after_s=7))
    coordinator = Coordinator("postgresql://u@h/db", group="g", options=options)
    assert coordinator._settings.config.escalate_after_s == 7
    assert coordinator._settings.lock_kwargs["escalate_after_s"] == 7
    with pytest.raises(ConfigurationError, match="escalate_after_s"):
        Coordinator(
            "postgresql://u@h/db", group="g", options=LockOptions(timing=Timing(escalate_after_s=0))
        )
