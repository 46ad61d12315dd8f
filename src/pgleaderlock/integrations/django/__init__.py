"""Django: locks configured from ``settings.py``, and ``manage.py`` commands that run a
management command as a fleet singleton and show who leads.

Install it with ``pip install 'pgleaderlock[django]'`` and add the app:

```python
INSTALLED_APPS = [..., "pgleaderlock.integrations.django"]
PGLEADERLOCK = {"OPTIONS": {"fencing": True}}  # optional, see conf.Settings
```

The database comes from ``DATABASES`` (alias ``"default"`` unless
``PGLEADERLOCK["DATABASE"]`` names another; it must be PostgreSQL). Other code gets
locks configured the same way:

```python
from pgleaderlock.integrations.django import lock, threaded_lock

async with lock("reports") as leader: ...   # a LeaderLock
with threaded_lock("reports") as leader: ...  # a ThreadedLeaderLock, for sync code
```

The commands: ``manage.py pgleaderlock_singleton --name NAME -- COMMAND [ARGS]``
(see `pgleaderlock.integrations.django.singleton`) and ``manage.py pgleaderlock_status``
(see `pgleaderlock.integrations.django.report`).
"""

from __future__ import annotations

from typing import Any

from ..._extras import needs_extra

with needs_extra("pgleaderlock.integrations.django", "Django", "django"):
    import django  # noqa: F401

from ...lowlevel import LeaderLock
from ...threaded import ThreadedLeaderLock
from .conf import LOCK_OPTIONS, Settings, build_dsn, load, make_lock

__all__ = ["LOCK_OPTIONS", "Settings", "dsn", "get_settings", "lock", "threaded_lock"]


def get_settings() -> Settings:
    """``settings.PGLEADERLOCK``, checked.

    Raises:
        ImproperlyConfigured: see [`load`][pgleaderlock.integrations.django.conf.load].
    """
    return load()


def dsn(alias: str | None = None) -> str:
    """The libpq connection string for ``DATABASES[alias]`` (default: the alias of
    ``PGLEADERLOCK["DATABASE"]``, else ``"default"``). It holds the password: pass it
    on, never log it.

    Raises:
        ImproperlyConfigured: see
            [`build_dsn`][pgleaderlock.integrations.django.conf.build_dsn].
    """
    return build_dsn(alias if alias is not None else load().database)


def lock(name: str, **overrides: Any) -> LeaderLock:
    """A [`LeaderLock`][pgleaderlock.LeaderLock] named ``name`` on the app's database,
    with ``PGLEADERLOCK["OPTIONS"]`` and then ``overrides``: flat names, as in the
    settings (the specification's [`LeaderLock`][pgleaderlock.LeaderLock] arguments,
    ``connect_fn`` included, and the option groups' fields: ``lease_s``, ``fencing``...;
    see [`lock_arguments`][pgleaderlock.core.options.lock_arguments]), or
    ``options=LockOptions(...)``. Not started.

    Raises:
        ImproperlyConfigured: bad settings, or the lock refused the options.
    """
    settings = load()
    return make_lock(name, build_dsn(settings.database), {**settings.options, **overrides})


def threaded_lock(
    name: str, *, start_timeout_s: float = 30.0, **overrides: Any
) -> ThreadedLeaderLock:
    """[`lock`][pgleaderlock.integrations.django.lock] in its own thread, for sync code
    (views, management commands, signal handlers): a
    [`ThreadedLeaderLock`][pgleaderlock.ThreadedLeaderLock], not started."""
    return ThreadedLeaderLock(lock(name, **overrides), start_timeout_s=start_timeout_s)
