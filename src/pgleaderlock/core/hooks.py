"""Lifecycle hooks: one pluggy mechanism for plugins and decorator callbacks.

Every [`LeaderLock`][pgleaderlock.LeaderLock] has its own plugin manager, ``lock.plugins``.
The decorator callbacks (``@lock.on_acquired`` ...) are registered there as tiny
plugins, so callbacks and plugins are one mechanism with one contract:

1. implementations run on the lock's lifecycle task, in registration order
   (``tryfirst``/``trylast`` implementations first/last);
2. each may be a plain function or a coroutine function (it is awaited);
3. an exception in one is logged and passed to the ``pgleaderlock_error`` hook (so to
   every ``on_error`` callback); it never stops the other implementations or the lock.

Plugins for every lock of the process are found through the entry-point group
``pgleaderlock.plugins``; set ``PGLEADERLOCK_DISABLE_PLUGIN_AUTOLOAD=1`` or pass
``load_plugins=False`` to a lock to skip them. A plugin is any object (a module, an
instance) with methods named like the hookspecs below and marked ``@hookimpl``:

```python
from pgleaderlock import hookimpl

class Audit:
    @hookimpl
    def pgleaderlock_acquired(self, lock):
        print("leader:", lock.name)

lock.plugins.register(Audit())
```

Implementations may accept any subset of a hook's arguments.
"""

from __future__ import annotations

import functools
import inspect
import os
import types
from collections.abc import Callable
from functools import cache
from typing import TYPE_CHECKING, Any, Generic, Self, TypeVar, overload

import pluggy

from ._logging import get_logger
from .errors import ConfigurationError
from .models import Event, LockState

if TYPE_CHECKING:
    from .leader import LeaderInfo
    from .lock import LeaderLock

__all__ = [
    "AUTOLOAD_ENV",
    "ENTRY_POINT_GROUP",
    "PROJECT",
    "LockHookSpec",
    "On",
    "callback_plugin",
    "emit",
    "entry_point_plugins",
    "follow_state",
    "hookimpl",
    "hookspec",
    "leadership_ended",
    "new_plugin_manager",
    "register_callback",
]

PROJECT = "pgleaderlock"
ENTRY_POINT_GROUP = "pgleaderlock.plugins"
AUTOLOAD_ENV = "PGLEADERLOCK_DISABLE_PLUGIN_AUTOLOAD"

C = TypeVar("C", bound=Callable[..., Any])

hookspec = pluggy.HookspecMarker(PROJECT)
hookimpl = pluggy.HookimplMarker(PROJECT)
"""Marks a plugin method as a hook implementation."""

log = get_logger()


def _spec_lock(self: object, lock: LeaderLock) -> None: ...
def _spec_state(self: object, lock: LeaderLock, old: LockState, new: LockState) -> None: ...
def _spec_error(self: object, lock: LeaderLock, error: Exception) -> None: ...
def _spec_attempt(self: object, lock: LeaderLock, attempt: int) -> None: ...
def _spec_leader(self: object, lock: LeaderLock, leader: LeaderInfo | None) -> None: ...


# pluggy reads a hook's argument names from its function's code: one template per
# argument list, copied under each event's hook name.
_TEMPLATES: dict[tuple[str, ...], Callable[..., None]] = {
    (): _spec_lock,
    ("old", "new"): _spec_state,
    ("error",): _spec_error,
    ("attempt",): _spec_attempt,
    ("leader",): _spec_leader,
}


def _hookspec(event: Event) -> Callable[..., None]:
    template = _TEMPLATES[event.hook_args]
    spec = types.FunctionType(template.__code__, template.__globals__, event.hook)
    spec.__qualname__ = f"LockHookSpec.{event.hook}"
    spec.__doc__ = event.description
    spec.__annotations__ = dict(template.__annotations__)
    return hookspec(spec)


LockHookSpec = type(
    "LockHookSpec",
    (),
    {
        "__doc__": "The hooks a plugin may implement, one per [`Event`][pgleaderlock.Event]: "
        "``pgleaderlock_<event>(lock, ...)``.",
        **{event.hook: _hookspec(event) for event in Event},
    },
)
"""The hookspecs, made from [`Event`][pgleaderlock.Event] (one list of events)."""


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
    from importlib.metadata import entry_points  # slow to import: on first use

    plugins = []
    for ep in entry_points(group=ENTRY_POINT_GROUP):
        try:
            plugin = ep.load()
        except Exception as exc:
            log.error("plugin_load_failed", plugin=ep.name, error=repr(exc))
            continue
        plugins.append((ep.name, plugin))
    return tuple(plugins)


def callback_plugin(event: Event, fn: Callable[..., Any]) -> object:
    """Wrap a decorator callback as a plugin implementing ``event``'s hook.

    Callbacks keep their documented signatures (``event.callback_args``; docs/concepts.md,
    "Callbacks"):
    ``on_state_change(old, new)``, ``on_error(exc)``, no arguments for the others.
    """
    impl: Callable[..., Any]
    match event.callback_args:
        case ("old", "new"):

            def impl(old: LockState, new: LockState) -> Any:
                return fn(old, new)

        case ("error",):

            def impl(error: Exception) -> Any:
                return fn(error)

        case ("leader",):

            def impl(leader: LeaderInfo | None) -> Any:
                return fn(leader)

        case _:

            def impl() -> Any:
                return fn()

    impl.__qualname__ = getattr(fn, "__qualname__", repr(fn))
    plugin = types.SimpleNamespace(callback=fn)
    setattr(plugin, event.hook, hookimpl(impl))
    return plugin


FailureReport = Callable[[str, Event, Exception], None]
"""Called with (implementation name, event, exception) when an implementation raises."""


async def emit(
    plugins: pluggy.PluginManager, event: Event, kwargs: dict[str, Any], failed: FailureReport
) -> None:
    """Run every implementation of ``event``'s hook (callbacks included), in order.

    Each gets the subset of ``kwargs`` it names; a coroutine is awaited. An exception is
    reported through ``failed`` and then to the ``error`` hook; it never stops the other
    implementations.
    """
    for impl in ordered_impls(getattr(plugins.hook, event.hook)):
        try:
            result = impl.function(*[kwargs[name] for name in impl.argnames])
            if inspect.isawaitable(result):
                await result
        except Exception as exc:
            failed(getattr(impl.function, "__qualname__", impl.plugin_name), event, exc)
            if event is not Event.ERROR:
                await emit(plugins, Event.ERROR, {**kwargs, "error": exc}, failed)


class On(Generic[C]):
    """``@lock.on_<event>``: register a callback for an [`Event`][pgleaderlock.Event]; the
    decorator returns the function unchanged. Callbacks run on the lifecycle task, in
    registration order; sync or async; an exception is logged and sent to ``on_error``."""

    def __init__(self, event: Event) -> None:
        self.event = event

    def __set_name__(self, owner: type, name: str) -> None:
        if name != self.event.decorator:
            raise TypeError(f"{name} must be called {self.event.decorator}")

    @overload
    def __get__(self, lock: None, owner: type) -> Self: ...
    @overload
    def __get__(self, lock: object, owner: type) -> Callable[[C], C]: ...
    def __get__(self, lock: object, owner: type) -> Self | Callable[[C], C]:
        if lock is None:
            return self
        plugins: pluggy.PluginManager = lock.plugins  # type: ignore[attr-defined]
        return functools.partial(register_callback, plugins, self.event)


def register_callback(plugins: pluggy.PluginManager, event: Event, fn: C) -> C:
    """Register ``fn`` for ``event`` on ``plugins``; return it unchanged."""
    if not callable(fn):
        raise ConfigurationError(f"{event.decorator} needs a callable, got {fn!r}")
    plugins.register(callback_plugin(event, fn))
    return fn


def ordered_impls(caller: pluggy.HookCaller) -> list[pluggy.HookImpl]:
    """Implementations in call order: tryfirst, then registration order, then trylast."""
    impls = [i for i in caller.get_hookimpls() if not (i.hookwrapper or i.wrapper)]
    return sorted(impls, key=lambda i: 0 if i.tryfirst else 2 if i.trylast else 1)


StateListener = Callable[[LockState, LockState], object]


class _StatePlugin:
    def __init__(self, fn: StateListener, leaving: Callable[[], None] | None = None) -> None:
        self._fn = fn
        self.leaving = leaving


class _FirstStatePlugin(_StatePlugin):
    """Runs before every ordinary callback and plugin of the lock (``tryfirst``)."""

    @hookimpl(tryfirst=True)
    def pgleaderlock_state_change(self, old: LockState, new: LockState) -> object:
        return self._fn(old, new)


class _OrderedStatePlugin(_StatePlugin):
    """Runs in registration order among the lock's callbacks and plugins."""

    @hookimpl
    def pgleaderlock_state_change(self, old: LockState, new: LockState) -> object:
        return self._fn(old, new)


def follow_state(
    lock: LeaderLock,
    fn: StateListener,
    *,
    first: bool = True,
    leaving: Callable[[], None] | None = None,
) -> object:
    """Register ``fn(old, new)`` for every state change of ``lock``, as a plugin.

    With ``first`` it runs before the lock's ordinary callbacks and plugins, so that
    leader-only work has stopped before they (or an unlock) run. ``fn`` may be a
    coroutine function; it runs on the lock's lifecycle task.

    ``leaving()``, if given, is called synchronously the moment the lock leaves LEADER,
    before any state-change listener runs (``fn`` included): the place to *cancel*
    leader work, so that the work of every listener stops at once; ``fn`` then awaits
    it. It must not block; what it raises is logged.

    Returns:
        The plugin; ``lock.plugins.unregister(plugin)`` detaches it (both functions).
    """
    plugin = _FirstStatePlugin(fn, leaving) if first else _OrderedStatePlugin(fn, leaving)
    lock.plugins.register(plugin)
    return plugin


def leadership_ended(plugins: pluggy.PluginManager, fields: dict[str, Any]) -> None:
    """Call the ``leaving`` function of every ``follow_state`` listener of a lock that
    has just left LEADER (see `follow_state`); an exception is logged, the others run."""
    for _, plugin in plugins.list_name_plugin():
        leaving = plugin.leaving if isinstance(plugin, _StatePlugin) else None
        if leaving is None:
            continue
        try:
            leaving()
        except Exception as exc:
            log.error("leaving_failed", error=repr(exc), exc=exc, **fields)
