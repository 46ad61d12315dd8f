"""The backend-neutral core of pgleaderlock: state machine, lifecycle task, retry, keys.

Nothing in this package imports a database driver. What the layers above it (the
Coordinator, the leader tasks, the integrations) build on is exported here: they import
from ``pgleaderlock.core``, never from its modules, so that the modules may change
behind this surface (a layout test checks it for the Coordinator).
"""

from ._logging import get_logger
from .calls import CallGuard, CallInterrupted, Interrupted, bounded
from .config import (
    DEFAULT_SCHEMA,
    LibraryTable,
    LockConfig,
    TermTable,
    check_roles,
    lock_config,
    not_negative,
    positive,
    session_settings,
)
from .errors import (
    ConfigurationError,
    ConnectionError,
    FencedError,
    MissingPrivilegeError,
    PgLeaderLockError,
    UntrustedObjectError,
)
from .fencing import Leadership, fence_transaction
from .hooks import callback_plugin, follow_state
from .keys import check_name, lock_keys, oid_to_key
from .leader import Target, short_session
from .lock import LeaderLock, lock_settings, run_on_session
from .machine import is_permanent
from .models import Event, LockState, RetryContext
from .options import (
    DEPRECATED_KEYWORDS,
    DeprecatedOptions,
    Fencing,
    LockOptions,
    Participation,
    Session,
    Timing,
    check_options,
    lock_arguments,
    merge_deprecated,
    old_keywords,
    options_from_keywords,
)
from .registry import fetch_row, transaction
from .retry import (
    RetryStrategy,
    check_retry_strategy,
    default_retry_strategy,
    delay_or_give_up,
)
from .session import (
    Backend,
    ConnectOptions,
    FencedSessions,
    QuerySession,
    SessionFactory,
    TableSession,
    WaitingSession,
)
from .slot import SessionSlot, can, connection_target
from .supervisor import Supervisor, check_give_away
from .tables import check_identifier

__all__ = [
    "DEFAULT_SCHEMA",
    "DEPRECATED_KEYWORDS",
    "Backend",
    "CallGuard",
    "CallInterrupted",
    "ConfigurationError",
    "ConnectOptions",
    "ConnectionError",
    "DeprecatedOptions",
    "Event",
    "FencedError",
    "FencedSessions",
    "Fencing",
    "Interrupted",
    "LeaderLock",
    "Leadership",
    "LibraryTable",
    "LockConfig",
    "LockOptions",
    "LockState",
    "MissingPrivilegeError",
    "Participation",
    "PgLeaderLockError",
    "QuerySession",
    "RetryContext",
    "RetryStrategy",
    "Session",
    "SessionFactory",
    "SessionSlot",
    "Supervisor",
    "TableSession",
    "Target",
    "TermTable",
    "Timing",
    "UntrustedObjectError",
    "WaitingSession",
    "bounded",
    "callback_plugin",
    "can",
    "check_give_away",
    "check_identifier",
    "check_name",
    "check_options",
    "check_retry_strategy",
    "check_roles",
    "connection_target",
    "default_retry_strategy",
    "delay_or_give_up",
    "fence_transaction",
    "fetch_row",
    "follow_state",
    "get_logger",
    "is_permanent",
    "lock_arguments",
    "lock_config",
    "lock_keys",
    "lock_settings",
    "merge_deprecated",
    "not_negative",
    "oid_to_key",
    "old_keywords",
    "options_from_keywords",
    "positive",
    "run_on_session",
    "session_settings",
    "short_session",
    "transaction",
]
