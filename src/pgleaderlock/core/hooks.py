"""Lifecycle hooks: one pluggy mechanism for plugins and decorator callbacks.

Every :class:`~pgleaderlock.LeaderLock` has its own plugin manager, ``lock.plugins``.
The decorator callbacks (``@lock.on_acquired`` ...) are registered there as tiny
plugins, so callbacks and plugins are one mechanism with one contract (spec §4.4):

1. implementations run on the lock's lifecycle task, in registration order
   (``tryfirst``/``trylast`` implementations first/last);
2. each may be a plain function or a coroutine function (it is awaited);
3. an exception in one is logged and passed to the ``pgleaderlock_error`` hook (so to
   every ``on_error`` callback); it never stops the other implementations or the lock.

Plugins for every lock of the process are found through the entry-point group
``pgleaderlock.plugins``; set ``PGLEADERLOCK_DISABLE_PLUGIN_AUTOLOAD=1`` or pass
``load_plugins=False`` to a lock to skip them. A plugin is any object (a module, an
instance) with methods named like the hookspecs below and marked ``@hookimpl``::

    from pgleaderlock import hookimpl

    class Audit:
        @hookimpl
        def pgleaderlock_acquired(self, lock):
            print("leader:", lock.name)

    lock.plugins.register(Audit())

Implementations may accept any subset of a hook's arguments.
"""

from __future__ import annotations

import os
import types
from collections.abc import Callable
from functools import cache
from importlib.metadata import entry_points
from typing import TYPE_CHECKING, Any

import pluggy

from ._logging import get_logger
from .models import LockState

if TYPE_CHECKING:
    from .lock import LeaderLock

__all__ = [
    "AUTOLOAD_ENV",
    "ENTRY_POINT_GROUP",
    "PROJECT",
    "LockHookSpec",
    "callback_plugin",
    "entry_point_plugins",
    "hookimpl",
    "hookspec",
    "new_plugin_manager",
]

PROJECT = "pgleaderlock"
ENTRY_POINT_GROUP = "pgleaderlock.plugins"
AUTOLOAD_ENV = "PGLEADERLOCK_DISABLE_PLUGIN_AUTOLOAD"

hookspec = pluggy.HookspecMarker(PROJECT)
hookimpl = pluggy.HookimplMarker(PROJECT)
"""Marks a plugin method as a hook implementation."""

log = get_logger()


class LockHookSpec:
    """The hooks a plugin may implement. ``lock`` is the :class:`~pgleaderlock.LeaderLock`."""

    @hookspec
    def pgleaderlock_state_change(self, lock: LeaderLock, old: LockState, new: LockState) -> None:
        """The lock's state changed from ``old`` to ``new`` (every change, RECONNECTING
        included)."""

    @hookspec
    def pgleaderlock_acquired(self, lock: LeaderLock) -> None:
        """Leadership acquired: the lock is held by this session."""

    @hookspec
    def pgleaderlock_lost(self, lock: LeaderLock) -> None:
        """Leadership that was held is lost involuntarily: stop leader-only work now."""

    @hookspec
    def pgleaderlock_released(self, lock: LeaderLock) -> None:
        """Leadership given up voluntarily (``step_down()`` or ``shutdown()``)."""

    @hookspec
    def pgleaderlock_acquire_failed(self, lock: LeaderLock, attempt: int) -> None:
        """An attempt found the lock held elsewhere (in wait mode: a wait ended without
        it). ``attempt`` is its 1-based number in the current cycle."""

    @hookspec
    def pgleaderlock_error(self, lock: LeaderLock, error: Exception) -> None:
        """A database error, or an exception raised by a callback or another plugin."""

    @hookspec
    def pgleaderlock_stopped(self, lock: LeaderLock) -> None:
        """The lock reached STOPPED."""


def new_plugin_manager(*, load_entry_points: bool) -> pluggy.PluginManager:
    """A plugin manager with the hookspecs and, unless disabled, the entry-point plugins."""
    pm = pluggy.PluginManager(PROJECT)
    pm.add_hookspecs(LockHookSpec)
    if load_entry_points and not os.environ.get(AUTOLOAD_ENV):
        for name, plugin in entry_point_plugins():
            if pm.get_plugin(name) is None:
                pm.register(plugin, name=name)
    return pm


@cache
def entry_point_plugins() -> tuple[tuple[str, object], ...]:
    """The plugins of the ``pgleaderlock.plugins`` group, loaded once per process.

    A plugin that fails to load is logged and skipped: a broken plugin must not stop
    leader election.
    """
    plugins = []
    for ep in entry_points(group=ENTRY_POINT_GROUP):
        try:
            plugin = ep.load()
        except Exception as exc:
            log.error("plugin_load_failed", plugin=ep.name, error=repr(exc))
            continue
        plugins.append((ep.name, plugin))
    return tuple(plugins)


def callback_plugin(hook_name: str, fn: Callable[..., Any]) -> object:
    """Wrap a decorator callback as a plugin implementing ``hook_name``.

    Callbacks keep the spec's signatures: ``on_state_change(old, new)``,
    ``on_error(exc)``, no arguments for the others.
    """
    if hook_name == "pgleaderlock_state_change":

        def impl(old: LockState, new: LockState) -> Any:
            return fn(old, new)

    elif hook_name == "pgleaderlock_error":

        def impl(error: Exception) -> Any:  # type: ignore[misc]
            return fn(error)

    else:

        def impl() -> Any:  # type: ignore[misc]
            return fn()

    impl.__qualname__ = getattr(fn, "__qualname__", repr(fn))
    plugin = types.SimpleNamespace(callback=fn)
    setattr(plugin, hook_name, hookimpl(impl))
    return plugin


def ordered_impls(caller: pluggy.HookCaller) -> list[pluggy.HookImpl]:
    """Implementations in call order: tryfirst, then registration order, then trylast."""
    impls = [i for i in caller.get_hookimpls() if not (i.hookwrapper or i.wrapper)]
    return sorted(impls, key=lambda i: 0 if i.tryfirst else 2 if i.trylast else 1)
