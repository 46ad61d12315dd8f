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

from __future__ import annotations

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
    "FencedError",
    "Fencing",
    "HandOverError",
    "ExponentialBackoff",
    "FixedInterval",
    "LeaderChangedCallback",
    "LeaderInfo",
    "LeaderLock",
    "Leadership",
    "LeaderTasks",
    "LockError",
    "LockNotHeldError",
    "LockOptions",
    "LockSession",
    "LockState",
    "LockStatistics",
    "PgLeaderLockError",
    "Participation",
    "RetryContext",
    "RetryStrategy",
    "ServerRefusedError",
    "Session",
    "PooledConnectionError",
    "SessionNotDedicatedError",
    "ShutdownError",
    "StandbyError",
    "UnclaimedGrantError",
    "UntrustedObjectError",
    "MissingPrivilegeError",
    "StateChangeCallback",
    "ThreadedLeaderLock",
    "Timing",
    "WorkerContext",
    "__version__",
    "hookimpl",
    "lock_keys",
    "Participant",
    "current_leader",
    "current_leader_sync",
    "Semaphore",
    "slot_keys",
]
