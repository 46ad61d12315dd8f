"""Escalation of errors that keep a lock from leading (part of the machine's policy).

A lock that cannot reach its server retries for ever (it stops only on errors that
retrying cannot mend: ``retry_permanent_errors`` in docs/configuration.md). Logging
every retry's error at ERROR buries the one line that matters under an identical line
every two seconds, and says nothing about how long it has been going on. So, for a run
of errors with no attempt in between that reached the server (a *failing streak*):

- the first error, and each error that differs from the last one logged, is logged at
  ERROR (``db_error``), as before;
- a repeat of the same error is logged at DEBUG;
- once the streak has lasted ``escalate_after_s``, a summary at ERROR
  (``lock_failing``) says for how long, how many errors, the last one and what to
  check, and it is repeated at doubling intervals (at most every
  `MAX_SUMMARY_INTERVAL_S`);
- when an attempt reaches the server again (the lock is granted, or found held by
  another session), the streak ends; after a summary, ``failing_ended`` (INFO) says so.

Pure: the caller passes the time; nothing here does I/O.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..errors import ServerRefusedError
from .effects import LogLevel

__all__ = ["MAX_SUMMARY_INTERVAL_S", "FailingStreak", "what_to_check"]

MAX_SUMMARY_INTERVAL_S = 600.0
"""The longest time between two ``lock_failing`` summaries of one streak."""


@dataclass(frozen=True)
class Escalated:
    """How to log one error of a streak: level, message and extra fields."""

    level: LogLevel
    message: str
    fields: tuple[tuple[str, object], ...] = ()


class FailingStreak:
    """The current failing streak of one lock (see the module docstring).

    Args:
        escalate_after_s: how long a streak lasts before its first summary.
    """

    def __init__(self, escalate_after_s: float) -> None:
        self.escalate_after_s = escalate_after_s
        self.since: float | None = None  # monotonic start of the streak
        self.errors = 0
        self._summary_at = 0.0
        self._summaries = 0
        self._logged: str | None = None  # the text of the last error logged at ERROR

    def error(self, error: BaseException, text: str, now: float) -> Escalated:
        """One more error at ``now`` (``text``: how it is logged); how to log it."""
        if self.since is None:
            self.since, self.errors, self._summaries = now, 0, 0
            self._summary_at = now + self.escalate_after_s
            self._logged = None
        self.errors += 1
        if now >= self._summary_at:
            failing_for = now - self.since
            self._summaries += 1
            self._summary_at = now + min(max(failing_for, self.escalate_after_s),
                                         MAX_SUMMARY_INTERVAL_S)  # fmt: skip
            self._logged = text
            return Escalated("error", "lock_failing", (
                ("failing_for_s", round(failing_for, 1)),
                ("errors", self.errors),
                ("error", text),
                ("check", what_to_check(error)),
            ))  # fmt: skip
        if text != self._logged:
            self._logged = text
            return Escalated("error", "db_error")
        return Escalated("debug", "db_error", (("repeated", self.errors),))

    def end(self, now: float) -> Escalated | None:
        """An attempt reached the server: the streak (if any) is over. Returns the line
        that says so when a summary was logged, else ``None``."""
        since, summaries = self.since, self._summaries
        self.since, self.errors, self._summaries, self._logged = None, 0, 0, None
        if since is None or not summaries:
            return None
        return Escalated("info", "failing_ended", (("failed_for_s", round(now - since, 1)),))


_HINTS: tuple[tuple[tuple[str, ...], str], ...] = (
    (
        ("resolve host", "name or service not known", "could not translate host name",
         "nodename nor servname", "temporary failure in name resolution"),
        "the DSN's host name does not resolve: check its spelling, and DNS from this "
        "machine (getent hosts NAME)",
    ),
    (
        ("too many connections", "too many clients", "remaining connection slots",
         "connection limit"),
        "the server refuses new sessions: check max_connections against the sessions in "
        "use (SELECT count(*) FROM pg_stat_activity), and the CONNECTION LIMIT of the "
        "role (pg_roles.rolconnlimit) and of the database; every lock needs a session "
        "of its own",
    ),
    (
        ("connection refused",),
        "nothing accepts connections at the DSN's host and port: is the server running, "
        "is the port right, does listen_addresses include this address?",
    ),
    (
        ("starting up", "shutting down", "in recovery", "recovery mode", "standby"),
        "the server is starting, stopping, or is a standby: wait for it, or point the DSN "
        "at the primary (target_session_attrs=read-write)",
    ),
    (
        ("timed out", "timeout"),
        "the server does not answer in time: check the network path and firewalls to the "
        "DSN's host, and the server's load",
    ),
    (
        ("no pg_hba.conf entry", "ssl"),
        "the server rejects this client's connection settings: check pg_hba.conf and the "
        "DSN's sslmode",
    ),
)  # fmt: skip


def what_to_check(error: BaseException) -> str:
    """A hint for an operator: what to look at for ``error`` (from its text)."""
    if isinstance(error, ServerRefusedError):
        return (
            "the server refuses this client: check the password, the role and the database "
            "name in the DSN, and pg_hba.conf"
        )
    texts = [str(error)]
    cause = error.__cause__
    while cause is not None and len(texts) < 5:
        texts.append(str(cause))
        cause = cause.__cause__
    text = " ".join(texts).lower()
    for needles, hint in _HINTS:
        if any(needle in text for needle in needles):
            return hint
    return (
        "check that this machine reaches the server with the DSN's settings "
        "(psql with the same DSN) and the server's log"
    )
