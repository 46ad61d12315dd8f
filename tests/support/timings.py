"""Short lock timings for tests, written once: ``timings(...)``, and ``FAULT_TIMINGS``;
``lock_args`` turns such flat settings into a lock's keyword arguments."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from pgleaderlock import FixedInterval
from pgleaderlock.core.options import DEPRECATED_KEYWORDS, old_keywords, options_from_keywords

__all__ = ["FAULT_TIMINGS", "FENCED_TIMINGS", "lock_args", "timings"]


def lock_args(*layers: Mapping[str, Any], **settings: Any) -> dict[str, Any]:
    """Keyword arguments for a ``LeaderLock``, ``Semaphore`` or ``Coordinator`` from flat
    settings (``timings(...)``, a fixture's defaults, a test's keywords), later layers
    winning: the flat option names (``fencing=True``, ``lease_s=3``...) go into one
    ``options=LockOptions(...)`` through the library's ``options_from_keywords``, with no
    ``DeprecationWarning``; the rest (``retry_strategy``, ``group``...) stay as they are.
    An ``options=`` in a layer is laid over the flat settings before it."""
    merged: dict[str, Any] = {}
    for layer in (*layers, settings):
        given = dict(layer)
        options = given.pop("options", None)
        if options is not None:
            merged.update(old_keywords(options))
        merged.update(given)
    flat = {key: merged.pop(key) for key in list(merged) if key in DEPRECATED_KEYWORDS}
    return {**merged, "options": options_from_keywords(flat)}


def timings(
    *,
    retry_s: float,
    health_interval_s: float,
    health_timeout_s: float = 1.0,
    connect_timeout_s: float = 3.0,
    command_timeout_s: float = 2.0,
    **more: Any,
) -> dict[str, Any]:
    """Flat settings for a ``LeaderLock`` (or ``Coordinator``): retries every ``retry_s``
    (``FixedInterval``), the given health and timeouts, and ``more``; pass them through
    ``lock_args`` (the option names among them are the flat keywords of 0.1)."""
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


FENCED_TIMINGS = timings(
    retry_s=0.02, health_interval_s=0.1, command_timeout_s=5.0, load_plugins=False
)
"""Timings of fencing locks on the shared server (``fenced_lock``, tests/server's fencing
tests): ``command_timeout_s`` bounds the term bump, which may wait for fenced work."""
