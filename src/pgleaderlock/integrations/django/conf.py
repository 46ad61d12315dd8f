"""The app's settings: ``settings.PGLEADERLOCK``, and the DSN built from ``DATABASES``.

```python
PGLEADERLOCK = {
    "DATABASE": "default",          # the alias in DATABASES (a PostgreSQL one)
    "OPTIONS": {"fencing": True, "lease_s": 30},  # LeaderLock keyword arguments
    "LOCKS": ["nightly", "beat"],   # the locks `manage.py pgleaderlock_status` shows
    "LEDGER": {"schema": "public"}, # where the schedule ledger's tables are
}
```

Every key is optional. Everything is read when it is asked for (never cached), so
``override_settings`` in tests works; bad settings raise ``ImproperlyConfigured`` with
what is wrong and what is accepted.
"""

from __future__ import annotations

import inspect
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import psycopg
from django.conf import settings as django_settings
from django.core.exceptions import ImproperlyConfigured
from django.db import connections
from django.utils.connection import ConnectionDoesNotExist
from psycopg.conninfo import make_conninfo

from ...lowlevel import DEPRECATED_KEYWORDS, LeaderLock, PgLeaderLockError, lock_arguments
from ...schedule.ledger import RunTable, ScheduleTable

__all__ = ["LOCK_OPTIONS", "Settings", "build_dsn", "check_lock_options", "load", "make_lock"]

SETTING = "PGLEADERLOCK"
"""The name of the settings dict."""

_KEYS = ("DATABASE", "OPTIONS", "LOCKS", "LEDGER")
_LEDGER_KEYS = ("schema", "runs_table", "schedules_table")

_NOT_OPTIONS = frozenset({"dsn", "key1", "key2", "name", "connect_fn", "shutdown_event"})
LOCK_OPTIONS: tuple[str, ...] = (
    *(
        p.name
        for p in inspect.signature(LeaderLock.__init__).parameters.values()
        if p.kind is inspect.Parameter.KEYWORD_ONLY
        and p.name not in _NOT_OPTIONS
        and p.name != "options"
    ),
    *DEPRECATED_KEYWORDS,
)
"""The settings ``OPTIONS`` may give: the [`LeaderLock`][pgleaderlock.LeaderLock]
arguments of the specification (all but the DSN, keys, name, ``connect_fn`` and
``shutdown_event``, which the app or the caller gives), and every field of the option
groups by its flat name (``fencing``, ``lease_s``, ``trusted_roles``...: a settings
file stays flat; see [`DEPRECATED_KEYWORDS`][pgleaderlock.core.options.DEPRECATED_KEYWORDS]
for where each goes). They become the lock's ``options=`` without a warning."""

_DJANGO_ONLY_OPTIONS = frozenset(
    {"assume_role", "isolation_level", "pool", "server_side_binding", "cursor_factory",
     "context", "prepare_threshold"}
)  # fmt: skip
"""Keys of ``DATABASES[...]["OPTIONS"]`` that Django (or psycopg's Python side) uses and
libpq does not know: left out of the DSN."""


@dataclass(frozen=True)
class Settings:
    """``settings.PGLEADERLOCK``, checked.

    Attributes:
        database: the alias in ``DATABASES`` whose database holds the locks.
        options: settings of every lock the app makes, by their flat names (see
            ``LOCK_OPTIONS``; ``lock(name, **overrides)`` overrides them).
        locks: the lock names ``pgleaderlock_status`` shows by default.
        ledger_schema: the schema of the schedule ledger's tables (default: the
            ``fencing_schema`` of ``options``, as for a
            `pgleaderlock.schedule.Scheduler`).
        runs_table: the ledger's table of runs.
        schedules_table: the ledger's table of schedules.
    """

    database: str = "default"
    options: Mapping[str, Any] = field(default_factory=dict)
    locks: tuple[str, ...] = ()
    ledger_schema: str | None = None
    runs_table: str = RunTable.name
    schedules_table: str = ScheduleTable.name

    def ledger_tables(self) -> tuple[RunTable, ScheduleTable]:
        """The ledger's tables, as a `pgleaderlock.schedule.Scheduler` with
        these lock options names them."""
        schema = self.ledger_schema
        if schema is None:
            schema = str(self.options.get("fencing_schema", RunTable.schema))
        trusted = tuple(self.options.get("trusted_roles", ()))
        try:
            return (
                RunTable(self.runs_table, schema, trusted),
                ScheduleTable(self.schedules_table, schema, trusted),
            )
        except PgLeaderLockError as exc:
            raise ImproperlyConfigured(f"{SETTING}['LEDGER']: {exc}") from None


def load() -> Settings:
    """``settings.PGLEADERLOCK``, checked (an absent setting is all defaults).

    Raises:
        ImproperlyConfigured: an unknown key, a value of the wrong type, an alias
            missing from ``DATABASES`` or not PostgreSQL, a lock option that
            [`LeaderLock`][pgleaderlock.LeaderLock] does not take or refuses.
    """
    raw = getattr(django_settings, SETTING, None)
    if raw is None:
        raw = {}
    if not isinstance(raw, Mapping):
        raise ImproperlyConfigured(f"{SETTING} must be a dict, got {type(raw).__name__}")
    unknown = sorted(str(k) for k in raw if k not in _KEYS)
    if unknown:
        raise ImproperlyConfigured(
            f"{SETTING} has unknown keys {unknown}; the keys are {list(_KEYS)}"
        )
    database = raw.get("DATABASE", "default")
    if not isinstance(database, str) or not database:
        raise ImproperlyConfigured(
            f"{SETTING}['DATABASE'] must be an alias in DATABASES, got {database!r}"
        )
    options = _options(raw.get("OPTIONS", {}))
    locks = _locks(raw.get("LOCKS", ()))
    ledger = raw.get("LEDGER", {})
    if not isinstance(ledger, Mapping):
        raise ImproperlyConfigured(f"{SETTING}['LEDGER'] must be a dict, got {ledger!r}")
    unknown = sorted(str(k) for k in ledger if k not in _LEDGER_KEYS)
    if unknown:
        raise ImproperlyConfigured(
            f"{SETTING}['LEDGER'] has unknown keys {unknown}; the keys are {list(_LEDGER_KEYS)}"
        )
    result = Settings(
        database=database,
        options=options,
        locks=locks,
        ledger_schema=ledger.get("schema"),
        runs_table=ledger.get("runs_table", RunTable.name),
        schedules_table=ledger.get("schedules_table", ScheduleTable.name),
    )
    result.ledger_tables()  # names checked
    dsn = build_dsn(database)
    check_lock_options(dsn, options)
    return result


def _options(options: object) -> dict[str, Any]:
    if not isinstance(options, Mapping):
        raise ImproperlyConfigured(
            f"{SETTING}['OPTIONS'] must be a dict of LeaderLock arguments, got {options!r}"
        )
    unknown = sorted(str(k) for k in options if k not in LOCK_OPTIONS)
    if unknown:
        raise ImproperlyConfigured(
            f"{SETTING}['OPTIONS'] has keys that are not LeaderLock arguments: {unknown}; "
            f"they are {list(LOCK_OPTIONS)}"
        )
    return dict(options)


def _locks(locks: object) -> tuple[str, ...]:
    if isinstance(locks, str) or not isinstance(locks, Sequence):
        raise ImproperlyConfigured(
            f"{SETTING}['LOCKS'] must be a list of lock names, got {locks!r}"
        )
    for name in locks:
        if not isinstance(name, str) or not name:
            raise ImproperlyConfigured(
                f"{SETTING}['LOCKS'] must be a list of lock names, got the item {name!r}"
            )
    return tuple(locks)


def make_lock(name: str, dsn: str, options: Mapping[str, Any]) -> LeaderLock:
    """``LeaderLock.from_name(name, dsn, **options)`` (no I/O); an argument the lock
    refuses is an ``ImproperlyConfigured``."""
    try:
        return LeaderLock.from_name(name, dsn, **lock_arguments(options))
    except (TypeError, PgLeaderLockError) as exc:
        raise ImproperlyConfigured(f"lock {name!r}: {exc}") from None


def check_lock_options(dsn: str, options: Mapping[str, Any]) -> None:
    """Build (and drop: no I/O) a lock with ``options``, so that a value the lock
    refuses is an ``ImproperlyConfigured`` at once, not when a lock is first made."""
    try:
        LeaderLock.from_name(
            "pgleaderlock-settings-check",
            dsn,
            **lock_arguments({**options, "load_plugins": False}),
        )
    except (TypeError, PgLeaderLockError) as exc:
        raise ImproperlyConfigured(f"{SETTING}['OPTIONS']: {exc}") from None


def build_dsn(alias: str = "default") -> str:
    """A libpq connection string (``key=value ...``, quoted) for ``DATABASES[alias]``.

    Made from ``NAME``, ``USER``, ``PASSWORD``, ``HOST`` (a host name, an address, or a
    unix socket directory), ``PORT`` and the libpq keys of ``OPTIONS`` (``sslmode``,
    ``options``, ``service``, ``passfile``, ...), as Django's own PostgreSQL backend
    reads them; Django's own keys of ``OPTIONS`` (``isolation_level``, ``pool``,
    ``assume_role``, ``server_side_binding``, ...) are left out. An empty ``NAME`` with
    ``OPTIONS["service"]`` takes the database from the service file, ``NAME = None``
    is the ``postgres`` database, as in Django.

    The string holds the password: never log it (``pgleaderlock``'s messages mask it).

    Raises:
        ImproperlyConfigured: no such alias, not a PostgreSQL database, or an entry that
            does not make a valid connection string.
    """
    try:
        wrapper = connections[alias]
    except ConnectionDoesNotExist:
        raise ImproperlyConfigured(
            f"{SETTING}['DATABASE'] is {alias!r}, which is not in DATABASES "
            f"(the aliases: {sorted(connections.settings)})"
        ) from None
    entry = wrapper.settings_dict
    if wrapper.vendor != "postgresql":
        raise ImproperlyConfigured(
            f"DATABASES[{alias!r}] uses ENGINE {entry.get('ENGINE')!r} (vendor "
            f"{wrapper.vendor!r}): pgleaderlock needs a PostgreSQL database "
            "(ENGINE 'django.db.backends.postgresql')"
        )
    options = entry.get("OPTIONS") or {}
    params: dict[str, Any] = {
        str(k): v for k, v in options.items() if k not in _DJANGO_ONLY_OPTIONS
    }
    name = entry.get("NAME")
    if name is None:
        params.pop("service", None)
        params["dbname"] = "postgres"
    elif name:
        params["dbname"] = name
    elif not params.get("service"):
        raise ImproperlyConfigured(
            f"DATABASES[{alias!r}] has no NAME (nor OPTIONS['service']): which database?"
        )
    for key, param in (("USER", "user"), ("PASSWORD", "password"), ("HOST", "host"),
                       ("PORT", "port")):  # fmt: skip
        value = entry.get(key)
        if value:
            params[param] = value
    for key, value in params.items():
        if isinstance(value, bool) or not isinstance(value, str | int | float):
            raise ImproperlyConfigured(
                f"DATABASES[{alias!r}]: {key!r} must be a string or a number for libpq, "
                f"got a {type(value).__name__}"
            )
    try:
        return make_conninfo("", **{k: str(v) for k, v in params.items()})
    except psycopg.ProgrammingError as exc:
        # libpq names the bad keyword; the message never holds the password's value.
        raise ImproperlyConfigured(
            f"DATABASES[{alias!r}] does not make a valid connection string: {exc}"
        ) from None
