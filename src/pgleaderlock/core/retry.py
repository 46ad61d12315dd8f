"""Retry strategies.

A strategy is asked for a delay after every failed acquisition attempt and after every
failed (re)connection; the same strategy governs both. Returning ``None``
gives up: the lock goes to STOPPED.
"""

from __future__ import annotations

import math
import random
from typing import Protocol, runtime_checkable

from ._logging import get_logger
from .config import positive
from .errors import ConfigurationError
from .models import RetryContext

__all__ = [
    "DecorrelatedJitter",
    "ExponentialBackoff",
    "FixedInterval",
    "RetryContext",
    "RetryStrategy",
    "ask",
    "check_retry_strategy",
    "default_retry_strategy",
    "delay_or_give_up",
]


@runtime_checkable
class RetryStrategy(Protocol):
    """Decides how long to wait before the next attempt."""

    def next_delay_s(self, ctx: RetryContext) -> float | None:
        """Return seconds to sleep before the next attempt, or ``None`` to stop retrying
        (an infinite delay stops too; a negative or NaN one is 0: see `ask`)."""
        ...


class ExponentialBackoff:
    """``min(base_s * multiplier ** (attempt - 1), max_s)``.

    Args:
        base_s: delay after the first failed attempt.
        max_s: upper bound for any delay.
        multiplier: growth factor per attempt (>= 1).
        error_max_s: upper bound for a delay after a connection error (``ctx.last_error``
            set), if lower than ``max_s``; ``None``: ``max_s``. A waiting follower can
            afford long waits, while a server that went away should be tried again soon:
            a promoted primary is then found within ``error_max_s`` (the lock's default
            strategy is ``ExponentialBackoff(error_max_s=2.0, down_s=0.1)``).
        down_s: the delay while the server looks down rather than slow
            (``ctx.down_for_s`` set: every host refused or closed the connection at
            once, or was no primary; the session died), if lower than the delay
            otherwise due, for the first ``down_window_s`` of it; ``None``: no such
            cadence. Such attempts cost next to nothing (a refused connection never
            reaches PostgreSQL), and a failed-over primary is found within ``down_s``
            of accepting connections. Timeouts and a server that is too busy keep the
            back-off.
        down_window_s: how long the ``down_s`` cadence lasts (from the first of those
            failures); then ``error_max_s`` again. The default, 60 s, covers Patroni's
            default failover (``ttl`` 30 s plus ``loop_wait`` 10 s).
    """

    def __init__(
        self,
        base_s: float = 1.0,
        max_s: float = 30.0,
        multiplier: float = 2.0,
        *,
        error_max_s: float | None = None,
        down_s: float | None = None,
        down_window_s: float = 60.0,
    ) -> None:
        self.base_s = positive("base_s", base_s)
        self.max_s = positive("max_s", max_s)
        self.multiplier = positive("multiplier", multiplier)
        if self.multiplier < 1:
            raise ConfigurationError(f"multiplier must be >= 1, got {multiplier!r}")
        if self.max_s < self.base_s:
            raise ConfigurationError(f"max_s ({max_s}) must be >= base_s ({base_s})")
        self.error_max_s = None if error_max_s is None else positive("error_max_s", error_max_s)
        self.down_s = None if down_s is None else positive("down_s", down_s)
        self.down_window_s = positive("down_window_s", down_window_s)

    def next_delay_s(self, ctx: RetryContext) -> float:
        limit = self.max_s
        if ctx.last_error is not None and self.error_max_s is not None:
            limit = min(limit, self.error_max_s)
        down = ctx.down_for_s
        if self.down_s is not None and down is not None and down < self.down_window_s:
            limit = min(limit, self.down_s)
        exponent = max(ctx.attempt, 1) - 1
        # Compare in log space: multiplier ** exponent overflows floats for large attempts.
        if exponent * math.log(self.multiplier) >= math.log(limit / self.base_s):
            return limit
        return min(self.base_s * self.multiplier**exponent, limit)

    def __repr__(self) -> str:
        error = "" if self.error_max_s is None else f", error_max_s={self.error_max_s}"
        if self.down_s is not None:
            error += f", down_s={self.down_s}, down_window_s={self.down_window_s}"
        return (
            f"ExponentialBackoff(base_s={self.base_s}, max_s={self.max_s}, "
            f"multiplier={self.multiplier}{error})"
        )


def ask(strategy: RetryStrategy, ctx: RetryContext) -> float | None:
    """How long to sleep before the next attempt, as ``strategy`` says: ``None`` gives
    up, and so does an infinite delay (a lock that would never try again, yet never
    stop); a negative or NaN delay is 0. What the strategy raises propagates: every
    caller logs it and gives up."""
    delay = strategy.next_delay_s(ctx)
    if delay is None:
        return None
    delay = float(delay)
    if math.isnan(delay) or delay < 0:
        return 0.0
    return None if math.isinf(delay) else delay


def delay_or_give_up(strategy: RetryStrategy, ctx: RetryContext, label: str) -> float | None:
    """`ask`, for a caller with nobody to raise to (a supervised task, a coordinator's
    reconnection): a strategy that raises is logged and gives up, like one returning
    ``None``."""
    try:
        return ask(strategy, ctx)
    except Exception as exc:
        get_logger().error("retry_strategy_failed", lock=label, error=repr(exc), exc_info=True)
        return None


def check_retry_strategy(strategy: object) -> None:
    """Refuse a ``retry_strategy`` (other than ``None``) without ``next_delay_s(ctx)``.

    Raises:
        ConfigurationError: it has none.
    """
    if strategy is not None and not callable(getattr(strategy, "next_delay_s", None)):
        raise ConfigurationError(
            f"retry_strategy must have a next_delay_s(ctx) method, got {strategy!r}"
        )


def default_retry_strategy() -> ExponentialBackoff:
    """The strategy a lock uses when given none:
    ``ExponentialBackoff(error_max_s=2.0, down_s=0.1)``.

    Waits for a lock held elsewhere grow from 1 s to 30 s (a waiting follower is granted
    the lock the instant it is freed anyway); after a connection error the next attempt
    comes at most 2 s later; while the server looks down (every host refuses or closes
    the connection at once, or is no primary: a failover under way) every 0.1 s for up
    to a minute, so that a failed-over primary is found within 0.1 s of accepting
    connections.
    """
    return ExponentialBackoff(error_max_s=2.0, down_s=0.1)


class FixedInterval:
    """A constant delay.

    Args:
        interval_s: seconds between attempts.
    """

    def __init__(self, interval_s: float = 5.0) -> None:
        self.interval_s = positive("interval_s", interval_s)

    def next_delay_s(self, ctx: RetryContext) -> float:
        return self.interval_s

    def __repr__(self) -> str:
        return f"FixedInterval(interval_s={self.interval_s})"


class DecorrelatedJitter:
    """AWS-style decorrelated jitter: ``min(max_s, random(base_s, prev_delay * 3))``.

    The previous delay starts at ``base_s`` at the first attempt of every cycle.

    Args:
        base_s: lower bound of every delay, and the first "previous delay".
        max_s: upper bound of every delay.
        rng: random source; pass ``random.Random(seed)`` for reproducible delays.
    """

    def __init__(
        self, base_s: float = 1.0, max_s: float = 30.0, *, rng: random.Random | None = None
    ) -> None:
        self.base_s = positive("base_s", base_s)
        self.max_s = positive("max_s", max_s)
        if self.max_s < self.base_s:
            raise ConfigurationError(f"max_s ({max_s}) must be >= base_s ({base_s})")
        self._rng = rng if rng is not None else random.Random()
        self._prev = self.base_s

    def next_delay_s(self, ctx: RetryContext) -> float:
        if ctx.attempt <= 1:
            self._prev = self.base_s
        delay = min(self.max_s, self._rng.uniform(self.base_s, self._prev * 3))
        self._prev = delay
        return delay

    def __repr__(self) -> str:
        return f"DecorrelatedJitter(base_s={self.base_s}, max_s={self.max_s})"
