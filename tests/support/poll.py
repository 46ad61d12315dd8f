"""Waiting for a condition, bounded: from async code (``eventually``) or from a thread
(``eventually_sync``)."""

from __future__ import annotations

import asyncio
import inspect
import time
from collections.abc import Callable

__all__ = ["eventually", "eventually_sync"]


async def eventually(
    condition: Callable[[], object],
    timeout_s: float = 10.0,
    what: str = "condition",
    poll_s: float = 0.005,
) -> float:
    """Poll ``condition`` until it holds; return the monotonic time it was first seen true.
    ``condition`` may be a coroutine function: its result is awaited.

    Raises:
        TimeoutError: naming ``what``, if it did not hold within ``timeout_s``.
    """
    deadline = time.monotonic() + timeout_s
    while True:
        held = condition()
        if inspect.isawaitable(held):
            held = await held
        if held:
            return time.monotonic()
        if time.monotonic() >= deadline:
            raise TimeoutError(f"{what} did not happen within {timeout_s} s")
        await asyncio.sleep(poll_s)


def eventually_sync(
    condition: Callable[[], object],
    timeout_s: float,
    what: str = "condition",
    poll_s: float = 0.005,
) -> float:
    """``eventually`` for a thread with no event loop: sleeps between the polls.

    Raises:
        TimeoutError: naming ``what``, if it did not hold within ``timeout_s``.
    """
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() >= deadline:
            raise TimeoutError(f"{what} did not happen within {timeout_s} s")
        time.sleep(poll_s)
    return time.monotonic()
