"""The command line's retry policies: how long a command keeps trying for the lock.

There are two, on purpose, because the commands want different things:

- ``run`` takes part in an election for as long as it runs: it retries forever, with
  the library's [`ExponentialBackoff`][pgleaderlock.ExponentialBackoff] (``--retry-base``,
  ``--retry-max``), through connection trouble as well;
- ``acquire`` and ``exec`` make one bounded try: `Deadline` retries only until ``--wait``
  has passed (``--wait 0``: a single attempt), in steps of at most `WAIT_CHUNK_S`; their
  lock waits on the server (``follower_mode="wait"``), so each step is spent queued there
  and the lock is taken the instant its holder lets go.

Both are wrapped in `FailFast` (see `build_lock`): a server that was never reached is a
configuration problem to report at once, not something to retry.
"""

from __future__ import annotations

import time

from ..lowlevel import RetryContext, RetryStrategy
from .tracker import Tracker

__all__ = ["WAIT_CHUNK_S", "Deadline", "FailFast"]

WAIT_CHUNK_S = 5.0
"""``--wait``: the longest single wait on the server (one acquisition attempt)."""


class FailFast:
    """Gives up when the server could never be reached; otherwise asks ``inner``."""

    def __init__(self, inner: RetryStrategy, tracker: Tracker) -> None:
        self._inner = inner
        self._tracker = tracker

    def next_delay_s(self, ctx: RetryContext) -> float | None:
        """None after an error if no session was ever opened, else ``inner``'s delay."""
        if ctx.last_error is not None and not self._tracker.reached_server:
            return None
        return self._inner.next_delay_s(ctx)


class Deadline:
    """Retry until ``wait_s`` after `start`, in waits of at most `WAIT_CHUNK_S`.

    ``wait_s=0`` gives up after the first failed attempt: a single try.
    """

    def __init__(self, wait_s: float) -> None:
        self._wait_s = wait_s
        self._deadline = time.monotonic() + wait_s

    def start(self) -> None:
        """Start counting ``wait_s`` now (after the preflight connection)."""
        self._deadline = time.monotonic() + self._wait_s

    def next_delay_s(self, ctx: RetryContext) -> float | None:
        """The time left, capped at `WAIT_CHUNK_S`; None once the time is up."""
        remaining = self._deadline - time.monotonic()
        if remaining <= 0:
            return None
        return min(remaining, WAIT_CHUNK_S)
