"""Plugins bundled with pgleaderlock.

A plugin is an object whose methods implement the hookspecs of
`pgleaderlock.core.hooks.LockHookSpec`, marked with
[`pgleaderlock.hookimpl`][pgleaderlock.hookimpl], and registered on a lock with
``lock.plugins.register(plugin)`` (or for every lock of the process through the
``pgleaderlock.plugins`` entry-point group).

Bundled plugins, each in its own module so that importing this package imports no
optional dependency:

- [`pgleaderlock.plugins.metrics`][pgleaderlock.plugins.metrics]: Prometheus counters and gauges
  (``pip install 'pgleaderlock[metrics]'``).
- [`pgleaderlock.plugins.otel`][pgleaderlock.plugins.otel]: OpenTelemetry leadership spans
  and metrics, on the API package (``pip install 'pgleaderlock[otel]'``).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import TypeVar

__all__: list[str] = []

T = TypeVar("T")


def shared_plugin(module: str, make: Callable[[], T]) -> Callable[[str], T]:
    """A plugin module's ``__getattr__``: its ``plugin`` is one instance made by ``make``
    on first use, for the ``pgleaderlock.plugins`` entry-point group
    (``"<module>:plugin"``)."""
    made = functools.cache(make)

    def __getattr__(name: str) -> T:
        if name == "plugin":
            return made()
        raise AttributeError(f"module {module!r} has no attribute {name!r}")

    return __getattr__
