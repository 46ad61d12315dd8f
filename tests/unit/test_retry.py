"""The bundled retry strategies, deterministically."""

from __future__ import annotations

import math
import random
from collections.abc import Callable

import pytest

from pgleaderlock import (
    ConfigurationError,
    DecorrelatedJitter,
    ExponentialBackoff,
    FixedInterval,
    RetryContext,
    RetryStrategy,
)
from pgleaderlock.core.retry import ask


def ctx(attempt: int) -> RetryContext:
    return RetryContext(attempt=attempt, elapsed_s=0.0, last_error=None)


def test_exponential_backoff_defaults() -> None:
    strategy = ExponentialBackoff()
    assert [strategy.next_delay_s(ctx(n)) for n in range(1, 8)] == [1, 2, 4, 8, 16, 30, 30]


def test_exponential_backoff_custom_and_huge_attempts() -> None:
    strategy = ExponentialBackoff(base_s=0.5, max_s=10, multiplier=3)
    assert [strategy.next_delay_s(ctx(n)) for n in (1, 2, 3, 4)] == [0.5, 1.5, 4.5, 10]
    assert strategy.next_delay_s(ctx(10_000)) == 10  # no float overflow
    assert ExponentialBackoff(multiplier=1).next_delay_s(ctx(50)) == 1


def test_fixed_interval() -> None:
    strategy = FixedInterval(2.5)
    assert {strategy.next_delay_s(ctx(n)) for n in range(1, 20)} == {2.5}
    assert FixedInterval().next_delay_s(ctx(1)) == 5.0


def test_decorrelated_jitter_is_reproducible_and_bounded() -> None:
    a = DecorrelatedJitter(base_s=1, max_s=30, rng=random.Random(42))
    b = DecorrelatedJitter(base_s=1, max_s=30, rng=random.Random(42))
    delays_a = [a.next_delay_s(ctx(n)) for n in range(1, 50)]
    delays_b = [b.next_delay_s(ctx(n)) for n in range(1, 50)]
    assert delays_a == delays_b
    assert all(1 <= d <= 30 for d in delays_a)
    assert max(delays_a) == 30  # it reaches the cap


def test_decorrelated_jitter_follows_the_formula() -> None:
    rng = random.Random(7)
    expected_rng = random.Random(7)
    strategy = DecorrelatedJitter(base_s=1, max_s=30, rng=rng)
    prev = 1.0
    for n in range(1, 10):
        expected = min(30.0, expected_rng.uniform(1.0, prev * 3))
        assert strategy.next_delay_s(ctx(n)) == expected
        prev = expected


def test_decorrelated_jitter_restarts_each_cycle() -> None:
    strategy = DecorrelatedJitter(base_s=1, max_s=100, rng=random.Random(1))
    for n in range(1, 10):
        strategy.next_delay_s(ctx(n))
    assert strategy.next_delay_s(ctx(1)) <= 3  # prev reset to base_s: uniform(1, 3)


def test_strategies_satisfy_the_protocol() -> None:
    for strategy in (ExponentialBackoff(), FixedInterval(), DecorrelatedJitter()):
        assert isinstance(strategy, RetryStrategy)


@pytest.mark.parametrize(
    ("factory", "match"),
    [
        (lambda: ExponentialBackoff(base_s=0), "base_s"),
        (lambda: ExponentialBackoff(max_s=-1), "max_s"),
        (lambda: ExponentialBackoff(multiplier=0.5), "multiplier must be >= 1"),
        (lambda: ExponentialBackoff(base_s=10, max_s=1), "max_s .* must be >= base_s"),
        (lambda: FixedInterval(0), "interval_s"),
        (lambda: FixedInterval(float("inf")), "interval_s"),
        (lambda: FixedInterval("5"), "must be a number"),  # type: ignore[arg-type]
        (lambda: DecorrelatedJitter(base_s=5, max_s=1), "max_s"),
    ],
)
def test_bad_parameters(factory: Callable[[], RetryStrategy], match: str) -> None:
    with pytest.raises(ConfigurationError, match=match):
        factory()


def test_repr() -> None:
    assert repr(FixedInterval(3)) == "FixedInterval(interval_s=3.0)"
    assert "ExponentialBackoff(base_s=1.0" in repr(ExponentialBackoff())


class _Says:
    def __init__(self, delay: float | None) -> None:
        self.delay = delay

    def next_delay_s(self, ctx: RetryContext) -> float | None:
        return self.delay


@pytest.mark.parametrize(
    ("said", "slept"),
    [(1.5, 1.5), (0, 0.0), (None, None), (-3, 0.0), (math.nan, 0.0), (math.inf, None)],
)
def test_ask_reads_a_delay_the_same_way_for_every_caller(
    said: float | None, slept: float | None
) -> None:
    """The lock and ``LeaderTasks`` read a strategy's answer through ``ask``: an
    infinite delay gives up (they used to disagree: retry at once, or wait forever)."""
    assert ask(_Says(said), RetryContext(1, 0.0, None)) == slept
