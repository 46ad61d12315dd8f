"""pgleaderlock: leader election on PostgreSQL session-level advisory locks.

Quick start:

```python
from pgleaderlock import LeaderLock

lock = LeaderLock.from_name("billing-scheduler", dsn="postgresql://...")

@lock.on_acquired
def started():
    print("I am the leader now")

async with lock:
    await lock.wait_for_leadership()
    ...
```
"""

# The names below are loaded on first use (a module ``__getattr__``, as anyio and trio
# do), so that ``import pgleaderlock`` loads nothing it does not use (loading every name
# at import cost about 4x ``import asyncio``; benchmarks/import_time.py). Type checkers
# read the ``TYPE_CHECKING`` block instead. A new public name is one entry in ``_LAZY``,
# one line in ``__all__`` and one import in that block (a core name is first exported by
# ``pgleaderlock.core``, and so by ``pgleaderlock.lowlevel``); a test
# (tests/unit/test_exports.py) keeps the three equal.

TYPE_CHECKING = False  # read as typing.TYPE_CHECKING by type checkers; typing not imported

__version__ = "0.2.0.dev0"  # the one place it is written: pyproject.toml reads it (hatch)

__all__ = [
    "Backend",
    "BackendUnavailableError",
    "Callback",
    "ConfigurationError",
    "ConnectOptions",
    "ConnectionError",
    "Coordinator",
    "DecorrelatedJitter",
    "ErrorCallback",
    "Event",
    "ExponentialBackoff",
    "FencedError",
    "Fencing",
    "FixedInterval",
    "HandOverError",
    "LeaderChangedCallback",
    "LeaderInfo",
    "LeaderLock",
    "LeaderTasks",
    "Leadership",
    "LockError",
    "LockNotHeldError",
    "LockOptions",
    "LockSession",
    "LockState",
    "LockStatistics",
    "MissingPrivilegeError",
    "Participant",
    "Participation",
    "PgLeaderLockError",
    "PooledConnectionError",
    "RetryContext",
    "RetryStrategy",
    "Semaphore",
    "ServerRefusedError",
    "Session",
    "SessionNotDedicatedError",
    "ShutdownError",
    "StandbyError",
    "StateChangeCallback",
    "ThreadedLeaderLock",
    "Timing",
    "UnclaimedGrantError",
    "UntrustedObjectError",
    "WorkerContext",
    "__version__",
    "current_leader",
    "current_leader_sync",
    "hookimpl",
    "lock_keys",
    "slot_keys",
]

_LAZY: dict[str, str] = {
    # name: the module (relative to this package) it comes from; the core's names come
    # through the low-level layer, as everywhere outside the core (tests/unit/test_layout.py)
    "Backend": ".lowlevel",
    "BackendUnavailableError": ".lowlevel",
    "Callback": ".lowlevel",
    "ConfigurationError": ".lowlevel",
    "ConnectOptions": ".lowlevel",
    "ConnectionError": ".lowlevel",
    "Coordinator": ".coordination",
    "DecorrelatedJitter": ".lowlevel",
    "ErrorCallback": ".lowlevel",
    "Event": ".lowlevel",
    "ExponentialBackoff": ".lowlevel",
    "FencedError": ".lowlevel",
    "Fencing": ".lowlevel",
    "FixedInterval": ".lowlevel",
    "HandOverError": ".lowlevel",
    "LeaderChangedCallback": ".lowlevel",
    "LeaderInfo": ".lowlevel",
    "LeaderLock": ".lowlevel",
    "LeaderTasks": ".tasks",
    "Leadership": ".lowlevel",
    "LockError": ".lowlevel",
    "LockNotHeldError": ".lowlevel",
    "LockOptions": ".lowlevel",
    "LockSession": ".lowlevel",
    "LockState": ".lowlevel",
    "LockStatistics": ".lowlevel",
    "MissingPrivilegeError": ".lowlevel",
    "Participant": ".lowlevel",
    "Participation": ".lowlevel",
    "PgLeaderLockError": ".lowlevel",
    "PooledConnectionError": ".lowlevel",
    "RetryContext": ".lowlevel",
    "RetryStrategy": ".lowlevel",
    "Semaphore": ".lowlevel",
    "ServerRefusedError": ".lowlevel",
    "Session": ".lowlevel",
    "SessionNotDedicatedError": ".lowlevel",
    "ShutdownError": ".lowlevel",
    "StandbyError": ".lowlevel",
    "StateChangeCallback": ".lowlevel",
    "ThreadedLeaderLock": ".threaded",
    "Timing": ".lowlevel",
    "UnclaimedGrantError": ".lowlevel",
    "UntrustedObjectError": ".lowlevel",
    "WorkerContext": ".coordination",
    "current_leader": ".lowlevel",
    "current_leader_sync": ".lowlevel",
    "hookimpl": ".lowlevel",
    "lock_keys": ".lowlevel",
    "slot_keys": ".lowlevel",
}

if TYPE_CHECKING:
    from .coordination import Coordinator, WorkerContext
    from .lowlevel import (
        Backend,
        BackendUnavailableError,
        Callback,
        ConfigurationError,
        ConnectionError,
        ConnectOptions,
        DecorrelatedJitter,
        ErrorCallback,
        Event,
        ExponentialBackoff,
        FencedError,
        Fencing,
        FixedInterval,
        HandOverError,
        LeaderChangedCallback,
        LeaderInfo,
        LeaderLock,
        Leadership,
        LockError,
        LockNotHeldError,
        LockOptions,
        LockSession,
        LockState,
        LockStatistics,
        MissingPrivilegeError,
        Participant,
        Participation,
        PgLeaderLockError,
        PooledConnectionError,
        RetryContext,
        RetryStrategy,
        Semaphore,
        ServerRefusedError,
        Session,
        SessionNotDedicatedError,
        ShutdownError,
        StandbyError,
        StateChangeCallback,
        Timing,
        UnclaimedGrantError,
        UntrustedObjectError,
        current_leader,
        current_leader_sync,
        hookimpl,
        lock_keys,
        slot_keys,
    )
    from .tasks import LeaderTasks
    from .threaded import ThreadedLeaderLock
else:
    # Hidden from type checkers: with a module ``__getattr__`` in sight, they would
    # accept any attribute of the package (a typo included) as ``object``.

    def __getattr__(name: str) -> object:
        """Load a public name on first use, then keep it as a plain attribute."""
        module = _LAZY.get(name)
        if module is None:
            raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
        from importlib import import_module

        value = getattr(import_module(module, __name__), name)
        globals()[name] = value
        return value

    def __dir__() -> list[str]:
        return sorted({*globals(), *__all__})
