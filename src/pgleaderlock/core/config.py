"""Validated settings shared by the core: numbers, ``application_name``, and the session
settings (GUCs) that make the partition bound hold."""

from __future__ import annotations

import math
import os
import re
import socket
from dataclasses import dataclass
from typing import Literal

from .errors import ConfigurationError

__all__ = [
    "IMMUNE_SETTINGS",
    "TermTable",
    "FollowerMode",
    "LockConfig",
    "default_application_name",
    "default_lease_s",
    "lock_config",
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


def positive(name: str, value: object) -> float:
    """``value`` as a float if it is a positive, finite number; else ConfigurationError."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ConfigurationError(f"{name} must be a number, got {value!r}")
    if not math.isfinite(value) or value <= 0:
        raise ConfigurationError(f"{name} must be a positive, finite number, got {value!r}")
    return float(value)


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
own session. A wait sets its own statement-local ``lock_timeout``."""


def session_settings(config: LockConfig) -> dict[str, str]:
    """Everything a lock's session sets for itself when it is set up (settings the
    server does not know, on an older version, are skipped)."""
    settings = {**IMMUNE_SETTINGS}
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


_IDENTIFIER = re.compile(r"^[A-Za-z_][A-Za-z0-9_$]{0,62}$")


@dataclass(frozen=True)
class TermTable:
    """The table that holds fencing terms: one row per lock, keyed by its keys.

    Attributes:
        name: the table's name.
        schema: its schema; ``None``: the first schema of the session's ``search_path``.
    """

    name: str = "pgleaderlock_terms"
    schema: str | None = None

    def __post_init__(self) -> None:
        for what, value in (("fencing_table", self.name), ("fencing_schema", self.schema)):
            if value is not None and not (isinstance(value, str) and _IDENTIFIER.fullmatch(value)):
                raise ConfigurationError(
                    f"{what} must be a plain SQL identifier (letters, digits, _; at most "
                    f"63 bytes), got {value!r}"
                )

    @property
    def sql(self) -> str:
        """The quoted, qualified name, for statements."""
        quoted = f'"{self.name}"'
        return f'"{self.schema}".{quoted}' if self.schema else quoted


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

    @property
    def demotion_bound_s(self) -> float:
        """A silent session is noticed (and leadership given up) within this time."""
        return self.health_interval_s + self.health_timeout_s


def lock_config(
    *,
    health_interval_s: object,
    health_timeout_s: object,
    reconnect_grace_s: object,
    connect_timeout_s: object,
    command_timeout_s: object,
    tcp_user_timeout_s: object,
    auto_reacquire: object,
    follower_mode: object,
    retry_permanent_errors: object = False,
    fencing: object = False,
    fencing_table: object = "pgleaderlock_terms",
    fencing_schema: object = None,
    acquire_delay_s: object = 0.0,
    lease_s: object = None,
    fencing_grace_s: object = 2.0,
    drain_s: object = 0.0,
) -> LockConfig:
    """Check a lock's settings before any I/O.

    Raises:
        ConfigurationError: a non-positive or non-finite number, a ``tcp_user_timeout_s``
            that breaks the partition bound, a ``lease_s`` that a healthy leader could
            outlive, a wrong type or an unknown follower mode.
    """
    interval = positive("health_interval_s", health_interval_s)
    probe_timeout = positive("health_timeout_s", health_timeout_s)
    bound = interval + probe_timeout
    if tcp_user_timeout_s is None:
        tcp_user_timeout_s = bound + max(1.0, bound / 4)
    user_timeout = positive("tcp_user_timeout_s", tcp_user_timeout_s)
    if user_timeout <= bound:
        raise ConfigurationError(
            f"tcp_user_timeout_s={user_timeout:g} must exceed health_interval_s + "
            f"health_timeout_s = {bound:g}: otherwise a partitioned leader's lock could be "
            "granted to another session before the old leader has noticed and demoted itself"
        )
    for name, flag in (
        ("auto_reacquire", auto_reacquire),
        ("retry_permanent_errors", retry_permanent_errors),
        ("fencing", fencing),
    ):
        if not isinstance(flag, bool):
            raise ConfigurationError(f"{name} must be a bool, got {flag!r}")
    if follower_mode not in ("wait", "poll"):
        raise ConfigurationError(f"follower_mode must be 'wait' or 'poll', got {follower_mode!r}")
    delay = _not_negative("acquire_delay_s", acquire_delay_s)
    if delay and not fencing:
        raise ConfigurationError("acquire_delay_s needs fencing=True (it follows the term bump)")
    lease = _lease(lease_s, interval, bound, delay)
    return LockConfig(
        health_interval_s=interval,
        health_timeout_s=probe_timeout,
        reconnect_grace_s=optional_positive("reconnect_grace_s", reconnect_grace_s),
        connect_timeout_s=positive("connect_timeout_s", connect_timeout_s),
        command_timeout_s=positive("command_timeout_s", command_timeout_s),
        tcp_user_timeout_s=user_timeout,
        auto_reacquire=bool(auto_reacquire),
        follower_mode="wait" if follower_mode == "wait" else "poll",
        retry_permanent_errors=bool(retry_permanent_errors),
        term_table=_term_table(fencing_table, fencing_schema) if fencing else None,
        acquire_delay_s=delay,
        lease_s=lease,
        fencing_grace_s=positive("fencing_grace_s", fencing_grace_s),
        drain_s=_not_negative("drain_s", drain_s),
    )


def default_lease_s(health_interval_s: float, health_timeout_s: float) -> float:
    """The lease when none is given: two probe intervals, and at least the demotion bound
    plus ``max(1, bound / 4)`` (the partition bound's margin). 10 s with the defaults."""
    bound = health_interval_s + health_timeout_s
    return max(2 * health_interval_s, bound + max(1.0, bound / 4))


def _lease(value: object, interval: float, bound: float, acquire_delay_s: float) -> float:
    """``lease_s``, checked: a leader probes every ``health_interval_s`` and each probe
    may take ``health_timeout_s`` on a busy machine, so a healthy leader's session is
    idle for less than ``bound``; the first probe of a leadership comes up to
    ``acquire_delay_s`` later still."""
    if value is None:
        return default_lease_s(interval, bound - interval) + acquire_delay_s
    lease = positive("lease_s", value)
    floor = bound + acquire_delay_s
    if lease <= floor:
        extra = " + acquire_delay_s" if acquire_delay_s else ""
        raise ConfigurationError(
            f"lease_s={lease:g} must exceed health_interval_s + health_timeout_s{extra} = "
            f"{floor:g}: otherwise a healthy leader on a busy machine could lose its lock to "
            "its own lease between two probes"
        )
    return lease


def _term_table(name: object, schema: object) -> TermTable:
    return TermTable(name, schema)  # type: ignore[arg-type]  # validated there


def _not_negative(name: str, value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise ConfigurationError(f"{name} must be a number, got {value!r}")
    if value < 0:
        raise ConfigurationError(f"{name} must not be negative, got {value!r}")
    return float(value)
