"""Option groups: what a lock takes beyond the specification's own arguments.

[`LeaderLock`][pgleaderlock.LeaderLock] keeps the specification's arguments flat (``dsn,
key1, key2, retry_strategy, health_interval_s, reconnect_grace_s, auto_reacquire,
shutdown_event, connect_fn``); everything added since lives in small, typed, immutable
groups, gathered in one [`LockOptions`][pgleaderlock.LockOptions] value that every entry
point takes (``LeaderLock``, ``LeaderLock.from_name``, ``Semaphore``, ``Coordinator``), as
httpx's ``Timeout`` is taken by every client:

```python
options = LockOptions(timing=Timing(lease_s=20), fencing=Fencing(enabled=True))
lock = LeaderLock.from_name("billing", DSN, options=options)
```

Each group checks its own fields once, when it is made (a bad value is a
[`ConfigurationError`][pgleaderlock.ConfigurationError] at that line, before any lock
exists), and its field defaults are the library's defaults: written here, once. What
spans groups (the partition bound, the lease against the probe timings) is checked by
the lock (``core.config.lock_config``).

The flat keywords these groups replace (``lease_s=``, ``fencing=True``, ...) still work
for one release, with a ``DeprecationWarning`` that names the new spelling
([`DEPRECATED_KEYWORDS`][pgleaderlock.core.options.DEPRECATED_KEYWORDS]).
"""

from __future__ import annotations

import dataclasses
import warnings
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import TYPE_CHECKING, Any, Final, TypedDict, cast

from .config import (
    DEFAULT_SCHEMA,
    SERVER_MAX_SECONDS,
    FollowerMode,
    check_roles,
    not_negative,
    optional_positive,
    positive,
)
from .errors import ConfigurationError
from .keys import check_name
from .metadata import check_metadata
from .tables import check_identifier

if TYPE_CHECKING:
    import asyncio

    from .retry import RetryStrategy
    from .session import SessionFactory

__all__ = [
    "DEPRECATED_KEYWORDS",
    "SPEC_ARGUMENTS",
    "DeprecatedOptions",
    "Fencing",
    "LockArguments",
    "LockOptions",
    "Participation",
    "Session",
    "Timing",
    "deprecated_spelling",
    "lock_arguments",
    "merge_deprecated",
    "old_keywords",
    "options_from_keywords",
    "without_deprecated",
]


def _flag(name: str, value: object) -> bool:
    if not isinstance(value, bool):
        raise ConfigurationError(f"{name} must be a bool, got {value!r}")
    return value


def _set(obj: object, name: str, value: object) -> None:
    """Store a checked (normalised) value on a frozen instance, in ``__post_init__``."""
    object.__setattr__(obj, name, value)


@dataclass(frozen=True, slots=True)
class Timing:
    """How long the lock's calls, probes, lease and stops may take (seconds).

    Together with ``health_interval_s`` (an argument of the lock itself), these bound
    every wait of the lock: see [Guarantees](../guarantees.md).

    Raises:
        ConfigurationError: a value that is not a positive (or, where 0 is allowed,
            non-negative), finite number of at most ``MAX_SECONDS``; durations that
            become server settings at most ``SERVER_MAX_SECONDS``.
    """

    health_timeout_s: float = 2.0
    """Timeout of one health probe: a silent failure is detected within
    ``health_interval_s + health_timeout_s``."""
    connect_timeout_s: float = 5.0
    """Timeout for connecting to one host; a multi-host DSN gives each host an attempt
    of its own (a DSN's own ``connect_timeout`` wins). Opening a session, with its
    checks, is bounded by twice the time for all hosts plus ``command_timeout_s``."""
    command_timeout_s: float = 5.0
    """Timeout for ``pg_try_advisory_lock`` and ``pg_advisory_unlock``."""
    tcp_user_timeout_s: float | None = None
    """After how long of network silence the *server* drops the session (and frees the
    lock); must exceed ``health_interval_s + health_timeout_s``. ``None``: that bound
    plus ``max(1, bound / 4)``."""
    lease_s: float | None = None
    """The lease the server enforces: a leader whose session shows no life for this long
    (its probes stopped: a blocked event loop, a frozen process) loses the lock to the
    server, with no help from the client (``idle_session_timeout`` on the lock's
    session, PostgreSQL 14 and later; every probe renews it). Must exceed
    ``health_interval_s + health_timeout_s`` (+ ``Fencing.acquire_delay_s``), so that a
    healthy leader on a busy machine never loses its lock to it. ``None``:
    ``2 * health_interval_s``, at least that bound plus ``max(1, bound / 4)`` (10 s
    with the defaults). See [The lease](../guarantees.md#the-lease)."""
    drain_s: float = 0.0
    """On a graceful stop (``step_down()``, ``shutdown()``, SIGTERM in the CLI), how long
    leader work may finish its current unit before the lock is released: the lock stays
    LEADER and keeps probing, [`draining`][pgleaderlock.LeaderLock.draining] turns True
    and the [`on_draining`][pgleaderlock.LeaderLock.on_draining] callbacks run; the
    release follows when they have returned, or after ``drain_s``. 0: release at
    once."""
    escalate_after_s: float = 30.0
    """Errors that keep the lock from leading (it cannot connect, or its attempts fail,
    with no attempt reaching the server in between) for this long are escalated: an
    ERROR line ``lock_failing`` says for how long, how many errors and what to check,
    again at doubling intervals (at most every 10 min); until then only the first
    error, and each different one, is logged at ERROR, repeats at DEBUG.
    [`statistics().failing_since`][pgleaderlock.LockStatistics] says since when."""

    def __post_init__(self) -> None:
        _set(self, "health_timeout_s", positive("health_timeout_s", self.health_timeout_s))
        _set(self, "connect_timeout_s", positive("connect_timeout_s", self.connect_timeout_s))
        _set(self, "command_timeout_s", positive("command_timeout_s", self.command_timeout_s))
        if self.tcp_user_timeout_s is not None:
            _set(
                self,
                "tcp_user_timeout_s",
                positive("tcp_user_timeout_s", self.tcp_user_timeout_s, maximum=SERVER_MAX_SECONDS),
            )
        if self.lease_s is not None:
            _set(self, "lease_s", positive("lease_s", self.lease_s, maximum=SERVER_MAX_SECONDS))
        _set(self, "drain_s", not_negative("drain_s", self.drain_s))
        _set(self, "escalate_after_s", positive("escalate_after_s", self.escalate_after_s))


@dataclass(frozen=True, slots=True)
class Fencing:
    """Fencing terms: a per-lock term in a table, bumped on the lock's own session before
    LEADER is announced; [`fence`][pgleaderlock.LeaderLock.fence] orders the caller's
    transactions after it. See [Fencing](../fencing.md).

    Raises:
        ConfigurationError: a non-bool ``enabled``, a table or schema that is not a plain
            SQL identifier, a bad duration, or ``acquire_delay_s`` without ``enabled``.
    """

    enabled: bool = False
    """Keep a fencing term per lock (the table is created if missing)."""
    table: str = "pgleaderlock_terms"
    """The table of terms."""
    schema: str = DEFAULT_SCHEMA
    """Its schema: always named in statements, never found through ``search_path``; the
    table is used only if a trusted role owns it and the schema."""
    acquire_delay_s: float = 0.0
    """How long ``on_acquired`` (and ``is_leader``) waits after the term bump: a margin
    for side effects outside the database."""
    grace_s: float = 2.0
    """How long a new term's bump waits for the fenced transactions of an older term
    before it ends their sessions (``pg_terminate_backend``, which needs the same role
    or ``pg_signal_backend``), so that a frozen old leader cannot keep every leader out.
    See [Fencing](../fencing.md#a-frozen-old-leader)."""

    def __post_init__(self) -> None:
        _flag("Fencing.enabled", self.enabled)
        check_identifier("Fencing.table", self.table)
        check_identifier("Fencing.schema", self.schema)
        _set(self, "acquire_delay_s", not_negative("acquire_delay_s", self.acquire_delay_s))
        _set(self, "grace_s", positive("fencing grace_s", self.grace_s, maximum=SERVER_MAX_SECONDS))
        if self.acquire_delay_s and not self.enabled:
            raise ConfigurationError(
                "acquire_delay_s needs fencing (Fencing(enabled=True)): it follows the term bump"
            )


@dataclass(frozen=True, slots=True)
class Participation:
    """Who leads: what the lock publishes about itself, whether it may lead, and how it
    hands over to a preferred candidate. See [Who leads](../guides/who-leads.md).

    A lock given ``metadata``, ``identity`` or ``priority`` publishes a row in the
    participants table on each new session; without them it publishes nothing.

    Raises:
        ConfigurationError: metadata that is not a small plain JSON object, an unsafe
            identity, a priority outside int4, a bad duration or table name.
    """

    identity: str | None = None
    """This lock's name among the replicas; ``None``: ``<host>:<pid>:<n>``."""
    metadata: Mapping[str, Any] | None = None
    """A small JSON object published while this lock leads (address, version...);
    stored as a read-only copy."""
    priority: int | None = None
    """Higher wins: a leader hands over to a waiting candidate of a strictly higher
    priority. ``None``: off (ranks lowest)."""
    eligible: bool = True
    """``False`` makes an observer: it never takes the lock (it opens no lock session),
    and its [`on_leader_changed`][pgleaderlock.LeaderLock.on_leader_changed] callbacks
    still run."""
    handover_delay_s: float = 0.5
    """How long a leader waits after seeing a higher-priority candidate before it hands
    over."""
    watch_interval_s: float | None = None
    """How often the process's leader watch looks again without a notification (the
    bound on noticing a leader that ended with nobody to follow it); ``None``:
    ``health_interval_s``."""
    table: str = "pgleaderlock_participants"
    """The table locks publish their details in (created if missing, with row-level
    security)."""
    schema: str = DEFAULT_SCHEMA
    """Its schema."""
    metadata_json: str | None = field(default=None, init=False, repr=False, compare=False)
    """``metadata`` as the JSON text that is published (computed)."""

    def __post_init__(self) -> None:
        _set(self, "metadata_json", check_metadata(self.metadata))
        if self.metadata is not None:
            _set(self, "metadata", MappingProxyType(dict(self.metadata)))
        if self.identity is not None:
            check_name(self.identity, "identity")
        priority = self.priority
        if priority is not None and (
            isinstance(priority, bool)
            or not isinstance(priority, int)
            or not -(2**31) <= priority < 2**31
        ):
            raise ConfigurationError(f"priority must be a 32-bit integer, got {priority!r}")
        _flag("eligible", self.eligible)
        _set(self, "handover_delay_s", not_negative("handover_delay_s", self.handover_delay_s))
        _set(self, "watch_interval_s", optional_positive("watch_interval_s", self.watch_interval_s))
        check_identifier("Participation.table", self.table)
        check_identifier("Participation.schema", self.schema)

    @property
    def publishes(self) -> bool:
        """Whether the lock writes a participant row (it was given something to say)."""
        return self.metadata is not None or self.identity is not None or self.priority is not None


@dataclass(frozen=True, slots=True)
class Session:
    """The lock's own database session: which driver opens it, how it is named, how a
    follower waits on it, and whether a refusal by the server is retried.

    Raises:
        ConfigurationError: a backend that is not a name, an unsafe application name,
            an unknown follower mode, a non-bool flag.
    """

    backend: str | None = None
    """Driver backend name (``"psycopg"``, ``"asyncpg"``, ``"sqlalchemy"``...);
    ``None``: from the DSN scheme, else psycopg."""
    application_name: str | None = None
    """Shown in ``pg_stat_activity``; ``None``:
    ``pgleaderlock:<name or keys>@<host>:<pid>``."""
    follower_mode: FollowerMode = "wait"
    """``"wait"``: after an attempt finds the lock taken, the follower waits *on the
    server* (``pg_advisory_lock`` under ``lock_timeout``) for as long as the retry
    strategy's delay, and is granted the lock the instant the holder's session ends.
    ``"poll"``: the specification's behaviour, sleep for the delay and try again with
    ``pg_try_advisory_lock``. Each wait that ends without the lock counts as one failed
    attempt (``on_acquire_failed``, then the strategy is asked). A waiting follower
    keeps one server backend busy; backends that cannot wait fall back to polling."""
    retry_permanent_errors: bool = False
    """Keep retrying when the server refuses the client (authentication, unknown role
    or database), e.g. while a password is rotated. Default: report and stop."""

    def __post_init__(self) -> None:
        if self.backend is not None and not isinstance(self.backend, str):
            raise ConfigurationError(f"backend must be a name (str), got {self.backend!r}")
        if self.application_name is not None:
            check_name(self.application_name, "application_name")
        if self.follower_mode not in ("wait", "poll"):
            raise ConfigurationError(
                f"follower_mode must be 'wait' or 'poll', got {self.follower_mode!r}"
            )
        _flag("retry_permanent_errors", self.retry_permanent_errors)


@dataclass(frozen=True, slots=True)
class LockOptions:
    """Everything a lock takes beyond the specification's arguments, in groups.

    Every field has the library's default, so ``LockOptions()`` is a lock's default and
    ``LockOptions(timing=Timing(lease_s=20))`` changes the lease only. Change one field
    of a given value with ``dataclasses.replace``.

    Raises:
        ConfigurationError: a group of the wrong type, bad ``trusted_roles``, a
            non-bool ``load_plugins``.
    """

    timing: Timing = field(default_factory=Timing)
    """Timeouts, lease, drain, escalation."""
    fencing: Fencing = field(default_factory=Fencing)
    """Fencing terms (off by default)."""
    participation: Participation = field(default_factory=Participation)
    """Who leads: identity, metadata, priority, eligibility."""
    session: Session = field(default_factory=Session)
    """The lock's own session: backend, name, follower mode."""
    trusted_roles: Sequence[str] = ()
    """Roles trusted besides the session's own and superusers: owners of the library's
    tables and schemas, and (in a group) its members. Stored sorted, as a tuple."""
    load_plugins: bool = True
    """Register the plugins of the ``pgleaderlock.plugins`` entry-point group (unless
    ``PGLEADERLOCK_DISABLE_PLUGIN_AUTOLOAD`` is set)."""

    def __post_init__(self) -> None:
        for name, kind in (
            ("timing", Timing),
            ("fencing", Fencing),
            ("participation", Participation),
            ("session", Session),
        ):
            value = getattr(self, name)
            if not isinstance(value, kind):
                raise ConfigurationError(
                    f"LockOptions.{name} must be a {kind.__name__}, got {value!r}"
                )
        _set(self, "trusted_roles", check_roles(self.trusted_roles))
        _flag("load_plugins", self.load_plugins)


def check_options(options: object) -> LockOptions:
    """``options`` if it is a ``LockOptions`` (``None``: the defaults)."""
    if options is None:
        return LockOptions()
    if not isinstance(options, LockOptions):
        raise ConfigurationError(f"options must be a LockOptions, got {options!r}")
    return options


# ---------------------------------------------------------------------- the old spelling

DEPRECATED_KEYWORDS: Final[Mapping[str, tuple[str | None, str]]] = MappingProxyType({
    "health_timeout_s": ("timing", "health_timeout_s"),
    "connect_timeout_s": ("timing", "connect_timeout_s"),
    "command_timeout_s": ("timing", "command_timeout_s"),
    "tcp_user_timeout_s": ("timing", "tcp_user_timeout_s"),
    "lease_s": ("timing", "lease_s"),
    "drain_s": ("timing", "drain_s"),
    "escalate_after_s": ("timing", "escalate_after_s"),
    "fencing": ("fencing", "enabled"),
    "fencing_table": ("fencing", "table"),
    "fencing_schema": ("fencing", "schema"),
    "acquire_delay_s": ("fencing", "acquire_delay_s"),
    "fencing_grace_s": ("fencing", "grace_s"),
    "identity": ("participation", "identity"),
    "metadata": ("participation", "metadata"),
    "priority": ("participation", "priority"),
    "eligible": ("participation", "eligible"),
    "handover_delay_s": ("participation", "handover_delay_s"),
    "watch_interval_s": ("participation", "watch_interval_s"),
    "participants_table": ("participation", "table"),
    "participants_schema": ("participation", "schema"),
    "backend": ("session", "backend"),
    "application_name": ("session", "application_name"),
    "follower_mode": ("session", "follower_mode"),
    "retry_permanent_errors": ("session", "retry_permanent_errors"),
    "trusted_roles": (None, "trusted_roles"),
    "load_plugins": (None, "load_plugins"),
})  # fmt: skip
"""Each flat keyword of 0.1 -> (group of ``LockOptions``, or ``None`` for a field of
``LockOptions`` itself; field). The one table the deprecation, its messages and the
migration table in the CHANGELOG follow."""


class DeprecatedOptions(TypedDict, total=False):
    """The flat keywords of 0.1, still accepted (with a ``DeprecationWarning``) until
    0.3: see [`DEPRECATED_KEYWORDS`][pgleaderlock.core.options.DEPRECATED_KEYWORDS]."""

    health_timeout_s: float
    connect_timeout_s: float
    command_timeout_s: float
    tcp_user_timeout_s: float | None
    lease_s: float | None
    drain_s: float
    escalate_after_s: float
    fencing: bool
    fencing_table: str
    fencing_schema: str
    acquire_delay_s: float
    fencing_grace_s: float
    identity: str | None
    metadata: Mapping[str, Any] | None
    priority: int | None
    eligible: bool
    handover_delay_s: float
    watch_interval_s: float | None
    participants_table: str
    participants_schema: str
    backend: str | None
    application_name: str | None
    follower_mode: FollowerMode
    retry_permanent_errors: bool
    trusted_roles: Sequence[str]
    load_plugins: bool


class LockArguments(DeprecatedOptions, total=False):
    """[`LeaderLock`][pgleaderlock.LeaderLock]'s keyword arguments after its keys and
    name, as the entry points that take them on (``from_name``,
    [`Semaphore`][pgleaderlock.Semaphore]) take them: the specification's, ``options``,
    and the deprecated flat keywords. Their defaults and meaning are the constructor's."""

    retry_strategy: RetryStrategy | None
    health_interval_s: float
    reconnect_grace_s: float | None
    auto_reacquire: bool
    shutdown_event: asyncio.Event | None
    connect_fn: SessionFactory | None
    options: LockOptions | None


def without_deprecated(arguments: LockArguments, *, owner: str) -> LockArguments:
    """``arguments`` with its deprecated flat keywords merged into ``options``
    (`merge_deprecated`, warning at the caller of ``owner``, the entry point that calls
    this)."""
    old = {k: v for k, v in arguments.items() if k in DEPRECATED_KEYWORDS}
    if not old:
        return arguments
    kept: dict[str, Any] = {k: v for k, v in arguments.items() if k not in old}
    kept["options"] = merge_deprecated(arguments.get("options"), old, owner=owner, stacklevel=4)
    return cast(LockArguments, kept)


_GROUP_CLASSES: Final = {
    "timing": "Timing",
    "fencing": "Fencing",
    "participation": "Participation",
    "session": "Session",
}


def deprecated_spelling(keyword: str) -> str:
    """The new spelling of an old keyword, e.g.
    ``options=LockOptions(timing=Timing(lease_s=...))``."""
    group, name = DEPRECATED_KEYWORDS[keyword]
    if group is None:
        return f"options=LockOptions({name}=...)"
    return f"options=LockOptions({group}={_GROUP_CLASSES[group]}({name}=...))"


def _default(group: str | None, name: str) -> object:
    """A field's default (as its group stores it)."""
    defaults = LockOptions()
    return getattr(defaults if group is None else getattr(defaults, group), name)


def options_from_keywords(
    keywords: Mapping[str, object],
    options: LockOptions | None = None,
    *,
    owner: str = "LeaderLock",
) -> LockOptions:
    """``options`` (default ``LockOptions()``) with the flat keywords of 0.1 applied,
    without a warning: for callers that read a flat mapping from configuration (Django
    settings, the CLI, the Coordinator's own locks).

    Raises:
        TypeError: a keyword that is not one of ``DEPRECATED_KEYWORDS``.
        ConfigurationError: a setting given both as a keyword and in ``options`` (with
            a value other than its default), or a value its group refuses.
    """
    given = options is not None
    base = check_options(options)
    unknown = sorted(set(keywords) - set(DEPRECATED_KEYWORDS))
    if unknown:
        raise TypeError(f"{owner}() got an unexpected keyword argument {unknown[0]!r}")
    changes: dict[str | None, dict[str, object]] = {}
    for keyword, value in keywords.items():
        group, name = DEPRECATED_KEYWORDS[keyword]
        holder = base if group is None else getattr(base, group)
        if given and getattr(holder, name) != _default(group, name):
            raise ConfigurationError(
                f"{owner}: {keyword}= and options set the same setting; give it once, as "
                f"{deprecated_spelling(keyword)}"
            )
        changes.setdefault(group, {})[name] = value
    top: dict[str, Any] = dict(changes.pop(None, {}))
    for group, fields in changes.items():
        assert group is not None
        top[group] = dataclasses.replace(getattr(base, group), **fields)
    return dataclasses.replace(base, **top) if top else base


def merge_deprecated(
    options: LockOptions | None,
    keywords: Mapping[str, object],
    *,
    owner: str,
    stacklevel: int = 3,
) -> LockOptions:
    """``options`` with the old keywords applied (``options_from_keywords``), warning
    once per keyword with its new spelling. ``stacklevel`` points the warning at the
    caller of the public entry point (3: the caller of the function that calls this)."""
    merged = options_from_keywords(keywords, options, owner=owner)
    for keyword in keywords:
        warnings.warn(
            f"{keyword}= is deprecated; use {deprecated_spelling(keyword)}",
            DeprecationWarning,
            stacklevel=stacklevel,
        )
    return merged


def old_keywords(options: LockOptions) -> dict[str, object]:
    """The flat keywords that make ``options`` (those that differ from the default):
    the inverse of ``options_from_keywords``, for code that still passes them on."""
    made: dict[str, object] = {}
    for keyword, (group, name) in DEPRECATED_KEYWORDS.items():
        holder = options if group is None else getattr(options, group)
        value = getattr(holder, name)
        if value != _default(group, name):
            made[keyword] = dict(value) if isinstance(value, MappingProxyType) else value
    return made


SPEC_ARGUMENTS: Final = frozenset({
    "retry_strategy", "health_interval_s", "reconnect_grace_s", "auto_reacquire",
    "shutdown_event", "connect_fn", "name",
})  # fmt: skip
"""``LeaderLock``'s own keyword arguments (the specification's, and ``name``)."""


def lock_arguments(keywords: Mapping[str, Any]) -> dict[str, Any]:
    """A flat mapping of lock settings (as configuration gives them: Django's
    ``OPTIONS``, the Coordinator's settings for its locks) as ``LeaderLock``'s keyword
    arguments: the specification's as they are, the rest as ``options=`` (no warning).

    Raises:
        TypeError: an unknown keyword.
        ConfigurationError: a value its group refuses.
    """
    spec = {k: v for k, v in keywords.items() if k in SPEC_ARGUMENTS}
    rest = {k: v for k, v in keywords.items() if k not in SPEC_ARGUMENTS}
    options = rest.pop("options", None)
    return {**spec, "options": options_from_keywords(rest, options)}
