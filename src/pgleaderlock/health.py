"""Health checks for Kubernetes-style probes, for any web framework.

Two questions, two functions:

- **Liveness** ([`live`][pgleaderlock.health.live]): is the lock's lifecycle task still
  running on time? It fails only when the lock is **wedged**: its task is behind its
  own schedule by more than ``stall_s`` (a blocked event loop, a callback that never
  returns). Restarting the process is the cure for that, and for nothing else a lock
  can suffer: a follower, a lock that cannot reach its server, a stopped lock all pass.
- **Readiness** ([`check`][pgleaderlock.health.check]): should this replica receive
  traffic? It fails when the lock is wedged, when it is stopped (before start, after
  shutdown, or on an error that retrying cannot mend), and when errors have kept it from
  leading for longer than ``failing_s``. It does **not** depend on being the leader
  unless you ask (``require_leader=True``): a readiness gate on leadership can deadlock
  a rollout, where the new pods wait to be ready and the old leader waits for them
  (plugin-barman-cloud#419).

Both read [`statistics()`][pgleaderlock.LeaderLock.statistics] only (no I/O, no await),
so they may run on any thread, in particular while the lock's own event loop is blocked,
which is what they are there to notice. Run the probe's web server on another thread or
event loop than the lock (a [`ThreadedLeaderLock`][pgleaderlock.ThreadedLeaderLock], or
a separate process-wide health server); on the lock's own loop a blocked loop also
blocks the probe, which Kubernetes then counts as failed by its timeout: the same
verdict, later.

```python
from pgleaderlock import health

report = health.check(lock)            # readiness; health.live(lock) for liveness
if not report.ok:
    print(report.reasons)              # ["wedged: ...", "failing for 61 s: ..."]
return JSONResponse(report.details, status_code=200 if report.ok else 503)
```

The FastAPI integration serves both: ``GET /leader/live`` and ``GET /leader/health``
([`LeaderLifespan.router`][pgleaderlock.integrations.fastapi.LeaderLifespan.router]).
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from .lowlevel import LeaderLock, LockState, describe, optional_positive, positive
from .schedule import Scheduler
from .threaded import ThreadedLeaderLock

__all__ = ["DEFAULT_FAILING_S", "DEFAULT_STALL_S", "HealthReport", "check", "live"]

DEFAULT_STALL_S = 5.0
"""How far behind its schedule a lock's task may be before it counts as wedged. A
healthy task is late by the event loop's lag: milliseconds."""

DEFAULT_FAILING_S = 60.0
"""How long errors may keep a lock from leading before readiness fails."""


@dataclass(frozen=True)
class HealthReport:
    """The verdict of a health check.

    Attributes:
        ok: True when every condition holds.
        reasons: why not, one sentence per failed condition (empty when ``ok``).
        details: what the verdict was made from, ready for JSON: ``lock``,
            ``state``, ``is_leader``, ``stalled_s``, ``failing_for_s`` (``None``
            unless failing), ``last_error`` and ``stop_error`` (``"TypeName:
            message"`` or ``None``); for a scheduler also ``scheduler_stop_error``.
    """

    ok: bool
    reasons: tuple[str, ...] = ()
    details: Mapping[str, Any] = field(default_factory=dict)


Checked = LeaderLock | ThreadedLeaderLock | Scheduler
"""What the checks read: a lock, or a [`Scheduler`][pgleaderlock.schedule.Scheduler]
(its lock, and whether the scheduler itself has stopped)."""


def live(lock: Checked, *, stall_s: float = DEFAULT_STALL_S) -> HealthReport:
    """Liveness: fails only when the lock is wedged (its lifecycle task is more than
    ``stall_s`` behind its own schedule).

    A follower, a leader, a lock that cannot reach its server and a stopped lock (or
    scheduler) are all alive: restarting the process would not help them.

    Args:
        lock: the lock (a [`ThreadedLeaderLock`][pgleaderlock.ThreadedLeaderLock]'s
            lock is read from any thread), or a scheduler (its lock's).
        stall_s: the bound; larger than the event loop's worst lag under load.
    """
    return check(lock, stall_s=stall_s, failing_s=None, require_running=False)


def check(
    lock: Checked,
    *,
    stall_s: float = DEFAULT_STALL_S,
    failing_s: float | None = DEFAULT_FAILING_S,
    require_leader: bool = False,
    require_running: bool = True,
) -> HealthReport:
    """Readiness: the lock runs on time, takes part in the election and reaches its
    server.

    Fails when:

    - the lock is **wedged**: its lifecycle task is more than ``stall_s`` behind its
      own schedule ([`LockStatistics.stalled_s`][pgleaderlock.LockStatistics]);
    - it is **stopped** (with ``require_running``): not started, shut down, or stopped
      on an error that retrying cannot mend (``stop_error`` says which); for a
      scheduler, also when it stopped its jobs on such an error (a ledger table of an
      untrusted role, a missing privilege: ``scheduler_stop_error`` says which), while
      its lock runs on;
    - it is **failing**: errors have kept it from leading for longer than
      ``failing_s`` ([`LockStatistics.failing_since`][pgleaderlock.LockStatistics]);
      ``None`` leaves this out;
    - it is **not the leader**, only with ``require_leader=True``.

    Args:
        lock: the lock (a [`ThreadedLeaderLock`][pgleaderlock.ThreadedLeaderLock]'s
            lock is read from any thread), or a
            [`Scheduler`][pgleaderlock.schedule.Scheduler] (its lock, and itself).
        stall_s: how far behind its schedule the task may be.
        failing_s: how long errors may keep the lock from leading; ``None``: any time.
        require_leader: fail unless the lock is LEADER (for a route only the leader
            should answer; never for a Deployment's readiness probe).
        require_running: fail while the lock is stopped.

    Returns:
        The [`HealthReport`][pgleaderlock.health.HealthReport].

    Raises:
        ConfigurationError: a bound that is not a positive, finite number.
    """
    stall_s = positive("stall_s", stall_s)
    failing_s = optional_positive("failing_s", failing_s)
    scheduler = lock if isinstance(lock, Scheduler) else None
    inner = lock.lock if isinstance(lock, ThreadedLeaderLock | Scheduler) else lock
    stats = inner.statistics()
    failing_for = None if stats.failing_since is None else time.time() - stats.failing_since
    stop_error = inner.stop_error
    reasons: list[str] = []
    if stats.stalled_s > stall_s:
        reasons.append(
            f"wedged: the lock's lifecycle task is {stats.stalled_s:.1f} s behind its "
            f"schedule (bound {stall_s:g} s): a blocked event loop, or a callback that "
            "does not return"
        )
    if require_running and stats.state is LockState.STOPPED:
        why = f": {describe(stop_error)}" if stop_error is not None else ""
        reasons.append(f"stopped{why}")
    scheduler_error = None if scheduler is None else scheduler.stop_error
    if require_running and scheduler_error is not None:
        reasons.append(f"scheduler stopped: {describe(scheduler_error)}")
    if failing_s is not None and failing_for is not None and failing_for > failing_s:
        reasons.append(
            f"failing for {failing_for:.0f} s (bound {failing_s:g} s): {describe(stats.last_error)}"
        )
    if require_leader and stats.state is not LockState.LEADER:
        reasons.append(f"not the leader ({stats.state.value})")
    details = {
        "lock": inner.label,
        "state": stats.state.value,
        "is_leader": stats.state is LockState.LEADER,
        "stalled_s": round(stats.stalled_s, 3),
        "failing_for_s": None if failing_for is None else round(failing_for, 3),
        "last_error": None if stats.last_error is None else describe(stats.last_error),
        "stop_error": None if stop_error is None else describe(stop_error),
    }
    if scheduler is not None:
        details["scheduler_stop_error"] = (
            None if scheduler_error is None else describe(scheduler_error)
        )
    return HealthReport(not reasons, tuple(reasons), details)
