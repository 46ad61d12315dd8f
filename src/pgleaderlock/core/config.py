"""Validated settings shared by the core: numbers, ``application_name``, and the session
settings (GUCs) that make the partition bound hold."""

from __future__ import annotations

import math
import os
import socket

from .errors import ConfigurationError

__all__ = [
    "default_application_name",
    "optional_positive",
    "partition_settings",
    "positive",
    "session_settings",
]

_APPLICATION_NAME_MAX = 63  # NAMEDATALEN - 1


def optional_positive(name: str, value: object) -> float | None:
    """``None``, or ``value`` checked by :func:`positive`."""
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


def session_settings(
    demotion_bound_s: float, tcp_user_timeout_s: float, follower_mode: str
) -> dict[str, str]:
    """Everything a lock's session sets at connect time."""
    settings = partition_settings(demotion_bound_s, tcp_user_timeout_s)
    if follower_mode == "wait":
        # A backend waiting in pg_advisory_lock does not read its socket: without this
        # (PostgreSQL >= 14) a follower that went away would stay queued for the lock
        # until its lock_timeout, and could even be granted it.
        settings["client_connection_check_interval"] = "500"
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
