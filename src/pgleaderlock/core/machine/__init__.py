"""The lock's decision engine: the transition table as data, and every policy around it.

This module decides everything a [`LeaderLock`][pgleaderlock.LeaderLock] does and
performs nothing. It has no asyncio, no I/O and no clock of its own (sans-I/O, like h11
and psycopg's generators): [`Machine.handle`][pgleaderlock.core.machine.Machine.handle]
takes what just happened (a [`Result`][pgleaderlock.core.machine.Result]) and the time,
and returns the [effects][pgleaderlock.core.machine.Effect] to perform, in order. The
runner (`core/runner.py`) performs them and reports the outcome of the one blocking effect
(a database call or a sleep), which is the next result. User requests (shutdown,
step-down, a session alarm) reach the machine through
[`Machine.request`][pgleaderlock.core.machine.Machine.request], which only records them;
the machine acts on them at its next decision.

Two layers:

- [`TABLE`][pgleaderlock.core.machine.TABLE]: every transition, one row each, with the
  footnotes of the original table (docs/state-machine.md, "Footnotes") expanded into
  rows guarded by configuration. The docs' table and
  state diagram are rendered from it. A (state, input) pair with no row is illegal.
- [`Machine`][pgleaderlock.core.machine.Machine]: turns results and requests into table
  inputs, and performs the rows' actions as effects. It owns every policy: attempt
  counting and retry give-up, the wait budget of a waiting follower, the health probe's
  schedule, the grace deadline, the origin of a release, the last error, the errors that
  retrying cannot mend.

Deviations from the original specification's text (docs/state-machine.md,
"Deviations from the specification"):

- ACQUIRING + DbError emits `on_error`, not `on_lost`: `on_lost` only ever follows
  an `on_acquired` (leadership that was held is lost).
- FOLLOWER + DbError (opening the session failed) stays in FOLLOWER and retries after
  the retry strategy's delay: connection establishment is retried.
- A failed unlock during `step_down()` closes the session (which frees the lock) and,
  with `auto_reacquire`, continues as FOLLOWER, like a successful one (footnote 2).
- Every transition to STOPPED emits `on_stopped`, after the row's other actions.
- After a database error or a step-down, the next attempt waits one retry delay
  ([`BACKOFF`][pgleaderlock.core.machine.Action.BACKOFF]) so that a failing server is
  not hammered and a stepped-down leader lets the others in.
- Inputs the specification lacks: `RetriesExhausted` (the strategy said stop, or an error that
  retrying cannot mend), `ReconnectFailed` (a connection error during the grace period
  is retried within it), `TaskAborted` (the lifecycle task was cancelled or crashed),
  and `ReleaseRequested` while RECONNECTING (the session is already gone: on_lost).
"""

from __future__ import annotations

from . import effects, engine, table
from .effects import *  # noqa: F403
from .engine import *  # noqa: F403
from .table import *  # noqa: F403

# The package's surface is its modules' public names.
__all__ = effects.__all__ + engine.__all__ + table.__all__
