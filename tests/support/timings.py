"""Short lock timings for tests, written once: ``timings(...)``, and ``FAULT_TIMINGS``."""

from __future__ import annotations

from typing import Any

from pgleaderlock import FixedInterval

__all__ = ["FAULT_TIMINGS", "timings"]


def timings(
    *,
    retry_s: float,
    health_interval_s: float,
    health_timeout_s: float = 1.0,
    connect_timeout_s: float = 3.0,
    command_timeout_s: float = 2.0,
    **more: Any,
) -> dict[str, Any]:
    """Keyword arguments for a ``LeaderLock`` (or ``Coordinator``): retries every
    ``retry_s`` (``FixedInterval``), the given health and timeouts, and ``more``."""
    return {
        "retry_strategy": FixedInterval(retry_s),
        "health_interval_s": health_interval_s,
        "health_timeout_s": health_timeout_s,
        "connect_timeout_s": connect_timeout_s,
        "command_timeout_s": command_timeout_s,
        **more,
    }


FAULT_TIMINGS = timings(
    retry_s=0.05,
    health_interval_s=0.5,
    health_timeout_s=0.5,
    connect_timeout_s=2.0,
    load_plugins=False,
)
"""Timings of fault runs: demotion bound D = 1 s, tcp_user_timeout U = 2 s."""
