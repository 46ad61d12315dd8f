"""``LeaderDatabaseScheduler``: django-celery-beat's ``DatabaseScheduler``, sending
only on the leader. Made on first use: django-celery-beat's scheduler module needs a
configured Django, which importing the integration must not."""

from __future__ import annotations

import datetime as dt
from typing import Any

from .scheduler import PUBLIC_MODULE, LeaderSchedulerMixin

__all__ = ["leader_database_scheduler"]


class _DatabaseMixin(LeaderSchedulerMixin):
    """What django-celery-beat's entries add: a start time, an expiry, one-off tasks."""

    refuse_at_start = False

    def enabled_models_qs(self) -> Any:
        # Every enabled task: DatabaseScheduler leaves out the crontabs not due in the
        # next hours (to keep its heap small), which would take jobs off the ledger
        # and back.
        return self.Model.objects.enabled()  # type: ignore[attr-defined]

    def _pgl_eligible(self, name: str, entry: Any) -> tuple[str, str] | None:
        model = getattr(entry, "model", None)
        if model is None:
            return None
        if getattr(model, "one_off", False):
            return ("error", "one-off tasks are not supported by the leader scheduler")
        now = dt.datetime.now(dt.UTC)
        start = getattr(model, "start_time", None)
        if start is not None and _aware(start) > now:
            # Not an error: DatabaseScheduler waits for it too, and so does the ledger.
            return ("info", f"starts at {start.isoformat()}: scheduled from then on")
        expires = getattr(model, "expires", None)
        if expires is not None and _aware(expires) <= now:
            return ("info", f"expired at {expires.isoformat()}")
        return None


def _aware(when: dt.datetime) -> dt.datetime:
    return when if when.tzinfo is not None else when.replace(tzinfo=dt.UTC)


_database_scheduler: type[Any] | None = None


def leader_database_scheduler() -> type[Any]:
    """The ``LeaderDatabaseScheduler`` class (made once).

    Raises:
        ImportError: django-celery-beat is not installed.
    """
    global _database_scheduler
    if _database_scheduler is None:
        try:
            from django_celery_beat.schedulers import DatabaseScheduler
        except ImportError as exc:
            raise ImportError(
                f"{PUBLIC_MODULE}.LeaderDatabaseScheduler needs django-celery-beat ({exc}); "
                "install it with: pip install django-celery-beat"
            ) from exc
        _database_scheduler = type(
            "LeaderDatabaseScheduler",
            (_DatabaseMixin, DatabaseScheduler),
            {
                "__module__": PUBLIC_MODULE,
                "__doc__": "django-celery-beat's ``DatabaseScheduler``, sending only on "
                "the leader, every send claimed in the ledger first.",
            },
        )
    return _database_scheduler
