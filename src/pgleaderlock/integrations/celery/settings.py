"""The Celery beat integration's settings, read from the Celery configuration."""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import click  # Celery's command line is click's

from ..._env import dsn_from_environment
from ...lowlevel import (
    DEFAULT_SCHEMA,
    ConfigurationError,
    LeaderLock,
    lock_arguments,
    not_negative,
    positive,
)
from ...schedule import Policy, Retry, SlotGuard
from ...schedule.policy import takes_old_keywords

__all__ = ["BeatConfigurationError", "BeatSettings"]


class BeatConfigurationError(ConfigurationError, click.ClickException):
    """A bad or missing setting of the beat integration: a
    [`ConfigurationError`][pgleaderlock.ConfigurationError] for library callers, and for
    ``celery beat`` (a click program) one line, ``Error: <message>``, with exit status 1,
    instead of a traceback."""

    def __init__(self, message: str) -> None:
        click.ClickException.__init__(self, message)


def _one_line(record: logging.LogRecord) -> bool:
    """``celery -q beat`` logs what its scheduler raised with the traceback (as
    CRITICAL) before click shows it: for a `BeatConfigurationError`, the message is
    enough."""
    if record.exc_info and isinstance(record.exc_info[1], BeatConfigurationError):
        record.exc_info = None
        record.exc_text = None
    return True


logging.getLogger("celery.beat").addFilter(_one_line)


BEAT_POLICY = Policy(misfire_grace_s=30.0)
"""The policy of beat's entries when the configuration sets none of its settings."""


@takes_old_keywords(BEAT_POLICY)
@dataclass(frozen=True)
class BeatSettings:
    """The integration's settings, read from the Celery configuration (lowercase names;
    with Django's ``config_from_object("django.conf:settings", namespace="CELERY")`` they
    are ``CELERY_PGLEADERLOCK_DSN`` and so on).

    Attributes:
        dsn: ``pgleaderlock_dsn``, else the ``PGLEADERLOCK_DSN`` environment variable,
            else ``PG_DSN``.
        lock_name: ``pgleaderlock_lock_name``; default ``celery-beat:<app main name>``.
            Every replica of one beat must use the same name; two beats with different
            schedules must not.
        policy: the [`Policy`][pgleaderlock.schedule.Policy] of every entry, from five
            settings: ``pgleaderlock_catch_up`` (``"none"``, ``"latest"`` or ``"all"``,
            default ``"latest"``): the slots that fell due while nobody led;
            ``pgleaderlock_max_catch_up`` (default 100), for ``"all"``;
            ``pgleaderlock_misfire_grace_s`` (default 30, not the policy's 1): a slot sent
            later than this after its time counts as missed and ``catch_up`` decides it
            (keep it above the fail-over bound: the lock's ``lease_s`` plus its retry
            delay; for crontab entries, Celery's ``beat_cron_starting_deadline``, when
            set, replaces it and ``catch_up``: a later slot is not sent);
            ``pgleaderlock_interrupted`` (``"lost"`` or ``"rerun"``, default
            ``"lost"``): a slot whose leader died between claiming it and recording the
            send (see the guide: ``"lost"`` never sends twice; ``"rerun"`` with the
            workers' [`SlotTask`][pgleaderlock.integrations.celery.SlotTask] runs each
            slot exactly once); ``pgleaderlock_retry`` (a
            [`Retry`][pgleaderlock.schedule.Retry], or a dict of its fields; default:
            no retry): a send that raised (the broker unreachable) is sent again after a
            back-off, as a new attempt of its slot, with the same task id (the workers'
            ``SlotTask`` runs one copy).
        tick_s: ``pgleaderlock_tick_s`` (default 1): the longest sleep of beat's loop,
            and so how soon a schedule change is picked up.
        lease_s: ``pgleaderlock_lease_s`` (default: the lock's, twice
            ``health_interval_s``): how long a frozen leader keeps its lock.
        health_interval_s: ``pgleaderlock_health_interval_s`` (default: the lock's).
        drain_s: ``pgleaderlock_drain_s`` (default 5): on a graceful stop (SIGTERM), how
            long a send in progress may take to finish before the lock is released.
        shutdown_timeout_s: ``pgleaderlock_shutdown_timeout_s`` (default 30).
        lock_options: ``pgleaderlock_lock_options``, a dict of further
            [`LeaderLock`][pgleaderlock.LeaderLock] arguments (``retry_strategy``,
            ``fencing_schema``, ...).
        worker_dsn: ``pgleaderlock_worker_dsn`` (default: ``dsn``): the DSN a worker's
            [`SlotTask`][pgleaderlock.integrations.celery.SlotTask] guard connects with
            (a role with only what ``pgleaderlock sql --worker-role`` grants will do).
        guard_timeout_s: ``pgleaderlock_guard_timeout_s`` (default 10): bounds the
            guard's call before each task of a slot (connect, check, update).
    """

    dsn: str = field(repr=False)  # it may carry a password
    lock_name: str
    policy: Policy = field(default_factory=lambda: BEAT_POLICY)
    tick_s: float = 1.0
    lease_s: float | None = None
    health_interval_s: float | None = None
    drain_s: float = 5.0
    shutdown_timeout_s: float = 30.0
    lock_options: Mapping[str, Any] = field(default_factory=dict)
    worker_dsn: str | None = field(default=None, repr=False)
    guard_timeout_s: float = 10.0

    @classmethod
    def from_app(cls, app: Any) -> BeatSettings:
        """The settings of the Celery ``app``.

        Raises:
            ConfigurationError: no DSN, no lock name to derive, or a bad value (the
                message names the setting).
        """
        conf = app.conf

        def get(name: str, default: Any) -> Any:
            value = conf.get(f"pgleaderlock_{name}", None)
            return default if value is None else value

        dsn = get("dsn", None) or dsn_from_environment() or ""
        if not isinstance(dsn, str) or not dsn:
            raise ConfigurationError(
                "the Celery beat integration needs a PostgreSQL DSN: set pgleaderlock_dsn "
                "in the Celery configuration, or PGLEADERLOCK_DSN or PG_DSN in the environment"
            )
        main = getattr(app, "main", None)
        lock_name = get("lock_name", None)
        if lock_name is None:
            if not main or main == "__main__":
                raise ConfigurationError(
                    "set pgleaderlock_lock_name in the Celery configuration: the app has no "
                    f"main name to derive the lock's name from (main={main!r})"
                )
            lock_name = f"celery-beat:{main}"
        if not isinstance(lock_name, str) or not lock_name:
            raise ConfigurationError(
                f"pgleaderlock_lock_name must be a non-empty string, got {lock_name!r}"
            )
        policy: dict[str, Any] = {}
        for name in ("catch_up", "max_catch_up", "interrupted", "misfire_grace_s"):
            value = get(name, None)
            if value is not None:
                policy[name] = value
        retry = get("retry", None)
        if retry is not None:
            policy["retry"] = _retry(retry)
        try:
            chosen = dataclasses.replace(BEAT_POLICY, **policy)
        except ConfigurationError as exc:  # its message begins with the field's name
            raise ConfigurationError(f"pgleaderlock_{exc}") from None
        lock_options = get("lock_options", {})
        if not isinstance(lock_options, Mapping):
            raise ConfigurationError(
                f"pgleaderlock_lock_options must be a dict of LeaderLock arguments, "
                f"got {lock_options!r}"
            )
        worker_dsn = get("worker_dsn", None)
        if worker_dsn is not None and (not isinstance(worker_dsn, str) or not worker_dsn):
            raise ConfigurationError(
                "pgleaderlock_worker_dsn must be a non-empty string, "
                f"got a {type(worker_dsn).__name__}"
            )
        return cls(
            dsn=dsn,
            lock_name=lock_name,
            policy=chosen,
            tick_s=_seconds("tick_s", get("tick_s", 1.0)),
            lease_s=_seconds("lease_s", get("lease_s", None), optional=True),
            health_interval_s=_seconds(
                "health_interval_s", get("health_interval_s", None), optional=True
            ),
            drain_s=_seconds("drain_s", get("drain_s", 5.0), zero=True),
            shutdown_timeout_s=_seconds("shutdown_timeout_s", get("shutdown_timeout_s", 30.0)),
            lock_options=dict(lock_options),
            worker_dsn=worker_dsn,
            guard_timeout_s=_seconds("guard_timeout_s", get("guard_timeout_s", 10.0)),
        )

    def make_lock(self) -> LeaderLock:
        """The [`LeaderLock`][pgleaderlock.LeaderLock] (with fencing) these settings
        describe, not started."""
        options: dict[str, Any] = {"drain_s": self.drain_s, **self.lock_options}
        if self.lease_s is not None:
            options["lease_s"] = self.lease_s
        if self.health_interval_s is not None:
            options["health_interval_s"] = self.health_interval_s
        options["fencing"] = True
        return LeaderLock.from_name(self.lock_name, dsn=self.dsn, **lock_arguments(options))

    def slot_guard(self) -> SlotGuard:
        """The [`SlotGuard`][pgleaderlock.schedule.SlotGuard] of a worker's tasks: the
        runs table of these settings' ledger (the lock's ``fencing_schema`` and
        ``trusted_roles``), through ``worker_dsn`` or ``dsn``."""
        options = self.lock_options
        return SlotGuard(
            self.worker_dsn or self.dsn,
            backend=options.get("backend"),
            schema=options.get("fencing_schema", DEFAULT_SCHEMA),
            trusted_roles=options.get("trusted_roles", ()),
            timeout_s=self.guard_timeout_s,
        )


def _retry(value: object) -> Retry:
    """``pgleaderlock_retry``: a ``Retry``, or a dict of its fields."""
    if isinstance(value, Retry):
        return value
    if not isinstance(value, Mapping):
        raise ConfigurationError(
            f"pgleaderlock_retry must be a Retry or a dict of its fields (max_attempts, "
            f"backoff_s, max_backoff_s, on), got {value!r}"
        )
    fields = {f.name for f in dataclasses.fields(Retry)}
    unknown = sorted(str(name) for name in value if name not in fields)
    if unknown:
        raise ConfigurationError(
            f"pgleaderlock_retry: unknown field {unknown[0]!r} (the fields are "
            f"{', '.join(sorted(fields))})"
        )
    try:
        return Retry(**value)
    except ConfigurationError as exc:  # its message begins with the field's name
        raise ConfigurationError(f"pgleaderlock_retry: {exc}") from None


def _seconds(name: str, value: Any, *, optional: bool = False, zero: bool = False) -> Any:
    """A setting's seconds, checked as every duration option is (finite, not a bool,
    at most ``MAX_SECONDS``)."""
    if value is None and optional:
        return None
    check = not_negative if zero else positive
    return check(f"pgleaderlock_{name}", value)
