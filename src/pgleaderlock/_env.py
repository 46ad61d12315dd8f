"""The environment variables a DSN is read from, in one order everywhere.

The command line (``--dsn``), Celery beat (``pgleaderlock_dsn``) and ``pgleaderlock
cron`` take an explicit DSN first; without one they read ``PGLEADERLOCK_DSN``, then
``PG_DSN`` (the first one set and not blank). Django's integration builds its DSN from
``DATABASES`` instead. See docs/configuration.md ("Where the DSN comes from").
"""

from __future__ import annotations

import os

__all__ = ["DSN_VARIABLES", "dsn_from_environment"]

DSN_VARIABLES = ("PGLEADERLOCK_DSN", "PG_DSN")
"""The environment variables of the DSN, first one first."""


def dsn_from_environment() -> str | None:
    """The first of `DSN_VARIABLES` that is set and not blank, else ``None``."""
    for name in DSN_VARIABLES:
        value = os.environ.get(name, "")
        if value.strip():
            return value
    return None
