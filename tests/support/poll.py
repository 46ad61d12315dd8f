"""Waiting for a condition, bounded."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

__all__ = ["eventually"]


async def eventually(
    condition: Callable[[], bool], timeout_s: float, what: str = "condition", poll_s: float = 0.005
) -> float:
    """Poll ``condition`` until it holds; return the monotonic time it was first seen true.

    Raises:
        TimeoutError: naming ``what``, if it did not hold within ``timeout_s``.
    """
    deadline = time.monotonic() + timeout_s
    while True:
        if condition():
            return time.monotonic()
        if time.monotonic() >= deadline:
            raise TimeoutError(f"{what} did not happen within {timeout_s} s")
        await asyncio.sleep(poll_s)
