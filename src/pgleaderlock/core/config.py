"""Validated settings shared by the core: numbers, ``application_name``, and the session
settings (GUCs) that make the partition bound hold."""

from __future__ import annotations

import math
import os
import socket
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

from .errors import ConfigurationError
from .keys import check_name
from .session import DEFAULT_CLAIM_S
from .tables import DEFAULT_SCHEMA, LibraryTable, TermTable, check_identifier

if TYPE_CHECKING:
    from .options import LockOptions

__all__ = [
    "DEFAULT_SCHEMA",
    "IMMUNE_SETTINGS",
    "MAX_SECONDS",
    "SERVER_MAX_SECONDS",
    "SAFE_SETTINGS",
    "WAIT_SETTINGS",
    "LibraryTable",
    "TermTable",
    "check_identifier",
    "check_roles",
    "claim_bound",
    "FollowerMode",
    "LockConfig",
    "default_application_name",
    "default_lease_s",
    "lock_config",
    "not_negative",
    "optional_positive",
    "partition_settings",
    "positive",
    "session_settings",
]

FollowerMode = Literal["wait", "poll"]

_APPLICATION_NAME_MAX = 63  # NAMEDATALEN - 1


def optional_positive(name: str, value: object) -> float | None:
    """``None``, or ``value`` checked by `positive`."""
    return None if value is None else positive(name, value)


MAX_SECONDS = 1e9
"""The most any duration option (or other number checked by `positive` and
`not_negative`) may be, about 31.7 years: a longer one is a mistake (milliseconds given
as seconds), and would overflow where durations go: a ``datetime.timedelta`` (at about
8.6e13 s), a thread's wait (``threading.TIMEOUT_MAX``, about 9.2e9 s on Linux)."""

SERVER_MAX_SECONDS = 2_147_483.0
"""The most a duration that becomes a PostgreSQL setting in milliseconds may be (the
lease's ``idle_session_timeout``, ``tcp_user_timeout``, a term bump's
``lock_timeout``): ``INT_MAX`` milliseconds, in whole seconds (about 24.8 days). The
server refuses more, at every connection, long after the constructor accepted it."""


def _number(name: str, value: object, maximum: float) -> float:
    """``value`` as a finite float of at most ``maximum``, refusing bools, strings,
    NaN, infinities and ints too large for a float, with one message each."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ConfigurationError(f"{name} must be a number, got {value!r}")
    try:
        number = float(value)
    except OverflowError:
        number = math.inf
    if not math.isfinite(number):
        raise ConfigurationError(f"{name} must be a finite number, got {value!r}")
    if number > maximum:
        raise ConfigurationError(
            f"{name} must be at most {maximum:g}"
            + (" (PostgreSQL takes at most INT_MAX ms)" if maximum == SERVER_MAX_SECONDS else "")
            + f", got {value!r}"
        )
    return number


def positive(name: str, value: object, *, maximum: float = MAX_SECONDS) -> float:
    """``value`` as a float if it is a number above zero and at most ``maximum`` (a
    finite number, not a bool); else ConfigurationError. The one check of every
    duration option."""
    number = _number(name, value, maximum)
    if number <= 0:
        raise ConfigurationError(f"{name} must be a positive, finite number, got {value!r}")
    return number


def default_application_name(label: str) -> str:
    """``pgleaderlock:<label>@<host>:<pid>``, cut to PostgreSQL's 63 bytes."""
    name = f"pgleaderlock:{label}@{socket.gethostname()}:{os.getpid()}"
    encoded = name.encode("utf-8")[:_APPLICATION_NAME_MAX]
    return encoded.decode("utf-8", errors="ignore")


IMMUNE_SETTINGS: dict[str, str] = {
    "statement_timeout": "0",
    "lock_timeout": "0",
    "idle_in_transaction_session_timeout": "0",
    "idle_session_timeout": "0",
    "transaction_timeout": "0",
}
"""Timeouts a role or database may carry that would otherwise cancel a follower's wait
on the server, or end an idle leader's session (and its leadership): off for the lock's
own session. A wait bounded by the client sets its own statement-local
``lock_timeout`` (see ``BaseSession.wait_lock``)."""


WAIT_SETTINGS: dict[str, str] = {"client_connection_check_interval": "1000"}
"""A follower's wait on the server has no ``lock_timeout``: its backend checks every
second that the client is still there (PostgreSQL 14 and later), so that a wait whose
client died ends within a second instead of being granted the lock for nobody. Not
where the server has ``log_lock_waits = on``: every check would log the wait again."""


SAFE_SETTINGS: dict[str, str] = {"search_path": "pg_catalog, pg_temp"}
"""The lock's own session never resolves a name through a schema another role can
create objects in: every table it uses is named with its schema, and functions,
operators and types come from ``pg_catalog`` (``pg_temp`` last, as PostgreSQL advises
for code that must not be hijacked)."""


def session_settings(config: LockConfig) -> dict[str, str]:
    """Everything a lock's session sets for itself when it is set up (settings the
    server does not know, on an older version, are skipped)."""
    settings = {**IMMUNE_SETTINGS, **WAIT_SETTINGS, **SAFE_SETTINGS}
    settings.update(partition_settings(config.demotion_bound_s, config.tcp_user_timeout_s))
    return settings


def partition_settings(demotion_bound_s: float, tcp_user_timeout_s: float) -> dict[str, str]:
    """Server-side TCP settings that drop a silent session after ``tcp_user_timeout_s``.

    ``tcp_user_timeout`` bounds both paths on Linux servers: unacknowledged data and
    unanswered keepalive probes. Without it (a server OS that lacks TCP_USER_TIMEOUT)
    the keepalive path alone still waits ``idle + interval * count`` seconds, which is
    kept above the demotion bound too.
    """
    idle = max(1, math.ceil(demotion_bound_s / 2))
    count = max(1, math.ceil(tcp_user_timeout_s - idle) + 1)
    return {
        "tcp_keepalives_idle": str(idle),
        "tcp_keepalives_interval": "1",
        "tcp_keepalives_count": str(count),
        "tcp_user_timeout": str(math.ceil(tcp_user_timeout_s * 1000)),
    }


def check_roles(value: object) -> tuple[str, ...]:
    """``trusted_roles``: role names (any text PostgreSQL takes as a role name).

    Raises:
        ConfigurationError: not a sequence of non-empty names without NUL or control
            characters, of at most 63 bytes.
    """
    if isinstance(value, str) or not isinstance(value, list | tuple | set | frozenset):
        raise ConfigurationError(f"trusted_roles must be a list of role names, got {value!r}")
    for role in value:
        try:
            check_name(role, "a role name")
        except ConfigurationError:
            raise ConfigurationError(f"trusted_roles: not a role name: {role!r}") from None
        if len(role.encode()) > 63:
            raise ConfigurationError(f"trusted_roles: not a role name: {role!r}")
    return tuple(sorted(set(value)))


@dataclass(frozen=True)
class LockConfig:
    """A lock's validated timings and behaviour (see ``LeaderLock``'s arguments)."""

    health_interval_s: float
    health_timeout_s: float
    reconnect_grace_s: float | None
    connect_timeout_s: float
    command_timeout_s: float
    tcp_user_timeout_s: float
    auto_reacquire: bool
    follower_mode: FollowerMode
    retry_permanent_errors: bool = False
    term_table: TermTable | None = None
    """Where fencing terms live; ``None``: fencing is off."""
    acquire_delay_s: float = 0.0
    """With fencing: how long ``on_acquired`` waits after the term bump."""
    connect_budget_s: float | None = None
    """How long opening one session may take in all (several hosts, the pooler check);
    default ``connect_timeout_s``."""
    lease_s: float = 0.0
    """How long the server keeps a lock whose session shows no life
    (``idle_session_timeout`` on the session once it is granted a lock); 0: no lease."""
    fencing_grace_s: float = 2.0
    """With fencing: how long a new term waits for the fenced transactions of older terms
    before it ends their sessions."""
    drain_s: float = 0.0
    """How long a graceful stop lets leader work finish its unit before the release."""
    escalate_after_s: float = 30.0
    """Errors that keep the lock from leading for this long are escalated (a summary at
    ERROR, then at doubling intervals)."""
    trusted_roles: tuple[str, ...] = ()
    """Roles trusted besides the session's own and superusers: their tables and schemas,
    and (in a group) their sessions and messages."""

    @property
    def demotion_bound_s(self) -> float:
        """A silent session is noticed (and leadership given up) within this time."""
        return self.health_interval_s + self.health_timeout_s

    @property
    def claim_s(self) -> float:
        """How long a session that a wait on the server was granted the lock may stay
        silent before the server ends it ([`claim_bound`][pgleaderlock.core.config.claim_bound])."""
        return claim_bound(self.health_timeout_s, self.lease_s)


def lock_config(
    options: LockOptions | None = None,
    *,
    health_interval_s: object = 5.0,
    reconnect_grace_s: object = None,
    auto_reacquire: object = True,
) -> LockConfig:
    """A lock's settings, checked before any I/O: the specification's flat arguments
    (with ``LeaderLock``'s defaults; a unit test keeps the two equal) and the option
    groups, whose defaults and own checks are written once, in
    [`LockOptions`][pgleaderlock.LockOptions]. What spans groups is checked here.

    Raises:
        ConfigurationError: a non-positive or non-finite number, a ``tcp_user_timeout_s``
            that breaks the partition bound, a ``lease_s`` that a healthy leader could
            outlive, a wrong type.
    """
    if options is None:
        from .options import LockOptions

        options = LockOptions()
    timing, fencing = options.timing, options.fencing
    interval = positive("health_interval_s", health_interval_s)
    probe_timeout = timing.health_timeout_s
    bound = interval + probe_timeout
    tcp_user_timeout_s = timing.tcp_user_timeout_s
    if tcp_user_timeout_s is None:
        tcp_user_timeout_s = bound + max(1.0, bound / 4)
        if tcp_user_timeout_s > SERVER_MAX_SECONDS:
            raise ConfigurationError(
                f"health_interval_s + health_timeout_s = {bound:g} is too long: the lock's "
                f"session sets tcp_user_timeout above it, and PostgreSQL takes at most "
                f"{SERVER_MAX_SECONDS:g} s (INT_MAX ms)"
            )
    user_timeout = positive("tcp_user_timeout_s", tcp_user_timeout_s, maximum=SERVER_MAX_SECONDS)
    if user_timeout <= bound:
        raise ConfigurationError(
            f"tcp_user_timeout_s={user_timeout:g} must exceed health_interval_s + "
            f"health_timeout_s = {bound:g}: otherwise a partitioned leader's lock could be "
            "granted to another session before the old leader has noticed and demoted itself"
        )
    if not isinstance(auto_reacquire, bool):
        raise ConfigurationError(f"auto_reacquire must be a bool, got {auto_reacquire!r}")
    delay = fencing.acquire_delay_s
    lease = _lease(timing.lease_s, interval, bound, delay)
    trusted = tuple(options.trusted_roles)
    return LockConfig(
        health_interval_s=interval,
        health_timeout_s=probe_timeout,
        reconnect_grace_s=optional_positive("reconnect_grace_s", reconnect_grace_s),
        connect_timeout_s=timing.connect_timeout_s,
        command_timeout_s=timing.command_timeout_s,
        tcp_user_timeout_s=user_timeout,
        auto_reacquire=auto_reacquire,
        follower_mode=options.session.follower_mode,
        retry_permanent_errors=options.session.retry_permanent_errors,
        term_table=TermTable(fencing.table, fencing.schema, trusted) if fencing.enabled else None,
        trusted_roles=trusted,
        acquire_delay_s=delay,
        lease_s=lease,
        fencing_grace_s=fencing.grace_s,
        drain_s=timing.drain_s,
        escalate_after_s=timing.escalate_after_s,
    )


def default_lease_s(health_interval_s: float, health_timeout_s: float) -> float:
    """The lease when none is given: two probe intervals, and at least the demotion bound
    plus ``max(1, bound / 4)`` (the partition bound's margin). 10 s with the defaults."""
    bound = health_interval_s + health_timeout_s
    return max(2 * health_interval_s, bound + max(1.0, bound / 4))


def claim_bound(health_timeout_s: float, lease_s: float) -> float:
    """The claim: ``min(lease_s, max(1, health_timeout_s / 2))`` seconds (1 s with the
    default timings), before what a busy process adds
    (``SessionSlot.session_options``).

    A follower queued on the server can be granted the lock at any moment; the grant's
    statement sets the session's ``idle_session_timeout`` to this, and the follower's
    session, as soon as it reads the grant, replaces it by the lease (one more round
    trip). A follower that cannot read the grant (its process stopped, its event loop
    blocked) is ended by the server this long after the grant, and the next waiter is
    granted the lock. A live follower only needs to read the answer and send one
    statement: an event loop's latency and one round trip, which ``health_timeout_s``
    bounds for a probe; half of it, and never less than a second, leaves a busy machine
    ample room. No longer than the lease, which ends a silent session anyway.
    """
    floor = max(DEFAULT_CLAIM_S, health_timeout_s / 2)
    return min(lease_s, floor) if lease_s > 0 else floor


def _lease(value: object, interval: float, bound: float, acquire_delay_s: float) -> float:
    """``lease_s``, checked: a leader probes every ``health_interval_s`` and each probe
    may take ``health_timeout_s`` on a busy machine, so a healthy leader's session is
    idle for less than ``bound``; the first probe of a leadership comes up to
    ``acquire_delay_s`` later still."""
    if value is None:
        lease = default_lease_s(interval, bound - interval) + acquire_delay_s
        if lease > SERVER_MAX_SECONDS:
            raise ConfigurationError(
                f"the default lease_s ({lease:g}, from health_interval_s, health_timeout_s "
                f"and acquire_delay_s) is more than PostgreSQL takes ({SERVER_MAX_SECONDS:g} "
                "s, INT_MAX ms): shorten those, or give lease_s"
            )
        return lease
    lease = positive("lease_s", value, maximum=SERVER_MAX_SECONDS)
    floor = bound + acquire_delay_s
    if lease <= floor:
        extra = " + acquire_delay_s" if acquire_delay_s else ""
        raise ConfigurationError(
            f"lease_s={lease:g} must exceed health_interval_s + health_timeout_s{extra} = "
            f"{floor:g}: otherwise a healthy leader on a busy machine could lose its lock to "
            "its own lease between two probes"
        )
    return lease


def not_negative(name: str, value: object, *, maximum: float = MAX_SECONDS) -> float:
    """``value`` as a float if it is a number >= 0 and at most ``maximum`` (as
    `positive`); else ConfigurationError."""
    number = _number(name, value, maximum)
    if number < 0:
        raise ConfigurationError(f"{name} must not be negative, got {value!r}")
    return number
