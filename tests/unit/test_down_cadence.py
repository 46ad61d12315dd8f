"""A server that looks down is tried again soon (issue 32): the machine tells the retry
strategy how long every failure has come at once (``RetryContext.down_for_s``: refused,
closed, no primary, a session that died), and ``ExponentialBackoff(down_s=...)`` (the
default strategy's ``down_s=0.1``) retries at that cadence for ``down_window_s``, while
timeouts, a busy server and a lock held elsewhere keep their back-off. (These tests fail
on the code before: the context had no ``down_for_s``, and after a failover the default
strategy waited up to 2 s.)"""

from __future__ import annotations

import random
from typing import Any

import pytest

from pgleaderlock import (
    ConfigurationError,
    ConnectionError,
    ExponentialBackoff,
    LockState,
    RetryContext,
    RetryStrategy,
    ServerRefusedError,
)
from pgleaderlock.core.machine import Answered, Connected, Failed, Sleep, Started, Woke
from pgleaderlock.core.retry import default_retry_strategy
from support import machine
from support.machine import Recording

S = LockState


class Driver(machine.Driver):
    """The shared hand-fed driver (tests/support/machine.py), seeded, with ``slept``."""

    def __init__(self, retry: RetryStrategy, **kwargs: Any) -> None:
        super().__init__(retry, random.Random(0), **kwargs)

    def slept(self) -> float:
        last = self.effects[-1]
        assert isinstance(last, Sleep), self.effects
        return last.until - self.now


def refused_once(**kwargs: Any) -> tuple[Recording, Driver]:
    """A driver whose first connect was refused at once, and whose retry sleep is over."""
    retry = Recording()
    d = Driver(retry, **kwargs)
    d.feed(Started())
    d.feed(Failed(ConnectionError("refused")), after=0.01)
    d.feed(Woke(), after=1.0)
    return retry, d


class Busy(Exception):
    sqlstate = "53300"  # too_many_connections


def busy() -> ConnectionError:
    error = ConnectionError("connect: OperationalError: FATAL: sorry, too many clients")
    error.__cause__ = Busy("too many connections")
    return error


def test_quick_connect_failures_say_how_long_the_server_has_looked_down() -> None:
    retry, d = refused_once()
    d.feed(Failed(ConnectionError("refused")), after=0.02)
    d.feed(Woke(), after=1.0)
    d.feed(Failed(ConnectionError("closed")), after=0.01)
    downs = [c.down_for_s for c in retry.contexts]
    assert downs == pytest.approx([0.0, 1.02, 2.03])


@pytest.mark.parametrize(
    ("error", "took_s"),
    [
        (ConnectionError("connect: timed out"), 2.9),  # a black hole: slow
        (ConnectionError("connect: timed out"), 1.5),  # half the connect bound (3 s)
        (busy(), 0.01),  # the server is at max_connections: do not add to it
        (ConnectionError("connect: FATAL: no more connections allowed (max_client_conn)"), 0.01),
        (ServerRefusedError("password authentication failed"), 0.01),  # permanent
    ],
    ids=["timeout", "half-the-bound", "too-many-clients", "pooler-full", "refused-for-good"],
)
def test_slow_busy_or_permanent_failures_are_not_down(error: Exception, took_s: float) -> None:
    retry, d = refused_once(retry_permanent_errors=True)
    d.feed(Failed(error), after=took_s)
    assert [c.down_for_s is None for c in retry.contexts] == [False, True]


def test_a_held_lock_and_a_connection_reset_the_down_time() -> None:
    retry, d = refused_once()
    d.feed(Connected(can_wait=True), after=0.01)
    d.feed(Answered(False), after=0.01)  # held elsewhere: not an error, not down
    d.feed(Failed(ConnectionError("the session died")), after=5.0)  # a wait, not quick
    assert [c.down_for_s for c in retry.contexts] == [0.0, None, None]


def test_a_session_that_dies_at_once_starts_the_down_time() -> None:
    """A waiting follower whose server crashes: its wait ends at once, with an error."""
    retry = Recording()
    d = Driver(retry)
    d.feed(Started())
    d.feed(Connected(can_wait=True))
    d.feed(Answered(False), after=0.01)  # then waits on the server for 1 s
    d.feed(Failed(ConnectionError("terminating connection")), after=0.3)
    assert [c.down_for_s for c in retry.contexts] == [None, 0.0]


def test_a_reconnecting_leader_is_told_too() -> None:
    retry = Recording()
    d = Driver(retry, reconnect_grace_s=30.0)
    d.feed(Started())
    d.feed(Connected(can_wait=True))
    d.feed(Answered(True))
    assert d.machine.state is S.LEADER
    d.feed(Woke(), after=5.0)  # the probe
    d.feed(Failed(ConnectionError("gone")), after=0.01)
    assert d.machine.state is S.RECONNECTING  # type: ignore[comparison-overlap]
    d.feed(Failed(ConnectionError("refused")), after=0.01)
    d.feed(Woke(), after=1.0)
    d.feed(Failed(ConnectionError("refused")), after=0.01)
    assert [c.down_for_s for c in retry.contexts] == pytest.approx([0.01, 1.02])


def test_exponential_backoff_retries_at_the_down_cadence_within_its_window() -> None:
    strategy = ExponentialBackoff(error_max_s=2.0, down_s=0.1, down_window_s=60.0)
    error = ConnectionError("refused")

    def delay(attempt: int, down: float | None, err: Exception | None = error) -> float:
        return strategy.next_delay_s(RetryContext(attempt, 100.0, err, down))

    assert [delay(n, 0.0) for n in (1, 5, 50)] == [0.1, 0.1, 0.1]
    assert delay(7, 59.9) == 0.1
    assert delay(7, 60.0) == 2.0  # the window is over: the error back-off
    assert delay(7, None) == 2.0  # a timeout
    assert delay(1, None, None) == 1.0  # held elsewhere
    assert ExponentialBackoff(error_max_s=2.0).next_delay_s(RetryContext(7, 1, error, 1)) == 2
    assert "down_s=0.1, down_window_s=60.0" in repr(strategy)
    with pytest.raises(ConfigurationError, match="down_s"):
        ExponentialBackoff(down_s=0)
    with pytest.raises(ConfigurationError, match="down_window_s"):
        ExponentialBackoff(down_window_s=-1)


def test_the_default_strategy_finds_a_failed_over_primary_within_a_tenth_of_a_second() -> None:
    """A follower waited on the server for an hour (its attempts count up); the primary
    crashes, the HA manager promotes another host 12 s later. The default strategy
    retries every 0.1 s meanwhile, so the promoted primary is tried at most 0.1 s after
    it accepts connections (before: every 2 s)."""
    d = Driver(default_retry_strategy())
    d.feed(Started())
    d.feed(Connected(can_wait=True))
    for _ in range(200):  # an hour of waits on the server
        d.feed(Answered(False), after=float(d.effects[-1].wait_s or 0.0))  # type: ignore[union-attr]
    crashed = d.now
    d.feed(Failed(ConnectionError("server closed the connection")), after=0.02)
    delays = [d.slept()]
    while d.now - crashed < 12.0:
        d.feed(Woke(), after=d.slept())
        d.feed(Failed(ConnectionError("refused")), after=0.003)
        delays.append(d.slept())
    assert max(delays) == pytest.approx(0.1)
    assert len(delays) > 100
