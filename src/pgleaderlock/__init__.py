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
# one line in ``__all__`` and one import in that block; a test
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
    # name: the module (relative to this package) that defines it
    "Backend": ".core.session",
    "BackendUnavailableError": ".core.errors",
    "Callback": ".core.models",
    "ConfigurationError": ".core.errors",
    "ConnectOptions": ".core.session",
    "ConnectionError": ".core.errors",
    "Coordinator": ".coordination",
    "DecorrelatedJitter": ".core.retry",
    "ErrorCallback": ".core.models",
    "Event": ".core.models",
    "ExponentialBackoff": ".core.retry",
    "FencedError": ".core.errors",
    "Fencing": ".core.options",
    "FixedInterval": ".core.retry",
    "HandOverError": ".core.errors",
    "LeaderChangedCallback": ".core.models",
    "LeaderInfo": ".core.leader",
    "LeaderLock": ".core.lock",
    "LeaderTasks": ".tasks",
    "Leadership": ".core.fencing",
    "LockError": ".core.errors",
    "LockNotHeldError": ".core.errors",
    "LockOptions": ".core.options",
    "LockSession": ".core.session",
    "LockState": ".core.models",
    "LockStatistics": ".core.models",
    "MissingPrivilegeError": ".core.errors",
    "Participant": ".core.leader",
    "Participation": ".core.options",
    "PgLeaderLockError": ".core.errors",
    "PooledConnectionError": ".core.errors",
    "RetryContext": ".core.models",
    "RetryStrategy": ".core.retry",
    "Semaphore": ".core.semaphore",
    "ServerRefusedError": ".core.errors",
    "Session": ".core.options",
    "SessionNotDedicatedError": ".core.errors",
    "ShutdownError": ".core.errors",
    "StandbyError": ".core.errors",
    "StateChangeCallback": ".core.models",
    "ThreadedLeaderLock": ".threaded",
    "Timing": ".core.options",
    "UnclaimedGrantError": ".core.errors",
    "UntrustedObjectError": ".core.errors",
    "WorkerContext": ".coordination",
    "current_leader": ".core.leader",
    "current_leader_sync": ".core.leader",
    "hookimpl": ".core.hooks",
    "lock_keys": ".core.keys",
    "slot_keys": ".core.keys",
}

if TYPE_CHECKING:
    from .coordination import Coordinator, WorkerContext
    from .core.errors import (
        BackendUnavailableError,
        ConfigurationError,
        ConnectionError,
        FencedError,
        HandOverError,
        LockError,
        LockNotHeldError,
        MissingPrivilegeError,
        PgLeaderLockError,
        PooledConnectionError,
        ServerRefusedError,
        SessionNotDedicatedError,
        ShutdownError,
        StandbyError,
        UnclaimedGrantError,
        UntrustedObjectError,
    )
    from .core.fencing import Leadership
    from .core.hooks import hookimpl
    from .core.keys import lock_keys, slot_keys
    from .core.leader import LeaderInfo, Participant, current_leader, current_leader_sync
    from .core.lock import LeaderLock
    from .core.models import (
        Callback,
        ErrorCallback,
        Event,
        LeaderChangedCallback,
        LockState,
        LockStatistics,
        RetryContext,
        StateChangeCallback,
    )
    from .core.options import Fencing, LockOptions, Participation, Session, Timing
    from .core.retry import DecorrelatedJitter, ExponentialBackoff, FixedInterval, RetryStrategy
    from .core.semaphore import Semaphore
    from .core.session import Backend, ConnectOptions, LockSession
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
