"""doctor's **replication** check: what a failover of this primary can lose.

A term, a ledger claim and a checkpoint survive a failover only if their commits had
reached the standby that is promoted: with **synchronous** replication
(``synchronous_standby_names`` naming a standby that is connected as ``sync`` or
``quorum``, and ``synchronous_commit`` ``on``, ``remote_write`` or ``remote_apply``;
under Patroni ``synchronous_mode: true``) they have; with **asynchronous** replication
the last moments before a crash can be lost: those slots can run again, a fenced
checkpoint can move back (docs/guarantees.md, "What survives a failover").

The facts are read on doctor's session (`REPLICATION_QUERY`, `STANDBYS_QUERY`, and
Patroni's REST ``/config`` when ``--patroni URL`` is given); the verdict
(`replication_check`) is a pure function of them. It warns only where it matters: when
the fencing terms, checkpoints or ledger tables exist (those features are in use or
planned); otherwise it passes and says what it found.
"""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from typing import Any

from .doctor_checks import Check

__all__ = [
    "REPLICATION_QUERY",
    "STANDBYS_QUERY",
    "ReplicationFacts",
    "patroni_synchronous_mode",
    "replication_check",
]

REPLICATION_QUERY = (
    "SELECT pg_catalog.current_setting('synchronous_standby_names'),"
    " pg_catalog.current_setting('synchronous_commit')"
)
STANDBYS_QUERY = (
    "SELECT application_name::text, state::text, sync_state::text"
    " FROM pg_catalog.pg_stat_replication ORDER BY application_name"
)
"""The standbys streaming from this server. Without ``pg_read_all_stats`` (or
``pg_monitor``) a role sees the rows with ``state`` and ``sync_state`` NULL."""

DURABLE_COMMIT = ("on", "remote_write", "remote_apply")
"""``synchronous_commit`` values that wait for a synchronous standby."""

SYNC_STATES = ("sync", "quorum")

FIX = (
    "make replication synchronous: synchronous_standby_names = 'ANY 1 (*)' (or the "
    "standbys' names) with synchronous_commit = on (or remote_apply); under Patroni "
    "synchronous_mode: true (patronictl edit-config); else expect a failover after a crash "
    "to lose the last commits (docs/guarantees.md, What survives a failover)"
)


@dataclass
class ReplicationFacts:
    """The replication settings and standbys doctor read (``None``: not read).

    Attributes:
        standby_names: ``synchronous_standby_names``.
        synchronous_commit: on doctor's session (the role's and database's setting).
        standbys: ``(application_name, state, sync_state)`` per walsender.
        patroni: Patroni's ``synchronous_mode`` from its REST ``/config`` (``None``: no
            ``--patroni`` given).
        error: why the settings or Patroni could not be read.
    """

    standby_names: str | None = None
    synchronous_commit: str | None = None
    standbys: list[tuple[str, str | None, str | None]] = field(default_factory=list)
    patroni: bool | None = None
    error: str | None = None


def patroni_synchronous_mode(url: str, timeout_s: float) -> bool:
    """``synchronous_mode`` in Patroni's dynamic configuration (``GET URL/config``;
    absent: false).

    Raises:
        ValueError: no answer, or not Patroni's configuration.
    """
    address = url.rstrip("/") + "/config"
    if not address.startswith(("http://", "https://")):
        raise ValueError(f"--patroni {url!r}: not an http(s) URL")
    try:
        with urllib.request.urlopen(address, timeout=timeout_s) as answer:
            config: Any = json.loads(answer.read(1_000_000))
    except (OSError, urllib.error.URLError, json.JSONDecodeError) as exc:
        raise ValueError(f"Patroni's {address}: {exc}") from None
    if not isinstance(config, dict):
        raise ValueError(f"Patroni's {address}: not a configuration object")
    mode = config.get("synchronous_mode", False)
    return mode is True or str(mode).lower() in ("true", "on", "quorum")


def replication_check(facts: ReplicationFacts, in_recovery: bool, in_use: list[str]) -> Check:
    """The verdict: ``in_use`` names the features whose tables exist (fencing,
    checkpoints, the ledger): with none, nothing this library writes is at stake and the
    check passes with what it found."""
    details: dict[str, Any] = {
        "synchronous_standby_names": facts.standby_names,
        "synchronous_commit": facts.synchronous_commit,
        "standbys": [
            {"name": name, "state": state, "sync_state": sync}
            for name, state, sync in facts.standbys
        ],
        "patroni_synchronous_mode": facts.patroni,
        "in_use": in_use,
    }
    if in_recovery:
        return Check("replication", "pass", "a standby: checked on the primary", None, details)
    if facts.error is not None:
        return Check("replication", "warn", f"could not be read: {facts.error}", None, details)
    sync = [name for name, _, state in facts.standbys if state in SYNC_STATES]
    hidden = [name for name, _, state in facts.standbys if state is None]
    durable = facts.synchronous_commit in DURABLE_COMMIT
    names = facts.standby_names or "''"
    standbys = ", ".join(f"{n or '?'} ({s or 'sync_state hidden'})" for n, _, s in facts.standbys)
    found = (
        f"synchronous_standby_names = {names}, synchronous_commit = "
        f"{facts.synchronous_commit}, "
        + (f"standbys: {standbys}" if standbys else "no standby streaming from this server")
        + ("" if facts.patroni is None else f", Patroni synchronous_mode = {facts.patroni}")
    )
    if facts.patroni is False:
        lost = "Patroni runs asynchronous replication (synchronous_mode is off)"
    elif sync and durable:
        return Check(
            "replication",
            "pass",
            f"synchronous: {found}. A claim, a term and a checkpoint survive a failover "
            "to a synchronous standby",
            None,
            details,
        )
    elif sync:
        lost = (
            f"synchronous_commit = {facts.synchronous_commit} does not wait for the "
            "synchronous standby"
        )
    elif hidden and not facts.standby_names:
        lost = "the standbys are asynchronous (synchronous_standby_names is empty)"
    elif hidden:
        return Check(
            "replication",
            "warn",
            f"{found}: this role cannot see which standbys are synchronous",
            "run doctor as a member of pg_monitor (or pg_read_all_stats)",
            details,
        )
    elif facts.standbys:
        lost = "every standby is asynchronous"
    else:
        lost = (
            "without a synchronous standby (if this server is made highly available some "
            "other way, a managed service, check that its failover is synchronous)"
        )
    summary = (
        f"{found}. {lost[0].upper()}{lost[1:]}: a failover after a crash can lose the "
        "last commits before it: ledger claims (those slots run again), terms, "
        "checkpoints (they move back) and fenced rows"
    )
    if not in_use:
        return Check(
            "replication",
            "pass",
            f"{summary}; none of the tables of fencing, checkpoints or the ledger exists "
            "yet (this matters once they are used)",
            None,
            details,
        )
    return Check("replication", "warn", f"{summary} (in use: {', '.join(in_use)})", FIX, details)
