"""The low-level layer: what the core offers to code built on it.

For integration authors: people who write a backend (a driver adapter), an integration
(a framework's lifecycle, a scheduler), a plugin or a tool that reads the library's
tables. Applications need none of it: they use what ``pgleaderlock`` itself exports.
Everything in the library outside the core (the backends, the Coordinator, the
Scheduler, the integrations, the CLI, the plugins, the status read model, the testing
helpers) takes the core's names from here and from nowhere else, so this list is
exactly what the library's own layers needed, and enough to write another one. The
modules of ``pgleaderlock.core`` behind it are the implementation: import none of them.

**Stability.** These names may change in a minor release (0.x → 0.x+1), each change with
a line in the CHANGELOG; they do not change in a patch release. The names ``pgleaderlock``
exports keep the stronger promise of the public API; where a name is in both (marked
*public* below), it is the same object, so prefer ``from pgleaderlock import ...``.

Names, by theme:

- **Locks** (*public*: `LeaderLock`, `Semaphore`, `LockState`, `Event`,
  `LockStatistics`, `RetryContext`, `hookimpl` and the callback types `Callback`,
  `ErrorCallback`, `LeaderChangedCallback`, `StateChangeCallback`). For the layers built
  on a lock: `lock_settings` (its validated settings), `run_on_session` (its state
  machine on a session the caller owns), `follow_state` and `callback_plugin` (state
  changes and callbacks as plugins), `is_permanent` (whether a lock gives up on an error)
  and `describe` (an error as one log-safe line).
- **Sessions and backends** (*public*: `Backend`, `ConnectOptions`, `LockSession`). The
  optional capabilities a backend implements: `AbortableSession`, `FencingSession`,
  `KeepAliveSession`, `ProbingSession`, `QuerySession`, `SocketSession`,
  `TableSession`, `WaitingSession`, `BoundedWaitSession`, `WatchableSession` (ask with
  `can`, which caches the answer); `SessionInfo` (what a new session learns about
  itself), `FencedSessions`,
  `SessionFactory`, `SessionSlot` (where a lock's current session lives),
  `connection_target` (a DSN or ``connect_fn`` checked before any I/O), `Target` and
  `short_session` (a short session for reading).
- **The backend registry**: `available`, `registered`, `get`, `refresh` (also public as
  ``pgleaderlock.backends.available`` and so on), `driver_dsn` and `without_driver`
  (a DSN as a backend's driver takes it).
- **Calls and bounds**: `bounded` (a call under a timeout that drops the session before
  cancelling it: the only way outside a lock's task), `fetch_row` and `transaction`
  (a statement or a transaction on a connection of the caller's, any driver),
  `Supervisor` and `check_give_away` (named tasks restarted after a crash), `Service`
  (an abstract base: ``async with`` calls ``start()`` on the way in, ``shutdown()`` on the way
  out; the Scheduler and the Coordinator build on it).
- **Configuration and validation** (*public*: `LockOptions`, `Timing`, `Fencing`,
  `Participation`, `Session`): `LockConfig` and `lock_config` (a lock's settings,
  checked), `lock_arguments` (a flat mapping, as configuration files give it, into a
  lock's arguments), `check_options`, `DeprecatedOptions`, `DEPRECATED_KEYWORDS`,
  `merge_deprecated`, `old_keywords` (0.1's flat keywords), `session_settings` and
  `SAFE_SETTINGS` (what a lock's session sets), and the checks every entry point makes
  alike: `positive`, `optional_positive`, `not_negative`, `MAX_SECONDS`, `check_roles`,
  `check_retry_strategy`, `check_identifier`, `check_name`, `check_key`.
- **Retry** (*public*: `RetryStrategy`, `ExponentialBackoff`, `DecorrelatedJitter`,
  `FixedInterval`): `default_retry_strategy`, and `delay_or_give_up` (a strategy asked
  by a caller with nobody to raise to).
- **Tables and fencing** (*public*: `Leadership`): `DEFAULT_SCHEMA`, `LibraryTable`,
  `TermTable`, `TableCheck` and `CHECK_TABLE` (whether a table can be trusted),
  `trusted_roles_sql`, `quoted` (an identifier, quoted), `fence_transaction` (the one
  fence), `BumpedTerm` (a new term with the row's previous one, as the backends'
  term bump returns it) and `timeline_change` (the fields of the timeline_changed
  warning, when a new term is on a later server timeline than the last one known).
- **Keys** (*public*: `lock_keys`, `slot_keys`): `find_slot`, and `key_to_oid` /
  `oid_to_key` (a key as ``pg_locks`` shows it).
- **Who leads** (*public*: `LeaderInfo`, `Participant`, `current_leader`,
  `current_leader_sync`): `ParticipantTable`, `PUBLISHED_FIELDS`, `published`,
  `participants_of` (the published rows, as status reads them), `LEADER_CHANNEL` (the
  ``NOTIFY`` channel a lock that starts to lead announces itself on: a listener looks
  at ``pg_locks`` again).
- **Errors** (*public*: `PgLeaderLockError`, `ConfigurationError`, `ConnectionError`,
  `LockError`, `LockNotHeldError`, `FencedError`, `HandOverError`, `ShutdownError`,
  `BackendUnavailableError`, `MissingPrivilegeError`, `UntrustedObjectError`,
  `PooledConnectionError`, `ServerRefusedError`, `SessionNotDedicatedError`,
  `StandbyError`, `UnclaimedGrantError`): `sqlstate` (the SQLSTATE a driver error
  carries).
- **Logging and text**: `get_logger` (the library's structured loggers), `format_event`,
  `mask_dsn` (passwords out of a DSN or a message), and `printable`, `printable_tree`,
  `first_line` (server text made safe for a terminal).
"""

from .core import *  # noqa: F403  (the one list of names is ``pgleaderlock.core.__all__``)
from .core import __all__ as __all__
